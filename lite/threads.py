"""Thread count control for mixed workloads.

Large matrix products scale with threads. Element-wise passes (quantize, the clip grid) over a small weight do
not: it sits in cache, each pass takes microseconds, and on a shared machine an OpenMP barrier waiting for a
descheduled thread makes them 10x slower. Over a large weight they are bound by memory and do scale (the clip
search of an 8B model's down_proj, 4096 x 14336, on 2 Zen 4 cores: 159 s on one thread, 93 s on two). The
searches therefore run element-wise work on ``elementwise_threads`` and matmul work on all threads.
"""

from __future__ import annotations

import contextlib

import torch


SERIAL_ELEMENTS = 1 << 22
"""Weights under this many elements (16 MiB of fp32: SmolLM2's largest linear is 0.9 M) take element-wise passes
on one thread; larger ones on all."""


def elementwise_threads(num_elements: int) -> int:
    """Threads for element-wise passes over a weight of ``num_elements``: 1 for a small one, else all of torch's."""
    return 1 if num_elements < SERIAL_ELEMENTS else torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """Run the block with ``torch.set_num_threads(num_threads)``; restore the previous count after."""
    previous = torch.get_num_threads()
    if num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
