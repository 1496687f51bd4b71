"""The block-read ceiling: how fast this machine reads one paged cache's payload the way the CPU kernel does.

The sequential probe (:mod:`kvpack.bench.membw`) streams one contiguous buffer, which the hardware
prefetchers follow at full speed. A decode kernel cannot read like that: it reads each sequence's blocks
in block-table order, one kv head at a time, and block ids are arbitrary (a fragmented pool), so every
``block_size`` rows of a head (8 KiB for int8 at head_dim 128) start at an address nothing can guess.
This probe does exactly the kernel's reads and nothing else: the same work items and threads
(:func:`kvpack.kernels.cpu_decode.work_items`, :func:`kvpack.kernels.cpu_decode.run_items`), in the kernel's order (keys
then values of each block, or, where the kernel attends runs of blocks, the keys of a run's blocks then
their values), one load per 64-byte line, the same software prefetching (the block ``cpu_decode.FAR_BLOCKS``
ahead, the block after next, into L2, and for rows of 128 bytes or more the next block into L1), no
arithmetic. Its time is what a kernel with free compute would take on this cache, so ``probe ms / kernel
ms`` says how much of the reachable memory speed the kernel uses. Scales and the full-precision tail (1-3%
of the bytes) are not read.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from numba import njit

from kvpack.errors import UnsupportedError
from kvpack.kernels.cpu_decode_numba import _prefetch, _prefetch_l1, take_item
from kvpack.kernels.views import PagedKV

__all__ = ["BlockRead", "measure_block_read", "read_items"]

_U64 = np.uint64


@njit(inline="always")
def _read_rows(p8, p64, rs, idx, far, near, h, kv_heads, bs, acc):  # pragma: no cover
    """XOR into ``acc`` the first word of every 64-byte line of block ``idx``'s rows of head ``h`` (``rs``
    bytes each), prefetching block ``far`` (0: none) into L2 and, for rows of 128 bytes or more, ``near`` into
    L1 line by line, as the kernel's loops do."""
    n = _U64(bs * rs)
    base = _U64((idx * kv_heads + h) * bs * rs)
    fb = _U64((far * kv_heads + h) * bs * rs)
    nb = _U64((near * kv_heads + h) * bs * rs)
    for o in range(_U64(0), n, _U64(64)):
        if far:
            _prefetch(p8, fb + o)
        if near and rs >= 128:
            _prefetch_l1(p8, nb + o)
        acc ^= p64[(base + o) >> _U64(3)]
    return acc


@njit(nogil=True)  # not cached on disk: it compiles in take_item and the prefetch intrinsics of another file
def read_items(
    t, runs, items, k8, k64, v8, v64, tables, seq_lens, kv_heads, bs, krow, vrow, far_blocks, run, out
):  # pragma: no cover
    """Thread ``t``'s share of the work items (taken from ``runs`` like the kernel takes them), read like the
    kernel reads them; ``out[it]`` gets the XOR of every 64-bit word read (the first word of each 64-byte
    line), so nothing can be skipped.

    items: ``[n, 5]`` int64 from ``work_items`` (row, head, first block, end block, tail); runs: from
    ``thread_runs``; k8/v8: the key and value pools as flat uint8, k64/v64 the same bytes as uint64;
    tables: ``[batch, max_blocks]`` int32; seq_lens: ``[batch]`` int32 (prefetches run on to the row's last
    sealed block, as the kernel's do); krow/vrow: payload bytes per row; far_blocks: how far ahead the L2
    prefetch runs (``cpu_decode.FAR_BLOCKS``, 0 for none); run: blocks the kernel attends per softmax step (a key
    spec's ``P_MULTI`` where it takes runs, else 1): the keys of a run's blocks are read, then their values;
    out: ``[n]`` uint64.
    """
    it = take_item(runs, t)
    while it >= 0:
        b, h, j0, j1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        jp = np.int64(seq_lens[b]) // bs
        acc = _U64(0)
        j = j0
        while j < j1:
            nb = 0  # released blocks (the null block) are never read, and end a run as in the kernel
            while nb < run and j + nb < j1 and tables[b, j + nb] != 0:
                nb += 1
            for part in range(2):
                p8 = k8 if part == 0 else v8
                p64 = k64 if part == 0 else v64
                rs = krow if part == 0 else vrow
                for jj in range(j, j + nb):
                    far = np.int64(tables[b, jj + far_blocks]) if (far_blocks and jj + far_blocks < jp) else np.int64(0)
                    near = np.int64(tables[b, jj + 1]) if jj + 1 < jp else np.int64(0)
                    acc = _read_rows(p8, p64, rs, np.int64(tables[b, jj]), far, near, h, kv_heads, bs, acc)
            j += max(nb, 1)
        out[it] = acc
        it = take_item(runs, t)


class BlockRead:
    """The probe for one cache: build once, :meth:`run` as often as needed."""

    def __init__(self, kv: PagedKV, threads: int | None = None) -> None:
        from kvpack.kernels import cpu_decode

        if kv.k_data.device.type != "cpu":
            raise UnsupportedError(f"the block-read probe reads CPU pools; this cache is on {kv.k_data.device}")
        self.kv = kv
        self.threads = threads or max(1, torch.get_num_threads())
        tables = kv.block_tables.contiguous().numpy()
        seq_lens = kv.seq_lens.contiguous().numpy()
        start = np.zeros(kv.batch, np.int32) if kv.start_pos is None else kv.start_pos.contiguous().numpy()
        self.items, _ = cpu_decode.work_items(seq_lens, start, -1, kv.block_size, kv.kv_heads, self.threads)
        k8, v8 = (t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (kv.k_data, kv.v_data))
        krow, vrow = (t.shape[-1] * t.element_size() for t in (kv.k_data, kv.v_data))
        self.out = np.zeros(len(self.items), np.uint64)
        self.blocks_per_run = cpu_decode.blocks_per_run(kv)  # as the kernel reads them: runs of blocks, how long
        self.args = (k8, k8.view(np.uint64), v8, v8.view(np.uint64), tables, seq_lens, kv.kv_heads, kv.block_size, krow,
                     vrow, cpu_decode.FAR_BLOCKS, self.blocks_per_run, self.out)  # fmt: skip
        blocks = int(np.sum(self.items[:, 3] - self.items[:, 2]))
        self.nbytes = blocks * kv.block_size * (krow + vrow)

    def run(self) -> np.ndarray:
        """One pass over the payload; returns the per-item XOR words (``[n_items]`` uint64)."""
        from kvpack.kernels import cpu_decode

        cpu_decode.run_items(read_items, self.items, self.threads, self.args)
        return self.out


def measure_block_read(kv: PagedKV, repeats: int = 10, warmup: int = 2) -> tuple[float, float]:
    """``(median seconds, GB/s)`` of :class:`BlockRead` over ``kv``'s payload, with torch's thread count."""
    from kvpack.bench.membw import time_calls

    probe = BlockRead(kv)
    med = statistics.median(time_calls(probe.run, repeats, warmup))
    return med, probe.nbytes / med / 1e9
