"""Hugging Face interop against transformers itself (CPU, fp32): train.init_from, action=export, action=generate.

Reference models are transformers' own GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, rope_theta
500000), randomly initialised and written with save_pretrained. Fast tests convert in this process; the slow
ones launch meshrun: GPT-2 at tp=2 pp=2 (loss, greedy generation, export round trip), and Llama at tp=2 pp=2
dp=2 zero=1 for 5 steps (loss, export -> transformers logits and generation, export -> init_from -> export).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e .[test]")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is a runtime dependency")

from helpers import ROOT  # noqa: E402
from helpers.cli import run_cli  # noqa: E402
from helpers.hf import (
    PROMPT,
    PYTHON,
    _batch,
    _cfg_for,
    _first_loss,
    _hf_greedy,
    _hf_loss,
    _hf_model,
    _rel,  # noqa: E402
    _single_model,
    _tensors,
    _train,
    meshrun,
)

from training.contract.config import Config  # noqa: E402
from training.contract.layout_rules import padded_vocab  # noqa: E402
from training.hf.convert import local_from_hf, to_hf  # noqa: E402
from training.hf.hf_config import (  # noqa: E402
    HFError,
    family_for_model,
    hf_config_from_model,
    model_fields_from_hf,
    read_hf_config,
)
from training.hf.init_from import SliceReader  # noqa: E402
from training.hf.safetensors_index import check_tensors  # noqa: E402

V, SEQ = 97, 32
# A wide init: greedy continuations of a model at the usual 0.02 repeat one token, which would prove little.
STD = 0.5


def _save(model, path: str) -> str:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Directories written by transformers' save_pretrained: gpt2, llama (GQA, untied), llama_tied (biases)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=SEQ,
            vocab_size=V,
            initializer_range=STD,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    llama_kw = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=SEQ,
        initializer_range=STD,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_kw))
    tied = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{**llama_kw, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-6}
        )
    )
    return {
        "gpt2": _save(gpt2, str(root / "gpt2")),
        "llama": _save(llama, str(root / "llama")),
        "llama_tied": _save(tied, str(root / "llama_tied")),
    }


@pytest.mark.parametrize("which", ["gpt2", "llama", "llama_tied"])
def test_import_matches_transformers_and_exports_the_same_tensors(hf_dirs, which):
    """tp=1 import: meshrun's logits equal transformers' (relative 1e-5); to_hf gives back every saved tensor
    bit for bit; config.json written back reads as the same model fields."""
    directory = hf_dirs[which]
    cfg, chunk = _single_model(directory)
    tokens, _ = _batch(cfg, n=2)
    with torch.no_grad():
        ours = chunk(tokens).permute(1, 0, 2)[..., :V]
    with torch.no_grad():
        theirs = _hf_model(directory)(tokens).logits
    assert _rel(ours, theirs) < 1e-5
    family = family_for_model(cfg.model)
    full = {
        n: p.detach()[:V] if n in ("embedding.word.weight", "output.weight") else p.detach()
        for n, p in chunk.named_parameters()
    }
    exported = to_hf(full, cfg.model, family)
    saved = _tensors(directory)
    if cfg.model.tie_embeddings:
        saved.pop("lm_head.weight", None)  # transformers may write the tied copy; meshrun never does
    assert sorted(exported) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k
    written = hf_config_from_model(cfg.model, family, "float32")
    assert model_fields_from_hf(written, "written")[1] == model_fields_from_hf(read_hf_config(directory), "saved")[1]


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_tp_slices_read_with_get_slice_assemble_to_the_full_tensor(hf_dirs, which):
    """The tp=2 shards read through safetensors slices (fused QKV per query group, interleaved SwiGLU, vocabulary
    padding) concatenate to the tp=1 tensor plus zero padding rows."""
    from contextlib import ExitStack

    directory = hf_dirs[which]
    cfg, chunk = _single_model(directory)
    family = family_for_model(cfg.model)
    entries = check_tensors(directory, cfg.model, family)
    with ExitStack() as stack:
        read = SliceReader(entries, stack)
        for name, p in chunk.named_parameters():
            shape = list(p.global_shape)
            if name in ("embedding.word.weight", "output.weight"):
                shape[0] = padded_vocab(V, 2)
            parts = [local_from_hf(name, shape, p.tp_shard_dim, 2, r, read, cfg.model, family) for r in range(2)]
            if p.tp_shard_dim is None:
                assert all(torch.equal(x, p.detach()) for x in parts), name
                continue
            whole = torch.cat(parts, p.tp_shard_dim)
            assert list(whole.shape) == shape, name
            assert torch.equal(whole.narrow(0, 0, p.shape[0]) if p.tp_shard_dim == 0 else whole, p.detach()), name
            assert not whole[p.shape[0] :].any(), name  # padding rows are zero


def test_kv_cache_decoding_equals_full_recompute(hf_dirs):
    """Cached decoding gives the tokens (and logits) of running the whole model on the growing sequence."""
    from training.contract.config import GenerateConfig
    from training.hf.generate import forward_cached, generate_tokens

    cfg, chunk = _single_model(hf_dirs["llama"])
    g = GenerateConfig(prompt_tokens=PROMPT, max_new_tokens=12)
    new = generate_tokens(chunk, PROMPT, g)
    seq = list(PROMPT)
    with torch.no_grad():
        for tok in new:
            logits = chunk(torch.tensor([seq]))[:, 0, :V]
            assert int(logits[-1].argmax()) == tok
            seq.append(tok)
        full = chunk(torch.tensor([seq]))[:, 0, :V]
        cached = forward_cached(chunk, torch.tensor([seq]), {}, 0)[0]
    assert _rel(cached, full) < 1e-5
    sampled = generate_tokens(chunk, PROMPT, GenerateConfig(greedy=False, top_k=5, top_p=0.9, seed=3, max_new_tokens=8))
    assert sampled == generate_tokens(
        chunk, PROMPT, GenerateConfig(greedy=False, top_k=5, top_p=0.9, seed=3, max_new_tokens=8)
    )


def test_models_without_a_hugging_face_class_name_the_field():
    cfg = Config()
    cfg.model.position, cfg.model.norm = "rope", "layernorm"
    with pytest.raises(HFError, match=r"model.norm=layernorm \(LlamaForCausalLM needs rmsnorm\)"):
        family_for_model(cfg.model)
    cfg = Config()
    cfg.model.activation = "swiglu"
    with pytest.raises(HFError, match=r"model.activation=swiglu \(GPT2LMHeadModel needs gelu\)"):
        family_for_model(cfg.model)


def test_bad_directories_name_the_file_and_the_fix(hf_dirs, tmp_path):
    from launcher.hf.init_from import derive_model

    def bad(directory, *overrides):
        cfg = Config()
        cfg.train.init_from = str(directory)
        with pytest.raises(HFError) as err:
            derive_model(cfg, list(overrides))
        return str(err.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}/config.json does not exist" in bad(empty) and "save_pretrained" in bad(empty)
    bert = tmp_path / "bert"
    shutil.copytree(hf_dirs["gpt2"], bert)
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    assert "architectures=['BertForMaskedLM'] is not supported" in bad(bert) and "LlamaForCausalLM" in bad(bert)
    wrong = tmp_path / "wrong_shape"
    shutil.copytree(hf_dirs["llama"], wrong)
    data = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**data, "intermediate_size": 64}))
    msg = bad(wrong)
    assert (
        "model.safetensors: model.layers.0.mlp.gate_proj.weight has shape [48, 32], config.json implies [64, 32]" in msg
        and "use the config.json that was saved with these weights" in msg
    )
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(hf_dirs["llama"], "config.json"), sharded)
    tensors = _tensors(hf_dirs["llama"])
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert derive_model(_with_init(sharded), []).model.num_query_groups == 2  # complete: accepted
    os.remove(sharded / "model-00002-of-00002.safetensors")
    msg = bad(sharded)
    assert f"{sharded}/model-00002-of-00002.safetensors is missing" in msg and "download every file" in msg
    msg = bad(hf_dirs["llama"], "model.hidden_size=64", "model.dropout=0.1")
    assert "model.hidden_size=64 (config.json: 32)" in msg and "dropout" not in msg


def _with_init(directory) -> Config:
    cfg = Config()
    cfg.train.init_from = str(directory)
    return cfg


def test_cli_conflicting_override_exits_2_and_init_from_sets_the_model(hf_dirs, tmp_path):
    """The CLI in this process (tests/helpers/cli.py): a plan starts no rank."""
    r = run_cli(
        "action=plan",
        f"train.init_from={hf_dirs['llama']}",
        "model=gpt2_125m",
        f"run.dir={tmp_path}/a",
        cwd=str(tmp_path),
    )
    assert r.returncode == 2, r.stderr
    assert "these overrides disagree with it" in r.stderr and "model.num_layers=12 (config.json: 2)" in r.stderr
    assert not os.path.exists(tmp_path / "a")
    r = run_cli(
        "action=plan",
        f"train.init_from={hf_dirs['llama']}",
        "parallel=tp2",
        "model.seq_length=16",
        "data=synthetic",
        f"run.dir={tmp_path}/b",
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    model = json.loads((tmp_path / "b" / "config.json").read_text())["model"]
    assert (model["num_query_groups"], model["rope_base"], model["norm"], model["seq_length"]) == (
        2,
        500000.0,
        "rmsnorm",
        16,
    )


# ---- slow: launched runs ------------------------------------------------------------------------------
@pytest.mark.slow
def test_gpt2_at_tp2_pp2_loss_generation_and_export_round_trip(hf_dirs, tmp_path, capsys):
    """GPT-2 initialised at tp=2 pp=2 (lr 0, so its checkpoint holds the imported weights): the first step's loss
    equals transformers' on the same batch, greedy generation equals transformers' for 20 tokens, and the export
    holds exactly the tensors save_pretrained wrote."""
    run = _train(
        tmp_path,
        "gpt2",
        f"train.init_from={hf_dirs['gpt2']}",
        "parallel=tp2_pp2",
        "train.steps=1",
        "train.lr=0",
        "train.min_lr=0",
    )
    cfg = _cfg_for(hf_dirs["gpt2"])
    model = _hf_model(hf_dirs["gpt2"])
    assert _first_loss(run) == pytest.approx(_hf_loss(model, *_batch(cfg)), rel=1e-5)
    r = meshrun(
        "action=generate",
        f"run.dir={run}",
        f"generate.prompt_tokens=[{','.join(map(str, PROMPT))}]",
        "generate.max_new_tokens=20",
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] == _hf_greedy(model) and len(set(out["tokens"])) > 3
    from training.hf.export import export

    export(run, str(tmp_path / "gpt2_export"))
    saved = _tensors(hf_dirs["gpt2"])
    back = _tensors(str(tmp_path / "gpt2_export"))
    assert sorted(back) == sorted(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    # What action=export and action=generate run, in this process: input the user can fix exits 2 with the fix.
    from training.hf import export as export_cmd
    from training.hf import generate as generate_cmd

    assert export_cmd.main([run, "--output", str(tmp_path / "gpt2_export")]) == 2
    assert "already exists" in capsys.readouterr().err  # never written over
    assert generate_cmd.main([run, "--options", json.dumps({"prompt_tokens": [1], "max_new_tokens": 40})]) == 2
    assert "model.seq_length=32" in capsys.readouterr().err


@pytest.mark.slow
def test_llama_trained_at_tp2_dp2_zero1_exports_what_transformers_reads(hf_dirs, tmp_path):
    """Llama (GQA) initialised at tp=2 dp=2 zero=1 (4 ranks: the KV heads split over tp, the fp32 masters and
    Adam moments sharded over dp; pipeline stages are the GPT-2 test's): first-step loss equals transformers'; after 5 steps the
    export (sharded, with an index) loads in transformers with logits equal to meshrun's and the same greedy
    continuation; export -> init_from (tp=1) -> export gives the same tensors bit for bit."""
    run = _train(
        tmp_path,
        "llama",
        f"train.init_from={hf_dirs['llama']}",
        "parallel=tp2",
        "parallel.dp=2",
        "parallel.zero=1",
        "cluster.gpus_per_node=4",
        "train.steps=5",
        "train.warmup_steps=1",
        "train.lr=0.01",
    )
    cfg = _cfg_for(hf_dirs["llama"])
    assert _first_loss(run) == pytest.approx(_hf_loss(_hf_model(hf_dirs["llama"]), *_batch(cfg)), rel=1e-5)
    out_dir = str(tmp_path / "llama_export")
    r = meshrun(
        "action=export", f"run.dir={run}", f"export.output={out_dir}", "export.max_shard_mb=0.01", cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["step"] == 5 and "model.safetensors.index.json" in result["files"] and len(result["weight_files"]) > 2
    model = _hf_model(out_dir)
    from training.contract.config import GenerateConfig
    from training.hf.checkpoint_reader import read_checkpoint
    from training.hf.generate import run as generate_run
    from training.hf.generate import single_process_model

    saved_cfg, _, full = read_checkpoint(run)
    chunk = single_process_model(saved_cfg, full)
    tokens, _ = _batch(cfg, seed=99, n=3)
    with torch.no_grad():
        ours = chunk(tokens).permute(1, 0, 2)[..., :V]
        assert _rel(model(tokens).logits, ours) < 1e-5
    assert not torch.equal(
        full["layers.0.attn.qkv.weight"], _single_model(hf_dirs["llama"])[1].layers["0"].attn.qkv.weight.detach()
    )  # it trained
    mine = generate_run(run, GenerateConfig(prompt_tokens=PROMPT, max_new_tokens=20))["tokens"]
    assert mine == _hf_greedy(model) and len(set(mine)) > 3
    again = _train(
        tmp_path,
        "again",
        f"train.init_from={out_dir}",
        "parallel=single",
        "cluster.gpus_per_node=1",
        "train.steps=1",
        "train.lr=0",
        "train.min_lr=0",
    )
    from training.hf.export import export

    export(again, str(tmp_path / "again_export"))
    first, second = _tensors(out_dir), _tensors(str(tmp_path / "again_export"))
    assert sorted(first) == sorted(second)
    for k in first:
        assert first[k].dtype == second[k].dtype and torch.equal(
            first[k].view(-1).view(torch.uint8), second[k].view(-1).view(torch.uint8)
        ), k
    cfg_a = json.loads(open(os.path.join(out_dir, "config.json")).read())
    cfg_b = json.loads(open(str(tmp_path / "again_export" / "config.json")).read())
    assert cfg_a == cfg_b


def test_export_ships_the_runs_tokenizer_for_transformers(tmp_path):
    """A run on a prepared dataset (data=indexed): its tokenizer.json goes into the export, AutoTokenizer reads it
    and encodes as meshrun does, and config.json's eos_token_id is the end-of-document token."""
    from launcher.data.prepare import prepare
    from launcher.data.prepare.config import PrepareConfig
    from training.hf.tokenizer_files import run_tokenizer, write_tokenizer_files

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    prefix = str(tmp_path / "data" / "fox")
    prepare(
        PrepareConfig(
            inputs=[str(text)],
            output=prefix,
            tokenizer="bpe",
            vocab_size=300,
            workers=1,
            progress=False,
            valid_fraction=0.0,
        )
    )
    cfg = Config()
    cfg.data.kind, cfg.data.prefixes = "indexed", [prefix]
    out = tmp_path / "export"
    out.mkdir()
    ids = write_tokenizer_files(cfg, str(out))
    mine = run_tokenizer(cfg)
    assert ids["eos_token_id"] == mine.eod_id and sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    sample = "the lazy fox jumps"
    assert theirs.encode(sample) == mine.encode(sample) and theirs.eos_token_id == mine.eod_id


def test_launcher_side_imports_no_torch():
    code = (
        "import sys; import launcher.hf.init_from, launcher.hf.export, launcher.hf.generate, training.hf.tokenizer_files; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_run_that_resumes_no_longer_needs_the_directory(tmp_path):
    """Once the run has its own checkpoint, the launcher keeps the saved model and never reads DIR again."""
    from launcher.hf.init_from import apply_init_from

    cfg = _with_init(tmp_path / "deleted_model")
    (tmp_path / "run" / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_3\n")
    assert apply_init_from(cfg, [], str(tmp_path / "run")) is cfg
    with pytest.raises(SystemExit) as exit_:
        apply_init_from(cfg, [], str(tmp_path / "fresh_run"))
    assert exit_.value.code == 2
