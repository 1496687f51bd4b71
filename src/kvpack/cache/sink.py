"""Sink rows of shared first blocks: what prefix sharing hands to a sequence of a format with a sink.

A format with ``sink = S`` keeps each sequence's first ``S`` positions in full precision beside its tail
(:class:`~kvpack.cache.PagedKVCache`); they are not part of any block. A sequence that reuses a cached first
block from the prefix cache needs them too, so when a first block is registered its sink rows are copied
here, keyed by the block and checked against the block's prefix key (an evicted or re-registered block's
entry is stale and dropped).
"""

from __future__ import annotations

import torch

from kvpack.cache.pool import NULL_BLOCK, BlockPool

__all__ = ["PrefixSinks"]


class PrefixSinks:
    """Block id -> ``(prefix key, sink k, sink v)``, the sink rows ``[L, H, S, D]`` (tail dtype, cache device)
    of a registered first block."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._entries: dict[int, tuple[bytes, torch.Tensor, torch.Tensor]] = {}

    def _prune(self) -> None:
        self._entries = {b: e for b, e in self._entries.items() if self.pool.lookup(e[0]) == b}

    def keep(self, block: int, key: bytes, sink_k: torch.Tensor, sink_v: torch.Tensor) -> None:
        """Copy the sink rows ``[L, H, S, D]`` of first block ``block`` registered under ``key`` (nothing when
        another block holds the key: its own entry serves)."""
        if block == NULL_BLOCK or self.pool.lookup(key) != block:
            return
        self._prune()
        self._entries[block] = (key, sink_k.clone(), sink_v.clone())

    def get(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sink rows kept for registered first block ``block``, or None."""
        entry = self._entries.get(block)
        if entry is None or self.pool.lookup(entry[0]) != block:
            return None
        return entry[1], entry[2]

    def nbytes(self) -> int:
        """Device bytes held (stale entries dropped first)."""
        self._prune()
        return sum(2 * e[1].numel() * e[1].element_size() for e in self._entries.values())
