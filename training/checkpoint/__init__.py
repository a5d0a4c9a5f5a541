"""Sharded, atomic, resumable checkpoints (DCP underneath): see manager.CheckpointManager."""

from training.checkpoint.manager import CheckpointManager, SaveStats
from training.checkpoint.storage import CheckpointError

__all__ = ["CheckpointManager", "CheckpointError", "SaveStats"]
