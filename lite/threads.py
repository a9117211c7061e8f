"""Thread count control for mixed workloads.

Large matrix products scale with threads; element-wise passes over one weight (quantize, the clip grid)
do not, and on a shared machine an OpenMP barrier waiting for a descheduled thread makes them 10x
slower. The searches therefore run element-wise work single-threaded and matmul work on all threads.
"""

from __future__ import annotations

import contextlib

import torch


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
