"""Sharded, atomic, resumable checkpoints (DCP underneath): see manager.CheckpointManager."""

from training.checkpoint.storage import CheckpointError

__all__ = ["CheckpointManager", "CheckpointError", "SaveStats"]


def __getattr__(name: str):
    # The manager (torch) is imported on first use: the launcher reads checkpoints/ through the pure-Python
    # storage module, and launcher/ must not import torch.
    if name in ("CheckpointManager", "SaveStats"):
        from training.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'training.checkpoint' has no attribute {name!r}")
