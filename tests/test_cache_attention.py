"""Reference attention over cache views vs a dense float64 computation on the dequantized contents:
decode, a chunk of queries after a cached document, GQA, shuffled block ids, sliding window."""

import math

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.formats import parse_format
from kvpack.kernels import decode_attention
from kvpack.kernels.reference import paged_attention_reference
from kvpack.quant import dequantize, quantize
from kvpack.testing import assert_close, realistic_keys

KV_HEADS, HQ, D, B, L = 2, 6, 64, 16, 2


def churned_cache(fmt, num_blocks, seed, **kw):
    """A cache whose free list hands out block ids in a shuffled order."""
    cache = PagedKVCache(parse_format(fmt).with_block_size(B), L, KV_HEADS, D, num_blocks, **kw)
    ids = cache.pool.allocate_many(num_blocks - 1)
    for i in torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist():
        cache.pool.release(ids[i])
    return cache


def dequantized(spec, x, sink=0):
    """What the cache should hold for x [H, n, D]: full blocks through quantize/dequantize, the tail as is,
    and the attention-sink positions ``p < min(sink, sealed tokens)`` as is (x is representable in the tail
    dtype)."""
    nb = x.shape[1] // B
    blocks = x[:, : nb * B].reshape(KV_HEADS, nb, B, D).transpose(0, 1)
    sealed = dequantize(quantize(blocks, spec)).transpose(0, 1).reshape(KV_HEADS, nb * B, D)
    s = min(sink, nb * B)
    sealed[:, :s] = x[:, :s]
    return torch.cat([sealed, x[:, nb * B :]], dim=1)


def expected_kv(fmt, k, v):
    return dequantized(fmt.key, k, fmt.sink), dequantized(fmt.value, v, fmt.sink)


def dense_attention(q, k, v, window=None):
    """float64 causal GQA attention of the last T positions: q [T, Hq, D], k/v [H, n, D] -> [T, Hq, D]."""
    t, n = q.shape[0], k.shape[1]
    k = k.double().repeat_interleave(HQ // KV_HEADS, 0)
    v = v.double().repeat_interleave(HQ // KV_HEADS, 0)
    s = torch.einsum("thd,hnd->htn", q.double(), k) / math.sqrt(D)
    qpos = torch.arange(n - t, n).view(-1, 1)
    kpos = torch.arange(n).view(1, -1)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("htn,hnd->thd", p, v)


def fill(cache, sids, xs_k, xs_v, start, stop):
    for layer in range(L):
        k = torch.stack([x[layer][:, start:stop] for x in xs_k])
        v = torch.stack([x[layer][:, start:stop] for x in xs_v])
        cache.append(layer, sids, k, v)


@pytest.mark.parametrize("fmt", ["int8", "int4", "k4v2", "fp8-plain"])
def test_question_chunk_after_cached_documents(fmt):
    g = torch.Generator().manual_seed(0)
    doc_lens = [100, 37, 64]
    chunk = 7
    cache = churned_cache(fmt, 40, seed=1)
    assert cache.format.sink == 1  # the preset keeps position 0 exact: expected_kv reads it as appended
    sids = [cache.add_sequence() for _ in doc_lens]
    total = max(doc_lens) + chunk
    keys = [[realistic_keys(KV_HEADS, total, D, generator=g) for _ in range(L)] for _ in doc_lens]
    vals = [[torch.randn(KV_HEADS, total, D, generator=g) for _ in range(L)] for _ in doc_lens]
    for i, (sid, n) in enumerate(zip(sids, doc_lens)):  # documents of different lengths
        fill(cache, [sid], keys[i : i + 1], vals[i : i + 1], 0, n)
    # the question: T tokens per row, one append per layer; rows sit at different offsets
    for layer in range(L):
        k = torch.stack([keys[i][layer][:, n : n + chunk] for i, n in enumerate(doc_lens)])
        v = torch.stack([vals[i][layer][:, n : n + chunk] for i, n in enumerate(doc_lens)])
        cache.append(layer, sids, k, v)
    table = cache.view(0, sids).block_tables
    assert table[0, :6].tolist() != sorted(table[0, :6].tolist())  # the gather really is shuffled
    q = torch.randn(len(sids), chunk, HQ, D, generator=g)
    for layer in range(L):
        out = paged_attention_reference(q, cache.view(layer, sids))
        for i, n in enumerate(doc_lens):
            k, v = expected_kv(cache.format, keys[i][layer][:, : n + chunk], vals[i][layer][:, : n + chunk])
            want = dense_attention(q[i], k, v)
            assert_close(out[i], want, atol=2e-5, rtol=1e-4, msg=f"{fmt} layer {layer} row {i}")


@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
def test_decode_steps_with_gqa(fmt):
    g = torch.Generator().manual_seed(2)
    lens = [1, 31, 65]
    steps = 20
    cache = churned_cache(fmt, 30, seed=3, tail_dtype=torch.float16)
    assert cache.format.sink == 1  # the preset keeps position 0 exact (fp16-representable inputs)
    sids = [cache.add_sequence() for _ in lens]
    total = max(lens) + steps
    keys = [[realistic_keys(KV_HEADS, total, D, generator=g).half().float() for _ in range(L)] for _ in lens]
    vals = [[torch.randn(KV_HEADS, total, D, generator=g).half().float() for _ in range(L)] for _ in lens]
    for i, (sid, n) in enumerate(zip(sids, lens)):
        fill(cache, [sid], keys[i : i + 1], vals[i : i + 1], 0, n)
    fmt_ = cache.format
    for step in range(steps):
        for layer in range(L):
            k = torch.stack([keys[i][layer][:, n + step : n + step + 1] for i, n in enumerate(lens)])
            v = torch.stack([vals[i][layer][:, n + step : n + step + 1] for i, n in enumerate(lens)])
            cache.append(layer, sids, k, v)
            if step % 7 != 6:
                continue
            q = torch.randn(len(sids), HQ, D, generator=g)
            out = decode_attention(q, cache.view(layer, sids), backend="reference")
            for i, n in enumerate(lens):
                m = n + step + 1
                k, v = expected_kv(fmt_, keys[i][layer][:, :m], vals[i][layer][:, :m])
                want = dense_attention(q[i][None], k, v)[0]
                assert_close(out[i], want, atol=2e-5, rtol=1e-4, msg=f"step {step} row {i}")


def test_sliding_window_attention_after_blocks_are_released():
    g = torch.Generator().manual_seed(4)
    w = 24
    cache = churned_cache("int8", 8, seed=5, window=w)  # 7 usable blocks; 150 tokens need releasing
    sid = cache.add_sequence()
    n = 150
    keys = [realistic_keys(KV_HEADS, n, D, generator=g) for _ in range(L)]
    vals = [torch.randn(KV_HEADS, n, D, generator=g) for _ in range(L)]
    fill(cache, [sid], [keys], [vals], 0, 90)
    for t in range(90, n):
        fill(cache, [sid], [keys], [vals], t, t + 1)
    kv = cache.view(1, [sid])
    released = int((kv.block_tables[0, : n // B] == 0).sum())
    assert released >= 6
    q = torch.randn(1, HQ, D, generator=g)
    out = decode_attention(q, kv, window=cache.layer_window(1), backend="reference")
    k, v = expected_kv(cache.format, keys[1], vals[1])
    want = dense_attention(q, k, v, window=w)[0]
    assert_close(out[0], want, atol=2e-5, rtol=1e-4)
