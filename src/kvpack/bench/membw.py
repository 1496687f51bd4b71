"""Memory read bandwidth of this machine, measured in the same process as the kernels it judges.

A reduction (``sum``) over a float32 buffer much larger than the last-level cache, with the same number
of threads the kernels get: a read stream with next to no arithmetic, so its GB/s is what a decode kernel
that is perfectly bandwidth-bound could reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_BYTES", "measure_read_bandwidth", "time_calls"]

DEFAULT_BYTES = 512 * 2**20  # far above any L3 (tens of MB), small enough for a laptop


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(repeats, 1)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure_read_bandwidth(nbytes: int = DEFAULT_BYTES, repeats: int = 7, threads: int | None = None) -> float:
    """Median read bandwidth in GB/s (1e9 bytes per second) of ``torch.sum`` over ``nbytes`` of float32.

    Args:
        nbytes: buffer size; keep it several times the last-level cache.
        repeats: timed passes (after one warm-up pass that also faults the pages in).
        threads: torch threads during the probe (default: the current setting), restored afterwards.
    """
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        times = sorted(time_calls(buf.sum, repeats, warmup=1))
        return buf.numel() * 4 / times[len(times) // 2] / 1e9
    finally:
        torch.set_num_threads(old)
