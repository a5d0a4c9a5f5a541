"""The pp = 1 schedule: forward and backward of each micro-batch in turn through the rank's one model chunk."""

from __future__ import annotations

import torch

from training.optim import DistributedOptimizer


class NoPipelineSchedule:
    """pp = 1: forward and backward of each micro-batch in turn through the single model chunk."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: DistributedOptimizer, mesh):
        assert len(chunks) == 1, "the no-pipeline schedule runs exactly one model chunk"
        self.chunk, self.optimizer, self.mesh = chunks[0], optimizer, mesh

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate grads of the mean loss over `micro_batches`; returns that mean (detached, fp32)."""
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        n = len(micro_batches)
        for tokens, targets in micro_batches:
            loss = self.chunk(tokens.to(self.mesh.device), targets.to(self.mesh.device))
            self.optimizer.scale_loss(loss.float(), n).backward()
            total += loss.detach().float()
        return total / n

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over `micro_batches` without building a graph (evaluation)."""
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for tokens, targets in micro_batches:
            total += self.chunk(tokens.to(self.mesh.device), targets.to(self.mesh.device)).float()
        return total / len(micro_batches)

    def metrics(self) -> dict[str, float]:
        """Fields for the metrics row: none (no pipeline, no bubble)."""
        return {}
