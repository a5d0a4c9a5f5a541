"""train.compile: each transformer layer's forward compiled with torch.compile (inductor), one layer at a time.

Per layer, not the whole model: the layers stay modules of their own, so the pipeline still cuts the model
between them, recompute=full still checkpoints a whole layer, the zero=1 parameter gather and the NaN probe
still hook each layer, and the tensor-parallel regions (training/parallel/) keep their explicit collectives
(dynamo runs a collective it cannot trace eagerly between compiled pieces). Only `forward` is compiled, so
the module's hooks run eagerly around it and parameter names do not change (checkpoints stay the same).
Every layer runs the same code, so the layers of a chunk share the compiled graphs (same shapes, new weights).

Compiling happens lazily, on the first forward (and the first backward) a layer sees; `CompileClock` adds up
the wall time dynamo and inductor spend, which the loop reports once (metrics `compile_s`).
"""

from __future__ import annotations

import threading
import time

import torch


class CompileClock:
    """Wall seconds spent compiling in this process since it was created (dynamo's compile start/end callbacks,
    which also fire for a backward graph compiled on the first backward)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = None
        self._lock = threading.Lock()
        handler = getattr(torch._dynamo, "callback_handler", None)
        self.available = handler is not None
        if handler is not None:
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
            self._handler = handler

    def _start(self, *_args) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _end(self, *_args) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self._started = None

    def close(self) -> None:
        if self.available:
            self._handler.remove_start_callback(self._start)
            self._handler.remove_end_callback(self._end)


def compile_layers(chunks: list[torch.nn.Module]) -> int:
    """Compile the forward of every transformer layer of `chunks` in place; returns how many."""
    count = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            # The bound method, not the module: hooks stay outside the graph and names stay unprefixed.
            layer.forward = torch.compile(layer.forward)
            count += 1
    return count
