"""Calibrated (static) scales in the paged cache: fail closed, exact bytes, clipping counted, prefix keys salted."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.cache.prefix import chain_keys
from kvpack.calibration import (
    Artifact,
    CalibratedScales,
    CalibrationDriftWarning,
    KVObserver,
    StaticScales,
    load_artifact,
    seal_with_static,
    static_scales,
)
from kvpack.errors import CalibrationError, NonFiniteError
from kvpack.formats import parse_format
from kvpack.quant import encode_scale, quantize
from kvpack.testing import assert_bitexact

L, H, D, B = 2, 2, 32, 16
KEY_STATIC = f"k=int8:channel:static,v=int8:token,block={B}"
BOTH_STATIC = f"k=int4:channel:asym:static,v=fp8:tensor:static:fp32,block={B}"
KEY_LIMIT = 127 * 2.0**-7  # int8 key scale 2**-7 (exact in fp16): the calibrated range is [-KEY_LIMIT, KEY_LIMIT]


def _key_scales(fmt, value: float = 2.0**-7) -> CalibratedScales:
    """Hand-built per-channel key scales ``[L, H, 1, D]``, one value everywhere."""
    spec = fmt.key
    scale = encode_scale(torch.full((L, H, 1, D), value), spec.scale_dtype)
    return CalibratedScales(fmt, StaticScales("key", spec, scale, None, "absmax"), None)


def _observed_scales(fmt, seed: int = 0) -> CalibratedScales:
    """Scales of both roles from a small synthetic calibration run."""
    g = torch.Generator().manual_seed(seed)
    obs = KVObserver((99.0,))
    for layer in range(L):
        obs.observe(layer, torch.randn(4, H, 64, D, generator=g), torch.randn(4, H, 64, D, generator=g))
    keys, values = obs.stats()
    return CalibratedScales(fmt, static_scales(keys, fmt.key, "key"), static_scales(values, fmt.value, "value"))


def _cache(fmt, calibration, **kw) -> PagedKVCache:
    return PagedKVCache(fmt, L, H, D, num_blocks=32, calibration=calibration, **kw)


def _fill(cache, seqs, k, v, chunks):
    """Append ``k``/``v`` ``[batch, H, T, D]`` to every layer in chunks of the given sizes."""
    t0 = 0
    for t in chunks:
        for layer in range(L):
            cache.append(layer, seqs, k[:, :, t0 : t0 + t], v[:, :, t0 : t0 + t])
        t0 += t


def test_static_format_without_calibration_is_refused_at_construction():
    fmt = parse_format(KEY_STATIC)
    with pytest.raises(CalibrationError, match="keys"):
        PagedKVCache(fmt, L, H, D, num_blocks=8)
    with pytest.raises(CalibrationError, match="would be ignored"):  # scales for a format that takes none
        PagedKVCache("int8", L, H, D, num_blocks=8, calibration=_key_scales(fmt))
    cal = _observed_scales(parse_format(BOTH_STATIC))
    with pytest.raises(CalibrationError, match="values"):  # value scales carried for non-static values
        _cache(fmt, CalibratedScales(fmt, _key_scales(fmt).key, cal.value))
    with pytest.raises(CalibrationError, match="int4"):  # scales made for another spec
        _cache(fmt, CalibratedScales(fmt, cal.key, None))
    with pytest.raises(CalibrationError, match="calibration carries none"):
        _cache(fmt, CalibratedScales(fmt, None, None))


def test_scale_shape_is_checked_against_the_cache_geometry():
    fmt = parse_format(KEY_STATIC)
    good = _key_scales(fmt).key
    for bad in (good.scale[:1], good.scale[:, :1], good.scale[..., :16]):
        with pytest.raises(CalibrationError, match=rf"\({L}, {H}, 1, {D}\)"):
            _cache(fmt, CalibratedScales(fmt, StaticScales("key", good.spec, bad, None, "absmax"), None))
    both = parse_format(BOTH_STATIC)
    cal = _observed_scales(both)
    short = StaticScales("value", cal.value.spec, cal.value.scale[:1], None, "absmax")
    with pytest.raises(CalibrationError, match=rf"\({L}, 1, 1, 1\)"):  # per-tensor values: [L, 1, 1, 1]
        _cache(both, CalibratedScales(both, cal.key, short))


@pytest.mark.parametrize("text", [KEY_STATIC, BOTH_STATIC])
@pytest.mark.parametrize("seal_backend", ["auto", "triton"])  # triton falls back to torch for static specs
def test_sealed_bytes_equal_seal_with_static(text, seal_backend):
    fmt = parse_format(text)
    cal = _key_scales(fmt) if text == KEY_STATIC else _observed_scales(fmt, seed=1)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, H, 2 * B + 5, D, generator=g), torch.randn(2, H, 2 * B + 5, D, generator=g)
    k[0, 1, 3, 7] = 9.0  # one value beyond any calibrated range: clipped, and the bytes still match
    kw = {"seal_backend": seal_backend, "clip_threshold": 1.0}  # random data clips a lot: no drift warning here
    whole, steps = _cache(fmt, cal, **kw), _cache(fmt, cal, **kw)
    a = [whole.add_sequence(), whole.add_sequence()]
    _fill(whole, a, k, v, [k.shape[2]])
    c = [steps.add_sequence(), steps.add_sequence()]
    _fill(steps, c, k, v, [1] * k.shape[2])
    for layer in range(L):
        clipped = 0
        for cache, seqs in ((whole, a), (steps, c)):
            view = cache.view(layer, seqs)
            ids = view.block_tables[:, :2].reshape(-1).long()  # row 0 blocks 0, 1, row 1 blocks 0, 1
            for role, x, spec, sc in (("k", k, fmt.key, cal.key), ("v", v, fmt.value, cal.value)):
                blocks = x[:, :, : 2 * B].reshape(2, H, 2, B, D).transpose(1, 2).reshape(4, H, B, D)
                if spec.static:
                    want, n = seal_with_static(blocks, spec, sc.layer(layer))
                    clipped += n
                else:
                    want = quantize(blocks, spec)
                assert_bitexact(getattr(view, f"{role}_data")[ids], want.data)
                assert_bitexact(getattr(view, f"{role}_scale")[ids], want.scale)
                if want.zero is not None:
                    assert_bitexact(getattr(view, f"{role}_zero")[ids], want.zero)
        assert cache.problems() == []
        assert clipped >= 2  # the 9.0, counted once per cache
        for cache in (whole, steps):  # the tails (5 tokens per row) are not sealed, so not counted
            assert cache.clip_monitor.clipped[layer] == clipped // 2


def test_values_beyond_the_range_are_clipped_counted_and_warned():
    fmt = parse_format(KEY_STATIC)
    cache = _cache(fmt, _key_scales(fmt), clip_threshold=0.001)
    g = torch.Generator().manual_seed(3)
    k = (torch.rand(1, H, B + 4, D, generator=g) * 1.8 - 0.9).round(decimals=2)  # inside [-KEY_LIMIT, KEY_LIMIT]
    v = torch.randn(1, H, B + 4, D, generator=g) * 50  # values are per-token (block-local): never clipped
    k[0, 0, 2, :3] = 4.0  # 3 out of range in the block that seals
    k[0, 1, 15, 5] = -7.0  # 1 more, last token of that block
    k[0, 0, B + 1, 0] = 8.0  # in the tail: not sealed, not counted
    sid = cache.add_sequence()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.append(0, [sid], k, v)  # layer 0: 4 of H * B * D sealed key values clip (> 0.1 %)
        cache.append(1, [sid], k.clamp(-0.9, 0.9), v)  # layer 1: nothing clips
    drift = [w for w in caught if issubclass(w.category, CalibrationDriftWarning)]
    assert len(drift) == 1 and "layer 0" in str(drift[0].message)
    mon = cache.clip_monitor.report()
    assert mon["clipped"] == [4, 0]
    assert mon["sealed"] == [H * B * D, H * B * D]  # key elements only: values are not static
    assert mon["layers_over_threshold"] == [0]
    rep = cache.memory_report()
    assert rep.clipped == mon and rep.as_dict()["clipped"] == mon
    assert "4 of" in str(rep) and "clipped" in str(rep)
    keys, _ = cache.dense(0, sid)  # [H, n, D]: clipped values come back at the edge of the range
    assert keys[0, 2, :3].tolist() == [KEY_LIMIT] * 3 and keys[1, 15, 5].item() == -KEY_LIMIT
    inside = k[0, :, :B].abs() < 1.0
    err = (keys[:, :B] - k[0, :, :B]).abs()[inside]
    assert err.max().item() <= 2.0**-8 + 1e-6  # in range: within half a step
    assert PagedKVCache("int8", L, H, D, num_blocks=4).memory_report().clipped is None


def test_non_finite_keys_are_refused_and_nothing_changes():
    fmt = parse_format(KEY_STATIC)
    cache = _cache(fmt, _key_scales(fmt))
    sid = cache.add_sequence()
    k, v = torch.rand(1, H, B, D) - 0.5, torch.randn(1, H, B, D)
    k[0, 1, 9, 4] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        cache.append(0, [sid], k, v)
    assert e.value.where[0] == {"layer": 0, "sequence": sid, "head": 1, "position": 9}
    assert cache.seq_len(sid) == 0 and cache.pool.num_used == 0 and cache.clip_monitor.report()["sealed"] == [0, 0]


def test_prefix_keys_differ_with_different_scales():
    fmt = parse_format(KEY_STATIC)
    tokens = list(range(100, 100 + 2 * B + 1))
    one, same, other = _key_scales(fmt), _key_scales(fmt), _key_scales(fmt, 2.0**-6)
    caches = [_cache(fmt, cal) for cal in (one, same, other)]
    keys = [chain_keys(tokens, B, c.salt) for c in caches]
    assert keys[0] == keys[1] and keys[0] != keys[2]
    plain = PagedKVCache("int8", L, H, D, num_blocks=8)
    assert chain_keys(tokens, B, plain.salt) != keys[0]
    # the salted keys are what the cache registers: a second prompt reuses the blocks of the same cache only
    cache = caches[0]
    k, v = torch.rand(1, H, len(tokens), D) - 0.5, torch.randn(1, H, len(tokens), D)
    sid = cache.add_sequence(tokens)
    _fill(cache, [sid], k, v, [len(tokens)])
    assert cache.slots.seqs[sid].keys == keys[0]
    assert cache.cached_prefix_len(cache.add_sequence(tokens)) == 2 * B
    assert cache.problems() == []


def test_an_artifact_on_disk_is_accepted(tmp_path):
    fmt = parse_format(BOTH_STATIC)
    g = torch.Generator().manual_seed(4)
    obs = KVObserver((99.0,))
    for layer in range(L):
        obs.observe(layer, torch.randn(2, H, 32, D, generator=g), torch.randn(2, H, 32, D, generator=g))
    fingerprint = {"num_layers": L, "kv_heads": H, "head_dim": D}
    Artifact.build(*obs.stats(), fmt, fingerprint, {"name": "synthetic"}).save(tmp_path)
    art = load_artifact(tmp_path, format=fmt)
    from_artifact = _cache(
        fmt, art, clip_threshold=1.0
    )  # the artifact itself: scales_for(format) is taken by the cache
    from_scales = _cache(fmt, art.scales_for(fmt))
    assert from_artifact.salt == from_scales.salt
    sid = from_artifact.add_sequence()
    k, v = torch.randn(1, H, B, D, generator=g), torch.randn(1, H, B, D, generator=g)
    _fill(from_artifact, [sid], k, v, [B])
    want, _ = seal_with_static(v.reshape(1, H, B, D), fmt.value, art.value_scales.layer(1))
    view = from_artifact.view(1, [sid])
    blk = view.block_tables[0, :1].long()
    assert_bitexact(view.v_data[blk], want.data)
    assert_bitexact(view.v_scale[blk], want.scale)
