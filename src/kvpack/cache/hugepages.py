"""Pools on transparent huge pages where the operating system offers them.

A decode step reads each sequence's blocks at arbitrary addresses, so with 4 KiB pages nearly every block it
touches misses the TLB, and in a virtual machine every miss is a two-level page walk. Backing a pool with
2 MiB pages makes one TLB entry cover 256 blocks of 8 KiB instead of half of one. Measured on the project's
2-core VM (``docs/performance.md``): the int8 CPU kernel went from 17.5 to 14.2 ns per (token, kv head) on
one core at 32k context.

Linux only, and only where transparent huge pages are ``always`` or ``madvise`` (the common defaults):
the pool is anonymous memory advised ``MADV_HUGEPAGE`` before anything touches it, aligned to 2 MiB.
Anywhere else (other systems, CUDA, small pools, ``KVPACK_HUGE_PAGES=0``) it is a plain ``torch.zeros``.
Either way the tensor is an ordinary zero-filled CPU tensor; the OS fills pages as they are first written.
"""

from __future__ import annotations

import math
import mmap
import os
import re

import torch

__all__ = ["HUGE_PAGE", "MIN_BYTES", "huge_page_bytes", "zeros"]

HUGE_PAGE = 2 * 2**20
MIN_BYTES = 4 * HUGE_PAGE  # below this the alignment slack (up to one huge page) is not worth it


def _enabled() -> bool:
    if os.environ.get("KVPACK_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on 2 MiB pages when it is a CPU tensor of
    :data:`MIN_BYTES` or more and the OS allows it.

    Returns:
        ``shape``, ``dtype``, contiguous, zero-filled; it keeps its memory alive like any tensor.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_BYTES or not _enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(raw, dtype=torch.uint8)  # keeps ``raw`` alive; touches nothing
    offset = -flat.data_ptr() % HUGE_PAGE
    span = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        raw.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:  # huge pages compiled out or refused: ordinary pages, still zero-filled
        pass
    return flat[offset : offset + nbytes].view(dtype).view(tuple(shape))


def huge_page_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s memory mapping that the OS backs with huge pages right now (Linux ``smaps``:
    ``AnonHugePages`` of the mapping that holds ``t``'s first byte); ``None`` where it cannot be read."""
    if t.device.type != "cpu":
        return None
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if m:
                    inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
