"""Preflight health checks run on every node before training (GPU, InfiniBand, OS, collectives).

Kept free of torch at import time: the launcher may reference the entry points without pulling
torch in; only `matmul`, `collectives` and `runner.main` import torch, lazily.
"""
