"""BlockPool: free list, reference counts, null block, LRU of cached blocks."""

import pytest

from kvpack.cache import NULL_BLOCK, BlockPool
from kvpack.errors import ConfigError, PoolExhaustedError, SequenceError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    got = [pool.allocate() for _ in range(4)]
    assert sorted(got) == [1, 2, 3, 4]
    assert NULL_BLOCK not in got
    assert pool.num_available == 0 and pool.num_used == 4
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        pool.allocate()
    assert pool.problems() == []


def test_release_and_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate()
    pool.incref(a)
    assert pool.ref_count(a) == 2
    pool.release(a)
    assert pool.ref_count(a) == 1 and pool.num_free == 2
    pool.release(a)
    assert pool.ref_count(a) == 0 and pool.num_free == 3
    with pytest.raises(SequenceError, match="double free"):
        pool.release(a)
    assert pool.num_free == 3 and pool.problems() == []
    with pytest.raises(SequenceError, match="is free"):
        pool.incref(a)
    pool.release(NULL_BLOCK)  # releasing the null block is a no-op
    assert pool.ref_count(NULL_BLOCK) == 0


def test_allocate_many_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate()
    with pytest.raises(PoolExhaustedError, match="needs 3 new blocks but only 2"):
        pool.allocate_many(3)
    assert pool.num_available == 2
    assert len(pool.allocate_many(2)) == 2


def test_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.register(a, b"ka") and pool.register(b, b"kb") and pool.register(c, b"kc")
    assert not pool.register(c, b"kc2")  # already registered
    pool.release(b)
    pool.release(a)
    pool.release(c)
    assert pool.num_free == 0 and pool.num_cached == 3 and pool.num_available == 3
    assert pool.evictable_blocks() == [b, a, c]
    pool.incref(a)  # reuse by a prefix hit: leaves the LRU
    assert pool.lookup(b"ka") == a and pool.evictable_blocks() == [b, c]
    assert pool.allocate() == b  # oldest cached block evicted
    assert pool.lookup(b"kb") is None and not pool.is_cached(b)
    pool.release(a)  # back to the most recently used end
    assert pool.evictable_blocks() == [c, a]
    assert pool.problems() == []


def test_register_needs_a_referenced_block_and_first_wins():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"k")
    assert not pool.register(b, b"k")
    assert pool.lookup(b"k") == a
    pool.release(b)
    with pytest.raises(SequenceError, match="not in use"):
        pool.register(b, b"other")


def test_bad_sizes_and_ids():
    with pytest.raises(ConfigError):
        BlockPool(1)
    pool = BlockPool(3)
    with pytest.raises(SequenceError, match="does not exist"):
        pool.release(7)


def test_many_blocks_round_trip():
    pool = BlockPool(2001)
    ids = [pool.allocate() for _ in range(2000)]
    for i, b in enumerate(ids):
        if i % 2:
            pool.register(b, i.to_bytes(4, "little"))
    for b in ids:
        pool.release(b)
    assert pool.num_free == 1000 and pool.num_cached == 1000
    again = [pool.allocate() for _ in range(2000)]  # free list first, then every cached block evicted
    assert sorted(again) == list(range(1, 2001))
    assert pool.num_cached == 0 and pool.lookup((1).to_bytes(4, "little")) is None
    assert pool.problems() == []
