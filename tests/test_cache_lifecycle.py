"""fork, crop, free, reorder and the sliding window of PagedKVCache."""

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import SequenceError
from kvpack.formats import parse_format
from kvpack.quant import dequantize, quantize
from kvpack.testing import assert_bitexact

H, D, B = 2, 32, 8
FMT = parse_format("int4").with_block_size(B)


def filled(n, layers=2, num_blocks=12, seed=0, **kw):
    cache = PagedKVCache(FMT, layers, H, D, num_blocks, **kw)
    sid = cache.add_sequence()
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    for layer in range(layers):
        cache.append(layer, [sid], k + layer, v - layer)
    return cache, sid, k[0], v[0]


def roundtrip(spec, x):
    """Dequantized full blocks of x [H, n, D] (n a multiple of B)."""
    blocks = x.reshape(H, -1, B, D).transpose(0, 1)
    return dequantize(quantize(blocks, spec)).transpose(0, 1).reshape(H, -1, D)


def sealed_history(spec, x):
    """What the cache reads for the sealed positions [0, n) of a sequence, x [H, n, D] (n a multiple of B):
    the dequantized blocks, except the attention-sink positions p < FMT.sink (the preset keeps sink=1), kept
    exactly as appended (fp32 tail)."""
    out = roundtrip(spec, x)
    out[:, : FMT.sink] = x[:, : FMT.sink]
    return out


def test_crop_inside_the_tail_just_shortens_it():
    assert FMT.sink == 1  # the preset's sink survives the block size: sealed_history keeps position 0 exact
    cache, sid, k, _v = filled(20)
    used = cache.pool.num_used
    cache.crop(sid, 18)
    assert cache.seq_len(sid) == cache.seq_len(sid, 1) == 18 and cache.pool.num_used == used
    got_k, _got_v = cache.dense(1, sid)
    assert_bitexact(got_k[:, 16:], k[:, 16:18] + 1)
    assert_bitexact(got_k[:, :16], sealed_history(FMT.key, k[:, :16] + 1))  # position 0 exact, the rest dequantized
    cache.crop(sid, 16)  # to the block boundary: empty tail, the sealed blocks stay
    assert cache.seq_len(sid) == 16 and cache.pool.num_used == used


def test_crop_inside_a_sealed_block_returns_dequantized_tokens_to_the_tail():
    cache, sid, k, v = filled(20)
    assert cache.pool.num_used == 2
    cache.crop(sid, 11)  # block 1 (positions 8..15) is sealed; keep 8..10
    assert cache.pool.num_used == 1 and cache.seq_len(sid) == 11
    for layer in range(2):
        got_k, got_v = cache.dense(layer, sid)
        want_k = sealed_history(FMT.key, k[:, :16] + layer)[:, :11]  # block 0 stays sealed: its sink row exact
        want_v = sealed_history(FMT.value, v[:, :16] - layer)[:, :11]
        assert_bitexact(got_k, want_k)  # tail slots 0..2 hold the dequantized values
        assert_bitexact(got_v, want_v)
        assert_bitexact(cache.view(layer, [sid]).tail_k[0, :, :3], want_k[:, 8:11])
    # the next seal quantizes the returned values plus the new tokens
    new = torch.randn(1, H, 5, D)
    for layer in range(2):
        cache.append(layer, [sid], new, new)
    got_k, _ = cache.dense(0, sid)
    want = roundtrip(FMT.key, torch.cat([roundtrip(FMT.key, k[:, :16])[:, 8:11], new[0]], dim=1))
    assert_bitexact(got_k[:, 8:16], want)
    assert cache.problems() == []


def test_crop_to_zero_and_beyond():
    cache, sid, *_ = filled(20)
    with pytest.raises(SequenceError, match="holds 20; use 0 <= n <= 20"):
        cache.crop(sid, 21)
    with pytest.raises(SequenceError):
        cache.crop(sid, -1)
    assert cache.seq_len(sid) == 20 and cache.pool.num_used == 2
    cache.crop(sid, 0)
    assert cache.seq_len(sid) == 0 and cache.pool.num_used == 0
    x = torch.randn(1, H, 9, D)
    for layer in range(2):
        cache.append(layer, [sid], x, x)
    assert_bitexact(cache.dense(0, sid)[0][:, 8:], x[0, :, 8:])


def test_crop_mid_step_only_back_to_the_slowest_layer():
    cache, sid, *_ = filled(20)
    x = torch.randn(1, H, 4, D)
    cache.append(0, [sid], x, x)  # layer 0 at 24 (seals block 2), layer 1 still at 20
    with pytest.raises(SequenceError, match="mid-step"):
        cache.crop(sid, 22)
    assert cache.pool.num_used == 3
    cache.crop(sid, 20)  # recovery: back to where every layer is
    assert [cache.seq_len(sid, 0), cache.seq_len(sid, 1)] == [20, 20] and cache.pool.num_used == 2
    assert cache.problems() == []


def test_fork_shares_sealed_blocks_and_copies_the_tail():
    cache, sid, k, _v = filled(20)
    child = cache.fork(sid)
    ids = cache.view(0, [sid]).block_tables[0, :2].tolist()
    assert cache.view(0, [child]).block_tables[0, :2].tolist() == ids
    assert [cache.pool.ref_count(b) for b in ids] == [2, 2] and cache.pool.num_used == 2
    x = torch.randn(1, H, 1, D)
    for layer in range(2):
        cache.append(layer, [child], x, x)
    assert cache.seq_len(sid) == 20 and cache.seq_len(child) == 21
    assert_bitexact(cache.dense(0, child)[0][:, :20], cache.dense(0, sid)[0])
    cache.crop(child, 4)  # the parent keeps its blocks
    assert [cache.pool.ref_count(b) for b in ids] == [1, 1]
    parent_k, _ = cache.dense(1, sid)
    assert_bitexact(parent_k[:, :16], sealed_history(FMT.key, k[:, :16] + 1))
    assert_bitexact(parent_k[:, 16:], k[:, 16:] + 1)
    assert cache.problems() == []


def test_free_and_double_free():
    cache, sid, *_ = filled(20)
    child = cache.fork(sid)
    cache.free(sid)
    assert cache.pool.num_used == 2  # still held by the fork
    with pytest.raises(SequenceError, match="already freed"):
        cache.free(sid)
    with pytest.raises(SequenceError, match="already freed"):
        cache.view(0, [sid])
    with pytest.raises(SequenceError, match="unknown sequence id 99"):
        cache.free(99)
    cache.free(child)
    assert cache.pool.num_used == 0 and cache.seq_ids == []
    assert cache.problems() == []


def test_reorder_for_beam_search():
    cache = PagedKVCache(FMT, 2, H, D, 12)
    beams = [cache.add_sequence() for _ in range(3)]
    xs = torch.randn(3, H, 10, D)
    for layer in range(2):
        cache.append(layer, beams, xs, xs)
    before = [cache.dense(1, s) for s in beams]
    cache.reorder(beams, [2, 2, 0])
    after = [cache.dense(1, s) for s in beams]
    for got, src in zip(after, [2, 2, 0]):
        assert_bitexact(got[0], before[src][0])
    b0 = cache.view(0, beams).block_tables[:, 0].tolist()
    assert b0[0] == b0[1] and cache.pool.ref_count(b0[0]) == 2 and cache.pool.num_used == 2
    x = torch.randn(3, H, 1, D)
    for layer in range(2):
        cache.append(layer, beams, x, x)  # the copied tails are independent
    assert_bitexact(cache.dense(0, beams[0])[0][:, 10], x[0, :, 0])
    assert_bitexact(cache.dense(0, beams[1])[0][:, 10], x[1, :, 0])
    assert cache.problems() == []
    with pytest.raises(Exception, match="row indices"):
        cache.reorder(beams, [0, 1])


def test_sliding_window_releases_blocks_left_by_every_layer():
    cache = PagedKVCache(FMT, 2, H, D, 6, window=[10, 12])
    sid = cache.add_sequence()
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(1, H, 60, D, generator=g)
    for t in range(60):  # 60 tokens with 5 usable blocks: only possible because old blocks are released
        for layer in range(2):
            cache.append(layer, [sid], xs[:, :, t : t + 1], xs[:, :, t : t + 1])
        n = t + 1
        # the earliest query of this step sat at n - 1 and attended positions > n - 1 - 12
        released = max(0, n - 1 - 12 + 1) // B
        table = cache.view(0, [sid]).block_tables[0, : n // B].tolist()
        assert table[:released] == [0] * released and all(table[released:])
    k, _ = cache.dense(0, sid)
    assert (k[:, : released * B] == 0).all()
    assert_bitexact(k[:, 56:], xs[0, :, 56:])
    assert cache.memory_report().total.live_tokens == 2 * (60 - released * B)
    # cropping back into released positions is refused; within the window it works
    with pytest.raises(SequenceError, match="crop to at least"):
        cache.crop(sid, 50)
    cache.crop(sid, 59)
    assert cache.problems() == []


def test_no_release_when_a_layer_has_no_window():
    cache = PagedKVCache(FMT, 2, H, D, 8, window=[4, None])
    sid = cache.add_sequence()
    x = torch.randn(1, H, 48, D)
    for layer in range(2):
        cache.append(layer, [sid], x, x)
    cache.append(0, [sid], x[:, :, :1], x[:, :, :1])
    assert cache.pool.num_used == 6 and cache.layer_window(0) == 4 and cache.layer_window(1) is None
