"""Prefix hashing: the name of a sealed block's contents.

A sealed block is identified by ``hash(parent hash, token ids of the block, format spec string)``, so a
key names the whole prefix up to and including the block (two blocks with the same tokens after different
prefixes get different keys), and blocks quantized in another format never match. Only blocks whose token
ids were recorded (``add_sequence(token_ids)`` / ``append_tokens``) can be named, hence shared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["ROOT", "block_key", "chain_keys"]

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
