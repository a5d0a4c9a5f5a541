"""Bytes autograd saves for backward in one micro-batch's forward: the activation memory the planner
estimates (launcher/plan/memory.py), measured on any device, independent of the allocator.

bench/saved_bytes.py measures a run's model with it, and bench/gpu_check.sh compares that with plan.json's
activations (on CPU, where the process's peak RSS says nothing about activations; on GPU next to peak allocated
minus model states). Each storage a saved tensor keeps alive is counted once, whole: two views of one storage
(attention's output and the next linear's input) are one buffer, and a view keeps its whole storage alive (as
training/schedules/pipeline.py counts). Parameters and module buffers (RoPE tables) are model state, not
activations, and are left out.
"""

from __future__ import annotations

import torch


class SavedBytes:
    """Counts the bytes of the storages autograd saves for backward while the block runs (those of `params`,
    the model's parameters and buffers, left out; each storage once, whole):
    `with SavedBytes(params) as saved: forward(); saved.total`."""

    def __init__(self, params) -> None:
        # By address, and by storage object (zero=3 storages are empty, no address, until gathered).
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._param_storages = {p.untyped_storage()._cdata for p in params}
        self._seen: set = set()
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for storage in _storages(t):
            ptr = storage.data_ptr()
            if ptr not in self._params and storage._cdata not in self._param_storages and ptr not in self._seen:
                self._seen.add(ptr)
                self.total += storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _storages(t: torch.Tensor):
    """The storages a saved tensor keeps alive: a wrapper subclass's (torchao's float8 tensors) are its inner
    tensors'."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, name))
    else:
        yield t.untyped_storage()


def saved_activation_bytes(trainer) -> int:
    """Bytes saved for backward by the first chunk's forward of this rank's first micro-batch."""
    tokens, targets = trainer.sampler.micro_batches(0)[0]
    for c in trainer.chunks:
        c.train()
    opt = trainer.optimizer
    state = list(opt.params) + [b for c in trainer.chunks for b in c.buffers()]
    for part in (opt, getattr(opt, "experts", None)):  # parallel.fp8_all_gather: the gathered float8 weights
        state += list(getattr(getattr(part, "zero3", None), "fp8", {}).values())
    with SavedBytes(state) as saved:
        trainer.chunks[0](tokens, targets)
    return saved.total
