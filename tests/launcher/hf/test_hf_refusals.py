"""train.init_from refuses Hugging Face models meshrun's model cannot reproduce (training/hf/hf_config.py), each
with exit 2, a message naming the key and the fix, and nothing written: config.json written by transformers'
own save_pretrained (the independent source of the format), the command run in-process (tests/helpers/cli.py)."""

from __future__ import annotations

import os

import pytest
from helpers.cli import run_cli

transformers = pytest.importorskip("transformers", reason="the refusals are of configs transformers writes")

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)

# (what, config, the key the message must name)
CASES = [
    (
        "llama rope_scaling linear",
        lambda: transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "rope",
    ),
    (
        "llama rope_scaling dynamic",
        lambda: transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "rope",
    ),
    (
        "gpt2 scale_attn_by_inverse_layer_idx",
        lambda: transformers.GPT2Config(**GPT2, scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx",
    ),
    (
        "gpt2 unscaled attention",
        lambda: transformers.GPT2Config(**GPT2, scale_attn_weights=False),
        "scale_attn_weights",
    ),
    ("gpt2 cross attention", lambda: transformers.GPT2Config(**GPT2, add_cross_attention=True), "add_cross_attention"),
    ("gpt2 relu", lambda: transformers.GPT2Config(**GPT2, activation_function="relu"), "activation_function"),
    ("llama gelu", lambda: transformers.LlamaConfig(**LLAMA, hidden_act="gelu"), "hidden_act"),
]


def _saved(tmp_path, make) -> str:
    d = tmp_path / "hf"
    cfg = make()
    cfg.architectures = ["LlamaForCausalLM" if cfg.model_type == "llama" else "GPT2LMHeadModel"]
    cfg.save_pretrained(str(d))  # config.json as transformers writes it
    return str(d)


@pytest.mark.parametrize("what,make,key", CASES, ids=[c[0] for c in CASES])
def test_unsupported_hf_options_exit_2_naming_the_key(tmp_path, what, make, key):
    src = _saved(tmp_path, make)
    run_dir = tmp_path / "run"
    res = run_cli("action=plan", "data=synthetic", f"train.init_from={src}", f"run.dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert key in res.stderr and "not supported" in res.stderr and "config.json" in res.stderr, res.stderr[-2000:]
    assert not (run_dir / "plan.json").exists()
    assert os.listdir(src) == ["config.json"]  # the source is only read


def test_the_same_configs_without_the_option_are_accepted(tmp_path):
    """The refusal is the option's, not the family's: the plain configs, saved with weights, plan (exit 0)."""
    for i, (cls, fields) in enumerate(
        (
            (transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA)),
            (transformers.GPT2LMHeadModel, transformers.GPT2Config(**GPT2)),
        )
    ):
        src = str(tmp_path / str(i) / "hf")
        cls(fields).save_pretrained(src)  # config.json + model.safetensors
        run_dir = tmp_path / str(i) / "run"
        res = run_cli("action=plan", "data=synthetic", f"train.init_from={src}", f"run.dir={run_dir}", cwd=tmp_path)
        assert res.returncode == 0 and (run_dir / "plan.json").exists(), res.stderr[-2000:]
