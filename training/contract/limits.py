"""Upper bounds on the sizes a user gives (pure Python): a mistyped count, a hostile preset or a Hugging Face
config.json must be refused at once, not keep the planner (or the shapes check of an HF import) busy for minutes.
launcher/plan/validate.py checks every key; training/hf/hf_config.py the model fields an HF config.json sets."""

from __future__ import annotations

from typing import Any

# Far above any model trained today (the largest have ~10^2 layers, ~10^5 hidden, ~10^6
# tokens of context, ~10^6 vocabulary) and any cluster (~10^5 GPUs).
MAX_SIZE = {
    "model.num_layers": 4096,
    "model.hidden_size": 1 << 20,
    "model.num_attention_heads": 1 << 16,
    "model.num_query_groups": 1 << 16,
    "model.ffn_hidden_size": 1 << 22,
    "model.seq_length": 1 << 24,
    "model.vocab_size": 1 << 24,
    "model.num_experts": 1 << 16,
    "model.moe_top_k": 1 << 16,  # and at most model.num_experts (launcher/plan/validate.py)
    "model.moe_ffn_hidden_size": 1 << 22,
    "parallel.tp": 1 << 16,
    "parallel.pp": 4096,
    "parallel.vpp": 4096,
    "parallel.cp": 1 << 16,
    "parallel.dp": 1 << 20,
    "parallel.ep": 1 << 16,
    "parallel.micro_batch": 1 << 20,
    "parallel.global_batch": 1 << 30,
    "parallel.recompute_num_layers": 4096,
    "cluster.nodes": 1 << 16,
    "cluster.gpus_per_node": 1024,
    "cluster.spare_nodes": 1 << 16,
    # Restarts and requeues: each costs minutes of the allocation and an attempt goodput reads (quadratic in the
    # attempts, docs/USER_CONTRACTS.md); real runs make tens.
    "cluster.max_in_job_restarts": 1024,
    "cluster.max_retries": 4096,
    "train.steps": 10**12,
}


def too_large(key: str, value: Any) -> str | None:
    """The message when `value` exceeds key's bound, else None."""
    most = MAX_SIZE.get(key)
    if most is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
        return f"is implausibly large ({value}; at most {most})"
    return None
