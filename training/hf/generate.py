"""`python -m training.hf.generate RUN_DIR --options JSON` (what `meshrun action=generate` runs): continue a
prompt with a checkpoint of the run, on one process, with a KV cache.

The checkpoint's full parameters (any layout: training/hf/checkpoint_reader.py) go into meshrun's own model
built at tp = pp = 1 (training/model/gpt.py), and decoding reuses its modules (norms, fused QKV and its split,
rotary embedding at an offset, output projection, MLP); only the attention over cached keys and values is
written here. The prompt is token ids, or text encoded with the run's tokenizer. Greedy takes the most
likely token; sampling applies temperature, top-k and top-p with a seeded generator. Prints one JSON object
whose `tokens` are the new token ids. Exit 2 for input the user can fix, naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from training.contract.config import GenerateConfig
from training.hf.cli_result import print_result
from training.hf.hf_config import HFError

Cache = dict[str, tuple[torch.Tensor, torch.Tensor]]


def single_process_model(cfg, full: dict[str, torch.Tensor], device: str = "cpu", dtype: torch.dtype = torch.float32):
    """meshrun's model (one chunk: tp = pp = 1) holding the full parameters `full` (vocabulary rows unpadded)."""
    from training.model.gpt import build_gpt
    from training.parallel.mesh import ProcessMesh

    par = dataclasses.replace(
        cfg.parallel, tp=1, pp=1, vpp=1, cp=1, dp=1, ep=1, sp=False, recompute="none", schedule="1f1b"
    )  # ep=1: every expert of a mixture on this one process
    # An fp8 run's checkpoint is a bf16 one: generation runs bf16 matmuls, as the exported model does in transformers.
    train = dataclasses.replace(cfg.train, precision="bf16") if str(cfg.train.precision) == "fp8" else cfg.train
    one = dataclasses.replace(cfg, parallel=par, train=train)
    (chunk,) = build_gpt(one, ProcessMesh.single(device), dtype)
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            t = full[name]
            if t.shape[0] < p.shape[0]:  # vocabulary padding rows (zero; never chosen: logits are cut to V)
                t = torch.cat([t, torch.zeros(p.shape[0] - t.shape[0], *t.shape[1:], dtype=t.dtype)])
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    return chunk.eval()


@torch.no_grad()
def forward_cached(chunk, ids: torch.Tensor, cache: Cache, pos: int) -> torch.Tensor:
    """Logits [b, n, V] of tokens ids [b, n] at positions pos .. pos + n - 1; appends their keys and values to
    `cache` (empty at pos 0)."""
    emb = chunk.embedding
    n = ids.shape[1]
    x = F.embedding(ids, emb.word.weight).transpose(0, 1)  # [n, b, h], sequence-first like the model
    if emb.position is not None:
        x = x + emb.position.weight[pos : pos + n].unsqueeze(1)
    for lid, layer in chunk.layers.items():
        at = layer.attn
        q, k, v = at.split_qkv(at.qkv(layer.attn_norm(x)))  # [b, heads or groups, n, d]
        if at.rotary is not None:
            q, k = at.rotary(q, pos), at.rotary(k, pos)
        if lid in cache:
            k, v = torch.cat([cache[lid][0], k], 2), torch.cat([cache[lid][1], v], 2)
        cache[lid] = (k, v)
        if at.q_per_group > 1:
            k, v = k.repeat_interleave(at.q_per_group, dim=1), v.repeat_interleave(at.q_per_group, dim=1)
        # Token i of this call sees every cached position and the new ones up to itself.
        mask = None if n == 1 else torch.ones(n, pos + n, dtype=torch.bool, device=x.device).tril(pos)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + at.proj(ctx.permute(2, 0, 1, 3).reshape(n, ids.shape[0], -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    x = chunk.final_norm(x)
    weight = chunk.output.weight if chunk.output is not None else emb.word.weight
    return F.linear(x, weight)[..., : chunk.vocab_size].transpose(0, 1).float()


def next_token(logits: torch.Tensor, g: GenerateConfig, gen: torch.Generator) -> int:
    """The next token from the last position's logits [V]: argmax, or a draw after temperature, top-k, top-p."""
    if g.greedy:
        return int(logits.argmax())
    logits = logits / g.temperature
    if 0 < g.top_k < logits.numel():
        kth = torch.topk(logits, g.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if g.top_p < 1.0:
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        # Keep the most likely tokens until their mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= g.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


def generate_tokens(chunk, prompt: list[int], g: GenerateConfig) -> list[int]:
    """The new tokens after `prompt` (KV-cached decoding)."""
    device = chunk.embedding.word.weight.device
    gen = torch.Generator(device="cpu").manual_seed(int(g.seed))
    cache: Cache = {}
    logits = forward_cached(chunk, torch.tensor([prompt], device=device), cache, 0)
    out: list[int] = []
    pos = len(prompt)
    stops = set(int(t) for t in g.stop_tokens)
    while len(out) < g.max_new_tokens:
        tok = next_token(logits[0, -1].cpu(), g, gen)
        out.append(tok)
        if tok in stops or len(out) == g.max_new_tokens:
            break
        logits = forward_cached(chunk, torch.tensor([[tok]], device=device), cache, pos)
        pos += 1
    return out


def check_request(g: GenerateConfig, prompt: list[int], vocab: int, seq: int) -> None:
    """Errors the user can fix, naming the key."""
    if not prompt:
        raise HFError("the prompt is empty: give generate.prompt_tokens=[...] or generate.prompt=TEXT")
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:
        raise HFError(f"generate.prompt_tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if g.max_new_tokens < 0:
        raise HFError(f"generate.max_new_tokens={g.max_new_tokens}: use 0 or more")
    if len(prompt) + g.max_new_tokens > seq:
        raise HFError(
            f"generate.max_new_tokens={g.max_new_tokens}: the prompt ({len(prompt)} tokens) plus the new "
            f"tokens exceed model.seq_length={seq}, the longest context the model has; ask for at most "
            f"{max(0, seq - len(prompt))} new tokens or shorten the prompt"
        )
    if not g.greedy and (g.temperature <= 0 or not 0 < g.top_p <= 1 or g.top_k < 0):
        raise HFError(
            f"sampling needs generate.temperature > 0 (is {g.temperature}), 0 < generate.top_p <= 1 "
            f"(is {g.top_p}) and generate.top_k >= 0 (is {g.top_k})"
        )


def run(run_dir: str, g: GenerateConfig) -> dict:
    """Load the checkpoint, build the prompt, generate; returns what the command prints."""
    from training.hf.checkpoint_reader import read_checkpoint
    from training.hf.tokenizer_files import run_tokenizer

    cfg, step, full = read_checkpoint(run_dir, g.step, "generate.step")
    tok = None
    if g.prompt:
        if g.prompt_tokens:
            raise HFError("give generate.prompt or generate.prompt_tokens, not both")
        tok = run_tokenizer(cfg)
        if tok is None:
            raise HFError(
                f"generate.prompt needs the run's tokenizer, and {run_dir} trained on data.kind="
                f"{cfg.data.kind} without one; give generate.prompt_tokens=[...] instead"
            )
        prompt = [int(t) for t in tok.encode(g.prompt)]
    else:
        prompt = [int(t) for t in g.prompt_tokens]
    check_request(g, prompt, cfg.model.vocab_size, cfg.model.seq_length)
    cuda = str(cfg.cluster.device) == "cuda" and torch.cuda.is_available()
    from training.contract.precision import param_dtype

    dtype = param_dtype(cfg.train.precision) if cuda else torch.float32
    chunk = single_process_model(cfg, full, "cuda" if cuda else "cpu", dtype)
    t0 = time.perf_counter()
    new = generate_tokens(chunk, prompt, g)
    seconds = time.perf_counter() - t0
    result = {
        "tokens": new,
        "prompt_tokens": prompt,
        "step": step,
        "run_dir": run_dir,
        "greedy": bool(g.greedy),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(len(new) / seconds, 2) if seconds > 0 else None,
    }
    if tok is None and not g.prompt:
        from training.hf.tokenizer_files import tokenizer_or_none

        tok = tokenizer_or_none(cfg)
    if tok is not None:
        result["text"] = tok.decode(new)
    return result


def _options(text: str) -> GenerateConfig:
    data = json.loads(text) if text else {}
    return GenerateConfig(**data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.hf.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--options", default="", help="the generate.* keys as one JSON object")
    args = ap.parse_args(argv)

    return print_result(lambda: run(os.path.abspath(args.run_dir), _options(args.options)))


if __name__ == "__main__":
    sys.exit(main())
