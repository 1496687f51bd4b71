"""Prefix hashing: the name of a sealed block's contents.

A sealed block is identified by ``hash(parent hash, token ids of the block, format spec string)``, so a
key names the whole prefix up to and including the block (two blocks with the same tokens after different
prefixes get different keys), and blocks quantized in another format never match. Only blocks whose token
ids were recorded (``add_sequence(token_ids)`` / ``append_tokens``) can be named, hence shared.

:class:`PrefixIndex` is the cache's side of sharing: it finds a prompt's cached blocks and gives a sequence's
sealed blocks their keys in the pool (and, for a format with a sink, keeps a first block's sink rows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvpack.cache.pool import NULL_BLOCK, BlockPool
from kvpack.cache.sink import PrefixSinks
from kvpack.cache.slots import SeqState, SlotTable

__all__ = ["ROOT", "PrefixIndex", "block_key", "chain_keys"]

ROOT = b""  # the parent of a sequence's first block


def block_key(parent: bytes, token_ids: Sequence[int], salt: str) -> bytes:
    """Key of one block: blake2b over the parent key, the block's token ids (int64) and ``salt``.

    Args:
        parent: key of the previous block, or :data:`ROOT`.
        token_ids: the block's ``block_size`` token ids.
        salt: identifies the storage (the format spec string and geometry), so other formats never match.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(salt.encode())
    return h.digest()


def chain_keys(
    token_ids: Sequence[int], block_size: int, salt: str, parent: bytes = ROOT, start: int = 0
) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` from block ``start`` on (``parent`` is block ``start - 1``'s key)."""
    keys = []
    for j in range(start, len(token_ids) // block_size):
        parent = block_key(parent, token_ids[j * block_size : (j + 1) * block_size], salt)
        keys.append(parent)
    return keys


class PrefixIndex:
    """Names sealed blocks in the pool and finds them again.

    Args:
        pool: the pool whose key map holds the registered blocks.
        salt: the storage's salt (:attr:`kvpack.cache.config.CacheConfig.salt`).
        block_size: tokens per block.
        sinks: where the sink rows of registered first blocks are kept (a format with a sink), or None.
    """

    def __init__(self, pool: BlockPool, salt: str, block_size: int, sinks: PrefixSinks | None = None) -> None:
        self.pool, self.salt, self.block_size, self.sinks = pool, salt, block_size, sinks

    def lookup(self, token_ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """``(key, block)`` of the longest run of cached full blocks of a prompt, at most
        ``(len(token_ids) - 1) // block_size`` (one prompt token is left to run through the model); with
        sinks, nothing unless sink rows are kept for the first block."""
        b = self.block_size
        hits: list[tuple[bytes, int]] = []
        parent = ROOT
        for j in range(max(0, len(token_ids) - 1) // b):
            key = block_key(parent, token_ids[j * b : (j + 1) * b], self.salt)
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append((key, block))
            parent = key
        if hits and self.sinks is not None and self.sinks.get(hits[0][1]) is None:
            return []  # no sink rows kept for that first block: nothing to reuse
        return hits

    def register(self, slots: SlotTable, seq: SeqState) -> None:
        """Give prefix keys to the sequence's blocks sealed in every layer whose token ids are known."""
        b = self.block_size
        upto = min(int(slots.lens_np[:, seq.slot].min()) // b, len(seq.tokens) // b)
        if upto <= len(seq.keys):
            return
        parent = seq.keys[-1] if seq.keys else ROOT
        for j, key in enumerate(chain_keys(seq.tokens[: upto * b], b, self.salt, parent, len(seq.keys)), len(seq.keys)):
            seq.keys.append(key)
            if seq.blocks[j] != NULL_BLOCK and j not in seq.impure:
                self.pool.register(seq.blocks[j], key)
                if j == 0:
                    self.keep_sink(slots, seq)

    def keep_sink(self, slots: SlotTable, seq: SeqState) -> None:
        """After block 0 of ``seq`` is (re-)registered: keep its sink rows beside it for prefix sharing."""
        if self.sinks is not None and slots.sink_k is not None and seq.blocks and seq.keys:
            self.sinks.keep(seq.blocks[0], seq.keys[0], slots.sink_k[:, seq.slot], slots.sink_v[:, seq.slot])
