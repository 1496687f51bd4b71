"""Sink rows and key centres of shared first blocks: what prefix sharing hands to a sequence that reuses one.

A format with ``sink = S`` keeps each sequence's first ``S`` positions in full precision beside its tail
(:class:`~kvpack.cache.PagedKVCache`), and a key spec with ``center`` keeps each sequence's key centre
(fixed when its first block is sealed; every stored key is shifted by it); neither is part of any block. A
sequence that reuses a cached first block from the prefix cache needs them too, so when a first block is
registered they are copied here, keyed by the block and checked against the block's prefix key (an evicted
or re-registered block's entry is stale and dropped).
"""

from __future__ import annotations

import torch

from kvpack.cache.pool import NULL_BLOCK, BlockPool

__all__ = ["PrefixSinks"]


class PrefixSinks:
    """Block id -> ``(prefix key, rows)``: a registered first block's per-sequence rows, in the cache's order
    (sink k and v ``[L, H, S, D]`` with a sink, key centre ``[L, H, D]`` with ``center``; tail dtype, cache
    device)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._entries: dict[int, tuple[bytes, tuple[torch.Tensor, ...]]] = {}

    def _prune(self) -> None:
        self._entries = {b: e for b, e in self._entries.items() if self.pool.lookup(e[0]) == b}

    def keep(self, block: int, key: bytes, *rows: torch.Tensor) -> None:
        """Copy the per-sequence ``rows`` of first block ``block`` registered under ``key`` (nothing when
        another block holds the key: its own entry serves)."""
        if block == NULL_BLOCK or self.pool.lookup(key) != block:
            return
        self._prune()
        self._entries[block] = (key, tuple(r.clone() for r in rows))

    def get(self, block: int) -> tuple[torch.Tensor, ...] | None:
        """The rows kept for registered first block ``block`` (in the order given to :meth:`keep`), or None."""
        entry = self._entries.get(block)
        if entry is None or self.pool.lookup(entry[0]) != block:
            return None
        return entry[1]

    def nbytes(self) -> int:
        """Device bytes held (stale entries dropped first)."""
        self._prune()
        return sum(r.numel() * r.element_size() for e in self._entries.values() for r in e[1])
