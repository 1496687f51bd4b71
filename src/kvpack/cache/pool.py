"""The block allocator: plain Python, O(1) per operation.

One :class:`BlockPool` serves every layer of a :class:`~kvpack.cache.PagedKVCache`: a block id names that
block in all layers' pools (as in vLLM). Block 0 is the null block: never handed out, never freed; block
tables point at it where nothing is stored.

A block is in exactly one of three states:

* **free**: on the free list, holds nothing;
* **in use**: reference count > 0 (sequences whose block table holds it);
* **cached**: reference count 0 but registered under a prefix hash, so a later sequence with the same
  tokens can reuse it. Cached blocks count as available: :meth:`BlockPool.allocate` evicts the least
  recently used one when the free list is empty.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpack.errors import ConfigError, PoolExhaustedError, SequenceError

__all__ = ["NULL_BLOCK", "BlockPool"]

NULL_BLOCK = 0


class BlockPool:
    """Free list, reference counts and the LRU of cached (hash-registered, unreferenced) blocks.

    Args:
        num_blocks: total blocks, the null block included (so ``num_blocks - 1`` are usable).
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(
                f"a block pool needs at least 2 blocks (the null block and one usable), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # popped from the end: low ids first, which keeps fresh caches easy to read in tests and dumps
        self._free = list(range(num_blocks - 1, 0, -1))
        self._hash_of: dict[int, bytes] = {}  # block -> prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    # -- counts -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (holding nothing)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix reuse (evicted LRU on demand)."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - 1 - self.num_available

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def ref_counts(self) -> list[int]:
        """A copy of every block's reference count (index = block id; entry 0 is the null block)."""
        return list(self._ref)

    def is_cached(self, block: int) -> bool:
        """Registered under a prefix hash (in use or not)."""
        return block in self._hash_of

    # -- allocation ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """One block with reference count 1: from the free list, else by evicting the LRU cached block."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise PoolExhaustedError(
                f"the block pool is exhausted: all {self.num_blocks - 1} blocks are in use; free or offload "
                "sequences, or create the cache with more num_blocks"
            )
        self._ref[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, or :class:`PoolExhaustedError` with nothing allocated."""
        self.require(n)
        return [self.allocate() for _ in range(n)]

    def require(self, n: int, what: str = "this operation") -> None:
        """Raise :class:`PoolExhaustedError` unless ``n`` blocks can be allocated now."""
        if n > self.num_available:
            raise PoolExhaustedError(
                f"{what} needs {n} new blocks but only {self.num_available} of {self.num_blocks - 1} are "
                "available; nothing was changed. Free or offload sequences, crop them, or create the cache "
                "with more num_blocks"
            )

    def incref(self, block: int) -> None:
        """Add a reference to a block in use or cached (a cached block leaves the LRU)."""
        if block == NULL_BLOCK:
            return
        if self._ref[block] == 0:
            if block not in self._evictable:
                raise SequenceError(f"block {block} is free; it cannot gain a reference (allocate it first)")
            del self._evictable[block]
        self._ref[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference. At zero a registered block becomes cached (most recently used end of the
        LRU), any other block goes back to the free list."""
        if block == NULL_BLOCK:
            return
        if not 0 < block < self.num_blocks:
            raise SequenceError(f"block {block} does not exist (valid ids are 1..{self.num_blocks - 1})")
        if self._ref[block] == 0:
            raise SequenceError(f"block {block} has no reference left (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------------------
    def register(self, block: int, key: bytes) -> bool:
        """Record that in-use ``block`` holds the sealed contents named by ``key``.

        Returns False (and changes nothing) when ``key`` already names another block or ``block`` is
        already registered: the first registration wins, so lookups stay stable.
        """
        if block == NULL_BLOCK or key in self._block_of or block in self._hash_of:
            return False
        if self._ref[block] == 0:
            raise SequenceError(f"block {block} is not in use; only sealed, referenced blocks can be registered")
        self._hash_of[block] = key
        self._block_of[key] = block
        return True

    def lookup(self, key: bytes) -> int | None:
        """The block registered under ``key`` (in use or cached), or None."""
        return self._block_of.get(key)

    def evictable_blocks(self) -> list[int]:
        """Cached unreferenced blocks, least recently used first."""
        return list(self._evictable)

    def problems(self) -> list[str]:
        """Internal consistency (empty when consistent): every block is in exactly one state."""
        out = []
        free, cached = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            out.append("a block is on the free list twice")
        if NULL_BLOCK in free or NULL_BLOCK in cached or self._ref[NULL_BLOCK]:
            out.append("the null block was handed out")
        for b in range(1, self.num_blocks):
            states = (b in free) + (b in cached) + (self._ref[b] > 0)
            if states != 1:
                out.append(
                    f"block {b} is in {states} states (free={b in free}, cached={b in cached}, ref={self._ref[b]})"
                )
            if b in cached and b not in self._hash_of:
                out.append(f"cached block {b} has no hash")
            if b in free and b in self._hash_of:
                out.append(f"free block {b} is still registered")
        for key, b in self._block_of.items():
            if self._hash_of.get(b) != key:
                out.append(f"hash index and block index disagree on block {b}")
        return out
