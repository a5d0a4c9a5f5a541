"""Hugging Face helpers shared by the interop tests (GPT-2, Llama, Mixtral): configs from a directory,
transformers' loss and greedy tokens, the tensors of a directory, trained runs through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from helpers import ROOT
from training.contract.config import Config
from training.data import SyntheticSource
from training.hf.hf_config import model_fields_from_hf, read_hf_config
from training.hf.init_from import load_init_from
from training.model.gpt import build_gpt
from training.parallel.mesh import ProcessMesh

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable
PROMPT = [1, 2, 3, 4, 5]


def meshrun(*args: str, cwd: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _cfg_for(directory: str, tp: int = 1) -> Config:
    cfg = Config()
    _, fields, _ = model_fields_from_hf(read_hf_config(directory), directory)
    for k, v in fields.items():
        setattr(cfg.model, k, v)
    cfg.parallel.tp, cfg.parallel.dp = tp, 1
    cfg.train.init_from = directory
    return cfg


def _hf_model(directory: str):
    return __import__("transformers").AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def _hf_greedy(model, n: int = 20):
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _batch(cfg: Config, seed: int = 1234, n: int = 8):
    rows = torch.from_numpy(
        __import__("numpy").stack(
            [SyntheticSource(cfg.model.vocab_size, cfg.model.seq_length, seed).sample(i) for i in range(n)]
        )
    )
    return rows[:, :-1], rows[:, 1:]


def _tensors(directory: str):
    """Every tensor of a Hugging Face directory (single file or shards), by name."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _single_model(directory: str):
    cfg = _cfg_for(directory)
    mesh = ProcessMesh.single()
    chunks = build_gpt(cfg, mesh, torch.float32)
    load_init_from(cfg, mesh, chunks)
    return cfg, chunks[0].eval()


# ---- fast: in this process ----------------------------------------------------------------------------


def _train(tmp_path, name: str, *overrides: str) -> str:
    run_dir = str(tmp_path / name)
    r = meshrun(
        "data=synthetic",
        "train.progress=false",
        "train.checkpoint_every=0",
        f"run.dir={run_dir}",
        *overrides,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _first_loss(run_dir: str) -> float:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]
