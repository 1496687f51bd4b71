"""Attention-sink positions (``KVFormat.sink``) through the format, the paged cache, the reference kernel,
the simulate engine and the transformers integration.

The oracle everywhere: the dequantized history of the sealed blocks with positions ``p < min(S, sealed
tokens)`` replaced by the values exactly as they entered the cache (in the tail dtype), the tail exact.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import FormatError, SequenceError
from kvpack.formats import DEFAULT_SINK, PRESETS, parse_format
from kvpack.kernels import reference
from kvpack.quant import dequantize, quantize
from kvpack.rotation import rotate
from kvpack.sizing import estimate
from kvpack.testing import assert_bitexact, assert_close, random_paged_kv, realistic_keys

H, D, B = 2, 32, 8


# -- format ---------------------------------------------------------------------------------------------
def test_sink_field_parses_and_round_trips():
    base = parse_format("int4,sink=0")  # the preset without its default sink
    assert base.sink == 0 and base.name == "int4,sink=0" and "sink" not in base.spec_string()
    assert (base.key, base.value, base.block_size) == (PRESETS["int4"].key, PRESETS["int4"].value, 64)
    assert parse_format(base.spec_string()) == base
    f = parse_format("int4,sink=2")
    assert f.sink == 2 and f.name == "int4,sink=2" and (f.key, f.value) == (PRESETS["int4"].key, PRESETS["int4"].value)
    assert f.spec_string() == base.spec_string() + ",sink=2"
    assert parse_format(f.spec_string()) == f
    assert parse_format(PRESETS["int4"].spec_string()).name == "int4"  # the preset's own sink: back to its name
    assert f != PRESETS["int4"] and f != base and base != PRESETS["int4"]
    g = parse_format("k=int8:channel,v=int4:g32:asym,block=32,sink=3")
    assert (g.sink, g.block_size) == (3, 32) and parse_format(g.spec_string()) == g
    assert parse_format("int4,block=32,sink=2").name == "int4,block=32,sink=2"
    assert parse_format("int4,block=32,sink=0").name == "int4,block=32,sink=0"
    assert parse_format("k4v2,sink=2@static").sink == 2  # calibrated scales keep the sink
    assert parse_format("k4v2,sink=0@static").sink == 0
    assert PRESETS["int8"].with_sink(2).with_block_size(16) == parse_format("int8,block=16,sink=2")
    assert PRESETS["int8"].with_sink(1) == PRESETS["int8"] and PRESETS["int8"].with_sink(0).sink == 0
    assert PRESETS["int8"].with_sink(0).with_sink(1) == PRESETS["int8"]
    # every quantized preset keeps sink=1 (formats.DEFAULT_SINK) and says so in its spec string; fp16/bf16 have
    # nothing to keep and their strings are unchanged
    for name, p in PRESETS.items():
        assert parse_format(name) is p and parse_format(p.spec_string()) == p
        if p.is_passthrough:
            assert p.sink == 0 and "sink" not in p.spec_string()
        else:
            assert p.sink == DEFAULT_SINK == 1 and p.spec_string().endswith(",sink=1")
            assert parse_format(f"{name},sink=1") is p and parse_format(p.spec_string()).name == name
            assert p.spec_string() == parse_format(f"{name},sink=0").spec_string() + ",sink=1"


@pytest.mark.parametrize(
    "text, words",
    [
        ("fp16,sink=1", "full precision"),
        ("kv=bf16,sink=2", "full precision"),
        ("int4,sink=65", "[0, block_size=64]"),
        ("int4,block=8,sink=9", "[0, block_size=8]"),
        ("int4,sink=-1", "non-negative integer"),
        ("int4,sink=one", "non-negative integer"),
    ],
)
def test_bad_sinks_are_refused(text, words):
    with pytest.raises(FormatError, match=re.escape(words)):
        parse_format(text)


def test_sink_bytes_by_hand():
    f = parse_format("int4,sink=3")
    base = parse_format("int4,sink=0")
    # 2 (K and V) x 4 kv heads x 3 positions x 128 channels x 2 bytes (fp16)
    assert f.sink_bytes(4, 128) == 2 * 4 * 3 * 128 * 2 == 6144
    assert f.sink_bytes(4, 128, tail_element_bytes=4) == 12288
    assert base.sink_bytes(4, 128) == 0
    assert PRESETS["int4"].sink_bytes(4, 128) == 2 * 4 * 1 * 128 * 2 == 2048  # the preset's default sink=1
    assert f.block_bytes(4, 128) == base.block_bytes(4, 128)  # per block: unchanged
    assert f.bits_per_element(4, 128) == base.bits_per_element(4, 128)
    # 100 tokens at block 64: one sealed block, the tail, the sink; per sequence even when shorter than S
    for tokens in (0, 1, 100, 1000):
        want = (tokens // 64) * base.block_bytes(4, 128) + base.tail_bytes(4, 128) + 6144
        assert f.bytes_for_tokens(tokens, 4, 128) == want
    assert f.bytes_for_tokens(100, 4, 128, layers=3) == 3 * f.bytes_for_tokens(100, 4, 128)


def test_size_shows_the_sink_bytes():
    from kvpack.cli.size_cmd import render
    from kvpack.modelspecs import ModelShape

    m = ModelShape("toy", layers=4, kv_heads=2, head_dim=64)
    p = estimate(m, 1000, 2, [parse_format("int4,sink=0"), parse_format("int4,sink=2")])
    plain, sink = p.rows
    assert sink.bytes_per_sequence - plain.bytes_per_sequence == 4 * 2 * 2 * 2 * 64 * 2 == sink.sink_bytes_per_sequence
    assert sink.as_dict()["sink_bytes_per_sequence"] == 4096 and "sink" not in plain.as_dict()
    text = render(p)
    assert "sink: int4,sink=2 also keep each sequence's first 2 positions (the attention sink) in fp16, 4,096 " in text
    assert "int4,sink=0" not in text.split("sink:")[1]
    p = estimate(m, 1000, 2, [parse_format("int4"), parse_format("int8"), parse_format("fp16")])
    lines = [ln for ln in render(p).splitlines() if ln.startswith("sink:")]
    assert lines == [
        "sink: int4, int8 also keep each sequence's first position (the attention sink) in fp16, "
        f"{4 * 2 * 2 * 1 * 64 * 2:,} bytes per sequence (all layers; in the cache column)."
    ]


# -- the cache ------------------------------------------------------------------------------------------
def _keys(n: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, H, n, D]`` realistic keys with a huge-norm first token (the sink), and values."""
    g = torch.Generator().manual_seed(seed)
    k = realistic_keys(batch, H, n, D, generator=g)
    k[:, :, 0] *= 40
    v = torch.randn(batch, H, n, D, generator=g)
    v[:, :, 0] *= 10
    return k, v


def _oracle(spec, x: torch.Tensor, sink: int) -> torch.Tensor:
    """``[H, n, D]`` history of blocks of ``B`` tokens: full blocks through the primitives, the first
    ``min(sink, sealed)`` rows and the tail exact."""
    n = x.shape[1]
    nb = n // B
    blocks = x[:, : nb * B].reshape(H, nb, B, D).transpose(0, 1)
    rec = dequantize(quantize(blocks, spec)).transpose(0, 1).reshape(H, nb * B, D)
    out = torch.cat([rec, x[:, nb * B :]], dim=1)
    s = min(sink, nb * B)
    out[:, :s] = x[:, :s]
    return out


@pytest.mark.parametrize("fmt_text", ["int4,block=8,sink=3", "kivi2,block=8,sink=8", "fp8-o4,block=8,sink=1"])
def test_sink_rows_exact_after_appends_across_blocks(fmt_text):
    fmt = parse_format(fmt_text)
    cache = PagedKVCache(fmt, 2, H, D, 32)
    a, b = cache.add_sequence(), cache.add_sequence()
    k, v = _keys(30, 0, batch=2)
    # two sequences out of step: row 0 runs ahead by 2 tokens, then both grow in chunks and single tokens
    for layer in range(2):
        cache.append(layer, [a], k[:1, :, :2], v[:1, :, :2])
    done = {a: 2, b: 0}
    for t in (1, 2, 5, 1, 9, 1):
        for layer in range(2):
            ks = torch.stack([k[i, :, done[s] : done[s] + t] for i, s in enumerate((a, b))])
            vs = torch.stack([v[i, :, done[s] : done[s] + t] for i, s in enumerate((a, b))])
            cache.append(layer, [a, b], ks, vs)
        done = {s: n + t for s, n in done.items()}
    view = cache.view(1, [a, b])
    assert view.sink == fmt.sink and view.sink_k.shape == (2, H, fmt.sink, D)
    for i, s in enumerate((a, b)):
        n = done[s]
        assert_bitexact(view.sink_k[i], k[i, :, : fmt.sink], "sink keys")
        assert_bitexact(view.sink_v[i], v[i, :, : fmt.sink], "sink values")
        dk, dv = cache.dense(1, s)
        if fmt.key.has_outliers:  # the per-block outlier seal: check the sink rows and the rest separately
            assert_bitexact(dk[:, : fmt.sink], k[i, :, : fmt.sink])
            assert not torch.equal(dk[:, fmt.sink : n // B * B], k[i, :, fmt.sink : n // B * B])
        else:
            assert_bitexact(dk, _oracle(fmt.key, k[i, :, :n], fmt.sink), "keys")
            assert_bitexact(dv, _oracle(fmt.value, v[i, :, :n], fmt.sink), "values")
        # block 0 itself is sealed as without a sink: the same bytes as a cache of the plain format
    plain = PagedKVCache(dataclasses.replace(fmt, sink=0, name=""), 2, H, D, 32)
    pa = plain.add_sequence()
    plain.append(0, [pa], k[:1, :, :8], v[:1, :, :8])
    blk = cache.view(0, [a]).block_tables[0, 0]
    assert_bitexact(cache.storage.k_data[0, blk], plain.storage.k_data[0, 1], "block 0 payload")


def test_rotated_keys_sink_is_stored_rotated_and_read_natural():
    fmt = parse_format("fp8,block=8,sink=2")
    cache = PagedKVCache(fmt, 1, H, D, 8)
    s = cache.add_sequence()
    k, v = _keys(12, 1)
    cache.append(0, [s], k, v)
    kv = cache.view(0, [s])
    assert_bitexact(kv.sink_k[0], rotate(k, cache.key_rotation)[0, :, :2], "sink stores k @ R")
    dk, _ = cache.dense(0, s)
    assert_close(dk[:, :2], k[0, :, :2], atol=1e-3, rtol=1e-5)
    assert (dk[:, 2:8] - k[0, :, 2:8]).abs().max() > 1e-2  # the other rows are fp8 reconstructions


def _filled(fmt_text="int4,block=8,sink=2", n=21, layers=2, blocks=40):
    fmt = parse_format(fmt_text)
    cache = PagedKVCache(fmt, layers, H, D, blocks, max_seqs=2)
    sid = cache.add_sequence()
    k, v = _keys(n, 2)
    for layer in range(layers):
        cache.append(layer, [sid], k + layer, v - layer)
    return cache, sid, k, v


def _history(cache, sid):
    return [cache.dense(layer, sid) for layer in range(cache.num_layers)]


def _same(h1, h2):
    for (k1, v1), (k2, v2) in zip(h1, h2, strict=True):
        assert_bitexact(k1, k2)
        assert_bitexact(v1, v2)


def test_fork_reorder_offload_restore_keep_the_sink():
    cache, a, k, v = _filled()
    before = _history(cache, a)
    b = cache.fork(a)
    _same(_history(cache, b), before)
    # the fork diverges (its own tail) but keeps the sink rows; the slots grew (max_seqs=2) on the way
    c = cache.fork(b)
    for layer in range(2):
        cache.append(layer, [b], k[:, :, :1] * 0 + 7, v[:, :, :1])
    assert_bitexact(cache.view(0, [b]).sink_k[0], k[0, :, :2])
    _same(_history(cache, c), before)
    # reorder (beam search): row 0 takes row 1's contents
    cache.reorder([a, b], [1, 1])
    assert_bitexact(cache.dense(0, a)[0], cache.dense(0, b)[0])
    assert cache.dense(0, a)[0].shape[1] == 22
    # offload / restore: bit-identical history, new block ids
    ref = _history(cache, c)
    cache.offload(c)
    with pytest.raises(SequenceError):
        cache.view(0, [c])
    cache.restore(c)
    _same(_history(cache, c), ref)
    assert cache.problems() == []


def test_crop_below_and_inside_the_sink():
    cache, a, k, v = _filled()
    # inside sealed block 0, past the sink: the kept sink rows return to the tail exactly, the rest dequantized
    cache.crop(a, 5)
    dk, dv = cache.dense(0, a)
    assert_bitexact(dk[:, :2], k[0, :, :2])
    assert_bitexact(dv[:, :2], v[0, :, :2])
    assert_bitexact(dk[:, 2:5], _oracle(cache.format.key, k[0, :, :8], 0)[:, 2:5])
    # grow again: block 0 reseals, the sink rows still exact
    for layer in range(2):
        cache.append(layer, [a], k[:, :, 5:12] + layer, v[:, :, 5:12] - layer)
    dk, _ = cache.dense(0, a)
    assert_bitexact(dk[:, :2], k[0, :, :2])
    # below the sink: the cropped positions are rewritten by the next append
    cache.crop(a, 1)
    new_k, new_v = _keys(10, 9)
    for layer in range(2):
        cache.append(layer, [a], new_k[:, :, 1:10] + layer, new_v[:, :, 1:10] - layer)
    kv = cache.view(1, [a])
    assert_bitexact(kv.sink_k[0, :, 0], k[0, :, 0] + 1)  # kept
    assert_bitexact(kv.sink_k[0, :, 1], new_k[0, :, 1] + 1)  # rewritten
    assert_bitexact(cache.dense(1, a)[1][:, 1], new_v[0, :, 1] - 1)
    assert cache.problems() == []


def test_prefix_sharing_hands_over_the_sink_rows():
    fmt = parse_format("int4,block=8,sink=2")
    cache = PagedKVCache(fmt, 2, H, D, 12)
    tokens = list(range(20))
    a = cache.add_sequence(tokens)
    k, v = _keys(20, 3)
    for layer in range(2):
        cache.append(layer, [a], k, v)
    want = _history(cache, a)
    cache.free(a)  # the blocks stay cached, so do their sink rows
    b = cache.add_sequence(tokens)
    assert cache.cached_prefix_len(b) == 16
    got = _history(cache, b)
    for (k1, v1), (k2, v2) in zip(got, want):
        assert_bitexact(k1, k2[:, :16])
        assert_bitexact(v1, v2[:, :16])
    assert_bitexact(got[0][0][:, :2], k[0, :, :2])
    # once the first block is evicted its kept sink rows go too
    cache.free(b)
    while cache.pool.num_cached:
        cache.pool.allocate()
    assert cache.prefix_sinks.get(1) is None and cache.prefix_sinks.nbytes() == 0


@pytest.mark.parametrize("tail", [torch.float32, torch.float16])
def test_memory_report_equals_the_formula(tail):
    fmt = parse_format("k4v2,block=8,sink=3")
    L = 2
    cache = PagedKVCache(fmt, L, H, D, 30, tail_dtype=tail, max_seqs=2)
    lens = {}
    for n, toks in ((19, list(range(19))), (2, None), (40, list(range(19)) + [50] * 21)):
        sid = cache.add_sequence(toks)
        start = cache.cached_prefix_len(sid)
        k, v = _keys(n, n)
        for layer in range(L):
            cache.append(layer, [sid], k[:, :, start:], v[:, :, start:])
        lens[sid] = n
    fork = cache.fork(0)
    lens[fork] = 19
    cache.offload(2)
    rep = cache.memory_report()
    t = rep.total
    elem = torch.tensor([], dtype=tail).element_size()
    per_seq = sum(fmt.bytes_for_tokens(n, H, D, layers=L, tail_element_bytes=elem) for n in lens.values())
    assert t.theoretical_bytes == per_seq
    assert t.sink_bytes == len(lens) * L * fmt.sink_bytes(H, D, elem) == len(lens) * L * 2 * H * 3 * D * elem
    assert t.used_bytes + t.host_bytes == per_seq - t.shared_bytes
    allocated = sum(p.numel() * p.element_size() for p in cache.storage.pools().values())
    allocated += 2 * cache.slots.tail_k.numel() * elem + 2 * cache.slots.sink_k.numel() * elem
    allocated += cache.prefix_sinks.nbytes()  # the sink rows kept for the registered first block
    assert cache.prefix_sinks.nbytes() == L * 2 * H * 3 * D * elem
    assert t.allocated_bytes == allocated
    assert f"sinks {t.sink_bytes:,} bytes" in str(rep)
    assert cache.problems() == []


# -- the reference kernel ---------------------------------------------------------------------------------
def _sdpa(q, k, v, lo, window=None, start=0):
    """Attention of queries ``q`` ``[T, Hq, D]`` at positions ``lo..`` over ``[H, n, D]`` history (GQA)."""
    t, hq, d = q.shape
    g = hq // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = (q.transpose(0, 1).double() @ k.transpose(1, 2).double()) / math.sqrt(d)
    mask = reference.attention_mask(k.shape[1], lo, lo + t, window, start, q.device)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v.double()).transpose(0, 1).float()


def test_reference_decode_reads_the_sink_on_a_planted_sink():
    fmt = parse_format("int4,block=8,sink=1")
    cache = PagedKVCache(fmt, 1, H, D, 8)
    sid = cache.add_sequence()
    k, v = _keys(21, 4)
    cache.append(0, [sid], k, v)
    kv = cache.view(0, [sid])
    g = torch.Generator().manual_seed(5)
    q = k[0, :, 0].repeat_interleave(2, 0).unsqueeze(0) / 40 + torch.randn(1, 2 * H, D, generator=g)  # [1, Hq, D]
    out = reference.decode_attention(q, kv)
    want = _sdpa(q, _oracle(fmt.key, k[0], 1), _oracle(fmt.value, v[0], 1), 20)
    assert_close(out[0], want[0], atol=1e-4, rtol=1e-4)
    no_sink = reference.decode_attention(q, dataclasses.replace(kv, sink_k=None, sink_v=None))
    assert (out - no_sink).abs().max() > 1e-2  # the sink really changes what is read
    assert_close(
        no_sink[0], _sdpa(q, _oracle(fmt.key, k[0], 0), _oracle(fmt.value, v[0], 0), 20)[0], atol=1e-4, rtol=1e-4
    )
    # the dispatcher runs the reference on a view with a sink (its capabilities say sink=True)
    from kvpack import kernels

    assert_close(kernels.decode_attention(q, kv, backend="reference"), out, atol=0, rtol=0)


@pytest.mark.parametrize("window", [None, 14])  # 14: the first queries still see the sink, the last do not
def test_reference_chunked_prefill_reads_the_sink(window):
    fmt = parse_format("k4v2,block=8,sink=2")
    cache = PagedKVCache(fmt, 1, H, D, 8)
    sid = cache.add_sequence()
    k, v = _keys(26, 6)
    cache.append(0, [sid], k[:, :, :11], v[:, :, :11])
    cache.append(0, [sid], k[:, :, 11:], v[:, :, 11:])  # the chunk of 15 queries
    q = torch.randn(1, 15, 2 * H, D, generator=torch.Generator().manual_seed(7))
    kv = cache.view(0, [sid])
    out = reference.paged_attention_reference(q, kv, window=window)
    want = _sdpa(q[0], _oracle(fmt.key, k[0], 2), _oracle(fmt.value, v[0], 2), 11, window=window)
    assert_close(out[0], want, atol=1e-4, rtol=1e-4)
    no_sink = reference.paged_attention_reference(q, dataclasses.replace(kv, sink_k=None, sink_v=None), window=window)
    assert (out[0, 0] - no_sink[0, 0]).abs().max() > 1e-3
    if window is not None:  # queries whose window starts past the sink read the same either way
        assert_bitexact(out[0, -1], no_sink[0, -1])


@pytest.mark.parametrize("fmt_text", ["int8", "int4-o4", "fp8", "kivi2"])
def test_random_paged_kv_sink_with_window_and_start_pos(fmt_text):
    fmt = PRESETS[fmt_text].with_block_size(16)
    lens = [3, 16, 40, 70]  # no sealed block, exactly one, several
    kv, keys, values = random_paged_kv(fmt, lens, kv_heads=H, head_dim=64, sink=5, seed=3)
    assert kv.sink == 5 and kv.format.sink == 5
    assert torch.isnan(kv.sink_k[0]).all() and not torch.isnan(kv.sink_k[2]).any()  # rows past the sealed ones
    start = torch.tensor([0, 2, 1, 4], dtype=torch.int32)
    kv = dataclasses.replace(kv, start_pos=start)
    q = torch.randn(4, 2, 2 * H, 64, generator=torch.Generator().manual_seed(1))
    for window in (None, 66, 20):
        out = reference.paged_attention_reference(q, kv, window=window)
        assert not torch.isnan(out).any()
        for row, n in enumerate(lens):
            sealed = n // 16 * 16
            # the block rows hold other values: the returned history is the sink, not block 0
            if sealed:
                assert not torch.allclose(
                    reference.dense_history(dataclasses.replace(kv, sink_k=None, sink_v=None), row)[0][:, :5],
                    keys[row][:, :5],
                    atol=0.5,
                )
            hk, hv = reference.dense_history(kv, row)
            assert_close(hk[:, : min(5, sealed)], keys[row][:, : min(5, sealed)], atol=1e-3, rtol=1e-5)
            assert_bitexact(hv[:, : min(5, sealed)], values[row][:, : min(5, sealed)])
            want = _sdpa(q[row], hk, hv, n - 2, window, int(start[row]))
            assert_close(out[row], want, atol=1e-4, rtol=1e-4)


# -- the simulate engine and the transformers integration -------------------------------------------------
def test_simulate_engine_equals_the_kvpack_cache_history():
    from kvpack.evaluation.simulate import SimulatedCache

    fmt = parse_format("int4,block=8,sink=3")
    sim = SimulatedCache([fmt]).layers[0]
    cache = PagedKVCache(fmt, 1, H, D, 8)
    sid = cache.add_sequence()
    k, v = _keys(30, 8)
    done = 0
    for t in (2, 1, 9, 1, 1, 13):
        ks, vs = sim.update(k[:, :, done : done + t], v[:, :, done : done + t])
        cache.append(0, [sid], k[:, :, done : done + t], v[:, :, done : done + t])
        done += t
        dk, dv = cache.dense(0, sid)
        assert_bitexact(ks[0], dk, f"keys after {done}")
        assert_bitexact(vs[0], dv, f"values after {done}")
    assert_bitexact(ks[0, :, :3], k[0, :, :3])
    sim.crop(-22)  # 27 -> 5 tokens, back inside block 0: kept sink rows stay exact in both
    cache.crop(sid, 5)
    ks, vs = sim.update(k[:, :, 5:12], v[:, :, 5:12])
    cache.append(0, [sid], k[:, :, 5:12], v[:, :, 5:12])
    assert_bitexact(ks[0], cache.dense(0, sid)[0])
    assert_bitexact(vs[0], cache.dense(0, sid)[1])


def test_hf_cache_for_with_a_sink_generates_and_stores_the_first_token(monkeypatch):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import kvpack.hf
    from kvpack.integrations import hf_attention as hfa

    # the exact chunk path: position 0 attends only its own (sink) row, so layer 1's first key is bit-exact only
    # when that row's value is not rounded (the fused chunk kernel rounds values to bf16)
    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dyn = DynamicCache()
        # the keys and values the model computes for the prompt (sdpa, before cache_for)
        model(ids, **{kvpack.hf.cache_kwarg(model): dyn})
        cache = kvpack.hf.cache_for(model, format="int4,sink=1", max_tokens=128)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            **{kvpack.hf.cache_kwarg(model): cache},
        )
    assert out.shape == (1, 76) and cache.paged.format.sink == 1
    for layer in range(2):
        kv = cache.view(layer)
        assert_bitexact(kv.sink_k[0], dyn.layers[layer].keys[0, :, :1], f"layer {layer} sink keys")
        assert_bitexact(kv.sink_v[0], dyn.layers[layer].values[0, :, :1], f"layer {layer} sink values")
    t = cache.memory_report().total
    assert t.sink_bytes == 2 * cache.paged.format.sink_bytes(2, 32, tail_element_bytes=4)
    assert sum(cache.decode_backends.values()) == 2 * 5


def test_static_calibration_and_export_work_with_a_sink(tmp_path):
    from kvpack.calibration import Artifact, KVObserver, fingerprint_from_config, load_artifact
    from kvpack.integrations.export import export_vllm, vllm_reasons_unsupported

    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": H,
        "hidden_size": 4 * D,
        "head_dim": D,
        "vocab_size": 50,
        "rope_theta": 10000.0,
    }
    fmt = parse_format("int8,block=8,sink=1@static")
    assert fmt.sink == 1 and fmt.key.static
    obs = KVObserver((99.9,))
    data = [_keys(24, 20 + i) for i in range(2)]
    for i, (k, v) in enumerate(data):
        obs.observe(i, k, v)
    art = Artifact.build(*obs.stats(), fmt, fingerprint_from_config(config), {"name": "test"}, "absmax")
    art.save(tmp_path / "art")
    loaded = load_artifact(tmp_path / "art", format=fmt)
    assert loaded.format.sink == 1
    cache = PagedKVCache(fmt, 2, H, D, 8, calibration=loaded.scales_for(fmt))
    sid = cache.add_sequence()
    for layer, (k, v) in enumerate(data):
        cache.append(layer, [sid], k, v)
    dk, _ = cache.dense(0, sid)
    assert_bitexact(dk[:, :1], data[0][0][0, :, :1])
    assert (dk[:, 1:16] - data[0][0][0, :, 1:16]).abs().max() > 0  # the rest went through the static int8 seal
    assert any("sink=1" in r for r in vllm_reasons_unsupported(fmt))
    summary = export_vllm(tmp_path / "art", tmp_path / "out")
    assert summary["layers"] == 2 and any("sink" in r for r in summary["reasons"])
