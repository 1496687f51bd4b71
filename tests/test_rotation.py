"""Rotated keys (``rot``): the format rules, the rotation itself, and every path that reads the cache."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import FormatError, ShapeError, UnsupportedError
from kvpack.evaluation.simulate import roundtrip_blocks
from kvpack.formats import parse_format
from kvpack.integrations.hf_attention import chunk_attention
from kvpack.kernels import PagedKV, decode_attention, reference
from kvpack.rotation import key_rotation, rotate, unrotate
from kvpack.testing import CPU_CHUNK_TOL, assert_close, cpu_kernel_tolerance, random_paged_kv, realistic_keys


def test_preset_syntax_and_rules():
    fmt = parse_format("fp8")
    assert fmt.key.rotate and not fmt.value.rotate
    assert parse_format(fmt.spec_string()).name == "fp8"
    assert parse_format("k=fp8:channel:asym:rot,v=fp8:head,sink=1") == fmt  # the preset keeps sink=1
    assert parse_format("k=fp8:channel:asym:rot,v=fp8:head") == fmt.with_sink(0)
    # rotation costs no bytes (the preset's extra bytes are its keys' per-channel scales and midpoints)
    kw = {"kv_heads": 8, "head_dim": 128}
    assert parse_format("k=fp8:head:rot,v=fp8:head").block_bytes(**kw) == parse_format("fp8-plain").block_bytes(**kw)
    for text, needle in [
        ("k=fp8:head,v=fp8:head:rot", "keys only"),
        ("k=fp8:head:rot:static,v=fp8:head", "'static'"),
        ("k=int4:channel:asym:o4:rot,v=int4:g32:asym", "'o4'"),
        ("k=fp16:rot,v=fp16", "stored as is"),
        ("k=fp8:head:rot:rot,v=fp8:head", "twice"),
    ]:
        with pytest.raises(FormatError, match=needle):
            parse_format(text)
    fmt.check(96)  # head_dims that are not powers of two rotate block by block (below)
    # '@static' makes both plain and static: calibrated ranges are of keys as they come (what engines store)
    st = parse_format("fp8@static")
    assert st == parse_format("fp8-plain@static") and not st.key.rotate and st.key.static and st.value.static


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_rotation_is_a_fixed_signed_hadamard(d):
    r = key_rotation(d)
    assert r.dtype == torch.float32 and r.shape == (d, d)
    assert_close(r @ r.T, torch.eye(d), 1e-6, 0)
    assert torch.equal(r.abs(), torch.full((d, d), 1 / math.sqrt(d)))  # every channel mixed into every other
    assert torch.equal(key_rotation(d), r)  # a pure function of head_dim
    x = torch.randn(3, d, dtype=torch.float64)
    assert_close(unrotate(rotate(x, r), r), x, 1e-5, 0)  # float32 arithmetic
    with pytest.raises(ShapeError):
        key_rotation(0)


@pytest.mark.parametrize(("d", "blocks"), [(96, [64, 32]), (80, [64, 16]), (112, [64, 32, 16])])
def test_other_head_dims_rotate_by_hadamard_blocks(d, blocks):
    r = key_rotation(d)
    assert_close(r @ r.T, torch.eye(d), 1e-6, 0)
    lo = 0
    for n in blocks:  # each block a signed Hadamard of its size, nothing outside the blocks
        blk = r[lo : lo + n, lo : lo + n]
        assert torch.equal(blk.abs(), torch.full((n, n), 1 / math.sqrt(n)))
        assert not r[lo : lo + n, :lo].any() and not r[lo : lo + n, lo + n :].any()
        lo += n
    q, k = torch.randn(4, d), torch.randn(7, d)
    assert_close(rotate(q, r) @ rotate(k, r).T, q @ k.T, 1e-4, 1e-5)  # scores unchanged


def test_rotation_spreads_outlier_channels():
    g = torch.Generator().manual_seed(0)
    k = realistic_keys(1, 256, 64, outlier_scale=12.0, generator=g)[0]  # [T, D], 4 big channels
    peak = lambda x: float((x.abs().amax(0) / x.abs().amax(0).median()).max())  # noqa: E731
    assert peak(k) > 8 and peak(rotate(k, key_rotation(64))) < 3


def _scores_error(name: str, q: torch.Tensor, k: torch.Tensor) -> float:
    spec = parse_format(name).key
    rec = roundtrip_blocks(k.unsqueeze(0), spec, 64)[0]  # [H, T, D]
    exact, got = q @ k.transpose(-1, -2), q @ rec.transpose(-1, -2)
    return float((got - exact).norm() / exact.norm())


def test_rotated_fp8_keys_give_more_accurate_scores():
    # queries and keys are large on the same few channels (RoPE's slow pairs), so those channels carry
    # most of each score and, unrotated, most of its fp8 error (relative, up to 6% per element)
    g = torch.Generator().manual_seed(3)
    k, q = torch.randn(2, 256, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    idx = torch.randperm(64, generator=g)[:4]
    k[..., idx] = k[..., idx] * 12 + 6
    q[..., idx] *= 4
    plain, rotated = _scores_error("fp8-plain", q, k), _scores_error("fp8", q, k)
    assert rotated < 0.5 * plain, (plain, rotated)  # measured: 0.026 -> 0.010


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention of one decode query ``[Hq, D]`` over ``[H, n, D]`` keys and values (GQA)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    w = torch.softmax((q.unsqueeze(1) @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
    return (w @ v).squeeze(1)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_backends_read_rotated_keys(backend):
    # without a sink (the data the bound below was measured on): every sealed row is a dequantized fp8 row
    fmt = parse_format("fp8,block=16,sink=0")
    kv, keys, values = random_paged_kv(fmt, [1, 15, 17, 50], kv_heads=2, head_dim=64, seed=5)
    assert kv.key_rotation is not None and kv.sink_k is None
    q = torch.randn(4, 8, 64, dtype=torch.float16 if backend == "triton" else torch.float32)
    expected = reference.decode_attention(q.float(), kv)
    # the reference reads natural keys: close to attention over the full-precision keys, up to fp8's error
    # (these random scores are peaky: unrotated fp8 is 0.14 off at worst, rotated 0.12; unrotating
    # nothing would give attention over unrelated keys, off by several units)
    exact = torch.stack([_attend(q[i].float(), keys[i], values[i]) for i in range(4)])
    assert float((expected - exact).abs().max()) < 0.2
    _check_backend(backend, q, kv, expected)
    # the preset's default sink=1: position 0 of a sequence with a sealed block is the exact (rotated) sink row,
    # read back natural; the other sealed rows are what a reader ignoring the sink reads (checked above)
    fmt = parse_format("fp8,block=16")
    assert fmt.sink == 1
    kv, keys, values = random_paged_kv(fmt, [1, 15, 17, 50], kv_heads=2, head_dim=64, seed=5)
    assert kv.key_rotation is not None and kv.sink == 1
    expected = reference.decode_attention(q.float(), kv)
    blocks_only = PagedKV(**{**kv.__dict__, "sink_k": None, "sink_v": None})
    hist = []
    for i, n in enumerate([1, 15, 17, 50]):
        k, v = reference.dense_history(blocks_only, i)
        if n >= 16:  # a sealed block: the sink row replaces position 0
            k[:, 0], v[:, 0] = keys[i][:, 0], values[i][:, 0]
        hist.append(_attend(q[i].float(), k, v))
    assert_close(expected, torch.stack(hist), 1e-5, 1e-5)
    assert (expected[2:] - reference.decode_attention(q.float(), blocks_only)[2:]).abs().max() > 1e-3  # it matters
    _check_backend(backend, q, kv, expected)


def _check_backend(backend: str, q: torch.Tensor, kv, expected: torch.Tensor) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        from _triton_interpreter import fixed_interpreter

        with fixed_interpreter():
            got = decode_attention(q, kv, backend="triton")
        assert_close(got.float(), expected, 5e-3, 5e-3)
        from kvpack.kernels import triton_decode

        with pytest.raises(UnsupportedError, match="rotated"):
            triton_decode.decode_attention(q, kv)  # a direct call must not read rotated keys with q
    else:
        got = decode_attention(q, kv, backend=backend)
        # reference: the same arithmetic; cpu: the bound of the path it takes here (fp8 codes: integer path on
        # AVX-512 BW, rounded to 12 bits; float path elsewhere)
        assert_close(
            got, expected, *((2e-5, 1e-4) if backend == "reference" else cpu_kernel_tolerance(kv, (2e-5, 1e-4)))
        )
        if backend == "cpu":
            from kvpack.kernels import cpu_decode

            with pytest.raises(UnsupportedError, match="rotated"):
                cpu_decode.decode_attention(q, kv)


def test_cache_stores_rotated_keys_and_gives_back_natural_ones():
    g = torch.Generator().manual_seed(1)
    k = realistic_keys(2, 150, 64, generator=g).unsqueeze(0)
    v = torch.randn(1, 2, 150, 64, generator=g)
    cache = PagedKVCache("fp8", num_layers=1, kv_heads=2, head_dim=64, num_blocks=16)
    sid = cache.add_sequence()
    cache.append(0, [sid], k[:, :, :100], v[:, :, :100])  # a prefill chunk, then decode steps
    for t in range(100, 150):
        cache.append(0, [sid], k[:, :, t : t + 1], v[:, :, t : t + 1])
    r = key_rotation(64)
    view = cache.view(0, [sid])
    assert torch.equal(view.key_rotation, r)
    assert_close(view.tail_k[0, :, :22], rotate(k[0, :, 128:], r), 1e-5, 1e-5)  # the tail holds k @ R
    dk, dv = cache.dense(0, sid)
    assert_close(dv[:, 128:], v[0, :, 128:], 0, 0)  # values are never rotated
    assert_close(dk[:, 128:], k[0, :, 128:], 1e-5, 1e-5)  # natural keys back, the tail exactly
    # sealed blocks: the simulate engine's reconstruction (quantize k @ R, dequantize, @ R.T)
    sim = roundtrip_blocks(k[:, :, :128], parse_format("fp8").key, 64)[0]
    # except position 0, the preset's sink=1: kept exactly (stored rotated like the tail, read back natural)
    assert cache.sink == 1
    sim[:, :1] = k[0, :, :1]
    assert_close(dk[:, :128], sim, 1e-5, 1e-5)
    # a crop inside a sealed block returns its kept tokens to the (rotated) tail: nothing moves
    cache.crop(sid, 70)
    dk2, _ = cache.dense(0, sid)
    assert_close(dk2, dk[:, :70], 1e-5, 1e-5)
    cache.append(0, [sid], k[:, :, 70:71], v[:, :, 70:71])
    assert_close(cache.dense(0, sid)[0][:, 70], k[0, :, 70], 1e-5, 1e-5)


def test_chunk_attention_reads_natural_keys():
    fmt = parse_format("fp8,block=16")
    kv, _, _ = random_paged_kv(fmt, [40, 77], kv_heads=2, head_dim=64, seed=2)
    q = torch.randn(2, 5, 8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference.paged_attention_reference(q, kv)
    assert_close(chunk_attention(q, kv, backend="reference"), expected, 2e-5, 1e-4)  # dequantize-then-SDPA
    assert_close(chunk_attention(q, kv), expected, *CPU_CHUNK_TOL)  # the fused kernel, with the rotated query


@pytest.mark.parametrize("d", [80, 96])
def test_the_fp8_preset_serves_head_dims_that_are_not_powers_of_two(d):
    g = torch.Generator().manual_seed(3)
    k = realistic_keys(2, 140, d, generator=g).unsqueeze(0)
    v = torch.randn(1, 2, 140, d, generator=g)
    cache = PagedKVCache("fp8", num_layers=1, kv_heads=2, head_dim=d, num_blocks=16)
    sid = cache.add_sequence()
    cache.append(0, [sid], k, v)
    view = cache.view(0, [sid])
    dk, _ = cache.dense(0, sid)
    assert (dk - k[0]).abs().max() < 0.1 * k.abs().max()  # natural keys back, within e4m3's error
    q = torch.randn(1, 4, d, generator=g)
    expected = decode_attention(q, view, backend="reference")
    assert_close(decode_attention(q, view, backend="cpu"), expected, *cpu_kernel_tolerance(view, (2e-5, 1e-4)))
