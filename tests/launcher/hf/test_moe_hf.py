"""Mixture of experts and Hugging Face, against transformers' own MixtralForCausalLM (CPU, fp32).

A random MixtralForCausalLM (grouped-query attention, 4 experts, top-2, rope_theta 1e6) written by save_pretrained
in the Hub's format (block_sparse_moe.experts.{e}.w1/w3/w2 and block_sparse_moe.gate; transformers 5 fuses the
experts in memory and writes this format back). Fast tests convert in this process: logits, the tensors back
bit for bit, config.json both ways, the tp x ep slices, KV-cached greedy decoding. One launched run imports it at
ep=2 x tp=2 (4 ranks): its first loss is transformers' on the same batch; action=generate gives transformers'
greedy tokens; action=export loads in transformers with the same logits (1e-6) and the same tensors.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e .[test]")
pytest.importorskip("safetensors.torch", reason="safetensors is a runtime dependency")

from helpers.hf import (
    PROMPT,
    _batch,
    _cfg_for,
    _first_loss,
    _hf_greedy,
    _hf_loss,
    _hf_model,  # noqa: E402
    _rel,
    _single_model,
    _tensors,
    _train,
)

from training.contract.config import GenerateConfig  # noqa: E402
from training.hf.convert import local_from_hf, to_hf  # noqa: E402
from training.hf.generate import generate_tokens  # noqa: E402
from training.hf.hf_config import (
    MIXTRAL,
    HFError,
    family_for_model,
    hf_config_from_model,  # noqa: E402
    model_fields_from_hf,
    read_hf_config,
)
from training.hf.init_from import SliceReader  # noqa: E402
from training.hf.safetensors_index import check_tensors  # noqa: E402

V, SEQ, E = 97, 32, 4


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=SEQ,
            num_local_experts=E,
            num_experts_per_tok=2,
            initializer_range=0.5,
            rope_theta=1e6,
            rms_norm_eps=1e-5,
            router_aux_loss_coef=0.02,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    )
    path = str(tmp_path_factory.mktemp("hf") / "mixtral")
    model.save_pretrained(path)
    return path


def test_import_matches_transformers_exports_the_hub_tensors_and_decodes_greedily(mixtral_dir):
    """tp=1 import: logits equal transformers' (relative 1e-5); to_hf gives back every saved tensor (the Hub's
    per-expert names) bit for bit; config.json written back reads as the same model; KV-cached greedy decoding
    gives transformers' greedy tokens."""
    saved = _tensors(mixtral_dir)
    assert f"model.layers.0.block_sparse_moe.experts.{E - 1}.w3.weight" in saved  # the Hub's format on disk
    cfg, chunk = _single_model(mixtral_dir)
    m = cfg.model
    assert (m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff) == (E, 2, 48, 0.02)
    tokens, _ = _batch(cfg, n=2)
    hf = _hf_model(mixtral_dir)
    with torch.no_grad():
        ours = chunk(tokens).permute(1, 0, 2)[..., :V]
        theirs = hf(tokens).logits
    assert _rel(ours, theirs) < 1e-5
    family = family_for_model(m)
    assert family == MIXTRAL
    full = {
        n: p.detach()[:V] if n in ("embedding.word.weight", "output.weight") else p.detach()
        for n, p in chunk.named_parameters()
    }
    exported = to_hf(full, m, family)
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    written = hf_config_from_model(m, family, "float32")
    assert model_fields_from_hf(written, "written")[1] == model_fields_from_hf(read_hf_config(mixtral_dir), "saved")[1]
    assert written["architectures"] == ["MixtralForCausalLM"] and written["num_local_experts"] == E
    new = generate_tokens(chunk, PROMPT, GenerateConfig(prompt_tokens=PROMPT, max_new_tokens=20))
    assert new == _hf_greedy(hf) and len(set(new)) > 3


def test_ep_and_tp_slices_assemble_to_the_experts(mixtral_dir):
    """At ep=2 x tp=2 each rank reads only its experts' tp slices (interleaved gate/up rows, w2 columns); the
    slices concatenate to the tp=1 tensors, and the router is the same on every rank."""
    cfg, chunk = _single_model(mixtral_dir)
    entries = check_tensors(mixtral_dir, cfg.model, MIXTRAL)
    params = dict(chunk.named_parameters())
    with ExitStack() as stack:
        read = SliceReader(entries, stack)
        for ep_rank in range(2):
            for e in range(ep_rank * E // 2, (ep_rank + 1) * E // 2):  # the experts this ep rank builds
                for part in ("fc1", "fc2"):
                    name = f"layers.1.mlp.experts.{e}.{part}.weight"
                    p = params[name]
                    shards = [
                        local_from_hf(name, p.global_shape, p.tp_shard_dim, 2, r, read, cfg.model, MIXTRAL)
                        for r in range(2)
                    ]
                    assert torch.equal(torch.cat(shards, p.tp_shard_dim), p.detach()), name
        router = params["layers.0.mlp.router.weight"]
        assert torch.equal(
            local_from_hf("layers.0.mlp.router.weight", router.global_shape, None, 2, 1, read, cfg.model, MIXTRAL),
            router.detach(),
        )


def test_moe_models_without_a_mixtral_shape_name_the_field():
    cfg = _cfg_for_fields(num_experts=4, activation="gelu")
    with pytest.raises(HFError, match=r"model.activation=gelu \(MixtralForCausalLM needs swiglu\)"):
        family_for_model(cfg.model)
    hf = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "vocab_size": 97,
        "max_position_embeddings": 64,
        "sliding_window": 16,
    }
    with pytest.raises(HFError, match="sliding_window=16"):
        model_fields_from_hf(hf, "config.json")


def _cfg_for_fields(**fields):
    from training.contract.config import Config

    cfg = Config()
    cfg.model.position, cfg.model.norm, cfg.model.bias = "rope", "rmsnorm", False
    for k, v in fields.items():
        setattr(cfg.model, k, v)
    return cfg


@pytest.mark.slow
def test_mixtral_at_ep2_tp2_loss_generation_and_export_round_trip(mixtral_dir, tmp_path):
    """init_from at ep=2 x tp=2 (4 ranks: dp=2 holds the two expert halves, tp=2 splits every expert), lr 0 so
    the checkpoint holds the imported weights: the first loss is transformers' on the same batch; action=generate
    gives transformers' greedy tokens; the export (written from the ep x tp checkpoint) holds exactly the saved
    tensors and loads in transformers with logits within 1e-6 of the original model's."""
    run = _train(
        tmp_path,
        "mixtral",
        f"train.init_from={mixtral_dir}",
        "parallel=tp2",
        "parallel.dp=2",
        "parallel.ep=2",
        "cluster.gpus_per_node=4",
        "train.steps=1",
        "train.lr=0",
        "train.min_lr=0",
        "model.seq_length=32",
    )
    cfg = _cfg_for(mixtral_dir)
    hf = _hf_model(mixtral_dir)
    assert _first_loss(run) == pytest.approx(_hf_loss(hf, *_batch(cfg)), rel=1e-5)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    assert row["moe_aux_loss"] > 0  # the MoE rows of the contract
    with open(os.path.join(run, "events.jsonl")) as f:
        (load,) = [e for e in map(json.loads, f) if e["event"] == "moe_load" and e["step"] == row["step"]]
    # max/mean of the counted assignments, from the event's own table (the same rank-summed counts).
    loads = [max(r) / (sum(r) / len(r)) for r in load["tokens_per_expert"]]
    assert row["moe_max_load"] == pytest.approx(max(loads), rel=1e-9) and max(loads) >= 1.0
    # What action=generate and action=export run (training/hf/generate.py, export.py), in this process: the one
    # multi-process launch of this test is the training run's.
    from training.hf.export import export
    from training.hf.generate import run as generate

    assert generate(run, GenerateConfig(prompt_tokens=PROMPT, max_new_tokens=20))["tokens"] == _hf_greedy(hf)
    out = str(tmp_path / "export")
    assert export(run, out)["architecture"] == "MixtralForCausalLM"
    saved, back = _tensors(mixtral_dir), _tensors(out)
    assert sorted(back) == sorted(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    tokens, _ = _batch(cfg, n=2)
    with torch.no_grad():
        assert _rel(_hf_model(out)(tokens).logits, hf(tokens).logits) < 1e-6
