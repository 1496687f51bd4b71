"""Offload to the host tier (bit-identical round trip, bytes moved) and the memory report."""

import pytest
import torch

from kvpack.cache import MemoryReport, PagedKVCache
from kvpack.errors import PoolExhaustedError, SequenceError
from kvpack.formats import parse_format
from kvpack.testing import assert_bitexact

H, D, B, L = 2, 64, 16, 3


def make(fmt="int4", num_blocks=12, tail_dtype=torch.float32):
    fmt = parse_format(fmt).with_block_size(B)
    return PagedKVCache(fmt, L, H, D, num_blocks, tail_dtype=tail_dtype)


def fill(cache, sids, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(sids), H, n, D, generator=g)
    for layer in range(L):
        cache.append(layer, sids, x * (layer + 1), -x)


def contents(cache, sid):
    return [cache.dense(layer, sid) for layer in range(L)]


@pytest.mark.parametrize("fmt", ["int8", "int4", "kivi2", "fp8-plain", "fp8-o4"])
def test_offload_moves_exclusive_blocks_quantized_and_restores_bit_identical(fmt):
    cache = make(fmt)
    a = cache.add_sequence()
    fill(cache, [a], 40)  # 2 sealed blocks + 8 tail tokens
    cache.fork(a)  # shares both blocks
    fill(cache, [a], 40, seed=1)  # a: 80 tokens, 5 blocks, 3 of them its own
    before = contents(cache, a)
    used = cache.pool.num_used
    moved = cache.offload(a)
    block = cache.format.block_bytes(H, D)
    assert moved == 3 * L * block
    fp16 = 3 * L * 2 * H * B * D * 2
    assert fp16 / moved == pytest.approx(16 / cache.format.bits_per_element(H, D))
    assert cache.pool.num_used == used - 3 and cache.is_offloaded(a)
    assert cache.memory_report().total.host_bytes == moved
    for call in (
        lambda: cache.view(0, [a]),
        lambda: cache.fork(a),
        lambda: cache.crop(a, 1),
        lambda: cache.dense(0, a),
    ):
        with pytest.raises(SequenceError, match=r"offloaded to the host tier; call cache.restore\(0\)"):
            call()
    x = torch.randn(1, H, 1, D)
    with pytest.raises(SequenceError, match="offloaded"):
        cache.append(0, [a], x, x)
    with pytest.raises(SequenceError, match="already offloaded"):
        cache.offload(a)
    assert cache.seq_len(a) == 80
    # the pool can be used meanwhile; restored blocks get new ids with identical bytes
    c = cache.add_sequence()
    fill(cache, [c], 48, seed=2)
    assert cache.restore(a) == moved
    assert not cache.is_offloaded(a) and cache.memory_report().total.host_bytes == 0
    for (k0, v0), (k1, v1) in zip(before, contents(cache, a)):
        assert_bitexact(k1, k0)
        assert_bitexact(v1, v0)
    fill(cache, [a], 1)  # and it keeps going
    assert cache.seq_len(a) == 81
    with pytest.raises(SequenceError, match="not offloaded"):
        cache.restore(a)
    assert cache.problems() == []


def test_restore_into_a_full_pool_changes_nothing():
    cache = make(num_blocks=6)
    a = cache.add_sequence()
    fill(cache, [a], 64)  # 4 blocks
    cache.offload(a)
    b = cache.add_sequence()
    fill(cache, [b], 32)  # 2 of 5 usable blocks remain free... after this, 3 are
    c = cache.add_sequence()
    fill(cache, [c], 16)
    with pytest.raises(PoolExhaustedError, match="restoring sequence 0 needs 4 new blocks but only 2"):
        cache.restore(a)
    assert cache.is_offloaded(a) and cache.memory_report().total.host_bytes > 0
    cache.free(b)
    cache.restore(a)
    assert cache.problems() == []


def test_free_an_offloaded_sequence_drops_its_host_copy():
    cache = make()
    a = cache.add_sequence()
    fill(cache, [a], 40)
    cache.offload(a)
    cache.free(a)
    assert cache.memory_report().total.host_bytes == 0 and cache.pool.num_used == 0
    assert cache.problems() == []


# -- memory report ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt", ["int8", "int4", "k4v2", "fp8-plain", "fp8-o4", "k=int4:g16:asym:e8m0,v=int8:token:bf16"]
)
@pytest.mark.parametrize("tail_dtype", [torch.float32, torch.bfloat16])
def test_actual_usage_matches_the_formula(fmt, tail_dtype):
    cache = make(fmt, num_blocks=24, tail_dtype=tail_dtype)
    lens = {}
    for n in (1, 15, 16, 17, 50, 97):
        s = cache.add_sequence()
        fill(cache, [s], n, seed=n)
        lens[s] = n
    shared = cache.fork(max(lens, key=lens.get))  # 6 shared blocks
    lens[shared] = 97
    rep = cache.memory_report()
    assert isinstance(rep, MemoryReport) and len(rep.layers) == L
    elem = torch.tensor([], dtype=tail_dtype).element_size()
    per_seq = sum(cache.format.bytes_for_tokens(n, H, D, layers=L, tail_element_bytes=elem) for n in lens.values())
    block = cache.format.block_bytes(H, D)
    t = rep.total
    assert t.theoretical_bytes == per_seq
    assert t.shared_bytes == 6 * L * block
    assert t.used_bytes == per_seq - t.shared_bytes  # exact: sealed blocks plus one tail per sequence
    assert t.payload_bytes == rep.used_blocks * L * cache.format.payload_bytes(H, D)
    assert t.scale_bytes == rep.used_blocks * L * cache.format.scale_bytes(H, D)
    assert t.outlier_bytes == rep.used_blocks * L * cache.format.outlier_bytes(H, D)
    assert t.live_tokens == L * sum(lens.values())
    # every allocated byte is in exactly one bucket
    allocated = sum(p.numel() * p.element_size() for p in cache.storage.pools().values())
    allocated += 2 * cache.slots.tail_k.numel() * cache.slots.tail_k.element_size()
    sink = cache.format.sink
    assert sink == (0 if fmt.startswith("k=") else 1)  # every quantized preset keeps sink=1
    slots = cache.slots.tail_k.shape[1]  # one sink slot beside every tail slot
    allocated += 2 * L * slots * H * sink * D * elem  # the sink buffers: K and V, [L, slots, H, S, D], tail dtype
    assert t.sink_bytes == len(lens) * L * 2 * H * sink * D * elem  # one per live sequence and layer
    assert t.allocated_bytes == allocated
    assert sum(m.used_bytes for m in rep.layers) == t.used_bytes
    d = rep.as_dict()
    assert d["total"]["used_bytes"] == t.used_bytes and len(d["layers"]) == L
    assert "live tokens" in str(rep)
    assert ("sinks" in str(rep)) == bool(sink)


def test_passthrough_formula_within_one_block_per_sequence():
    cache = make("fp16", num_blocks=24, tail_dtype=torch.float16)
    lens = [1, 16, 17, 50]
    for n in lens:
        fill(cache, [cache.add_sequence()], n, seed=n)
    t = cache.memory_report().total
    formula = sum(cache.format.bytes_for_tokens(n, H, D, layers=L) for n in lens)
    rounding = len(lens) * L * cache.format.block_bytes(H, D)
    assert abs(t.used_bytes - formula) <= rounding
    sealed = sum(n // B for n in lens) * L * cache.format.block_bytes(H, D)
    assert t.used_bytes == sealed + len(lens) * L * cache.format.tail_bytes(H, D)
