"""Static scales at the quant level, fail-closed specs, the drift detector, and outlier channels."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvpack.calibration import (
    CalibrationDriftWarning,
    ClipMonitor,
    KVObserver,
    LayerScales,
    count_clipped,
    require_static_scales,
    seal_time_channels,
    seal_with_static,
    select_outlier_channels,
    static_scales,
)
from kvpack.errors import CalibrationError, FormatError, NonFiniteError, ShapeError
from kvpack.formats import parse_format
from kvpack.outliers import dequantize_outliers, quantize_outliers
from kvpack.quant import choose_qparams, decode_scale, dequantize, quantize
from kvpack.testing import assert_bitexact, realistic_keys, snr_db

H, B, D = 2, 16, 64


def _key_spec(text):
    return parse_format(f"k={text},v=fp16").key


def _stats_of(x):
    """Statistics of one block [H, B, D] as a one-layer RoleStats."""
    obs = KVObserver((99.0,))
    obs.observe(0, x.unsqueeze(0), x.unsqueeze(0))
    return obs.stats()[0]


SPECS = [
    "int8:channel",
    "int8:channel:e8m0",
    "int4:channel:asym",
    "int2:channel:asym:bf16",
    "fp8:head",
    "fp8:tensor:fp32",
    "e5m2:channel",
]


@pytest.mark.parametrize("text", SPECS)
def test_static_scales_from_a_blocks_own_range_are_block_local_bit_for_bit(text):
    x = realistic_keys(H, B, D, generator=torch.Generator().manual_seed(3))
    spec = _key_spec(text)
    st = static_scales(_stats_of(x), spec, "key", "absmax")
    assert st.scale.shape == (1, *spec.scale_shape(H, 1, D))
    scale, zero = choose_qparams(x, spec)
    assert_bitexact(st.scale[0], scale, "scale")
    if zero is not None:
        assert_bitexact(st.zero[0], zero, "zero")
    qt, clipped = seal_with_static(x.unsqueeze(0), _key_spec(text + ":static"), st.layer(0))
    assert clipped == 0
    assert_bitexact(qt.data[0], quantize(x, spec).data, "payload")


@pytest.mark.parametrize("text", ["int8:channel", "int4:channel:asym", "fp8:tensor:fp32"])
def test_seal_with_static_clips_and_counts(text):
    g = torch.Generator().manual_seed(5)
    calib = realistic_keys(H, B, D, generator=g)
    spec = _key_spec(text + ":static")
    layer = static_scales(_stats_of(calib), spec, "key", "absmax").layer(0)
    x = realistic_keys(3, H, B, D, generator=g) * 1.6  # wider than calibration: some values must clip
    qt, clipped = seal_with_static(x, spec, layer)
    # the layout is the block-local one: one scale copy per block, so pools and kernels need no change
    assert (
        qt.data.shape == quantize(x, _key_spec(text)).data.shape
        and qt.data.dtype == quantize(x, _key_spec(text)).data.dtype
    )
    assert qt.scale.shape == (3, *spec.scale_shape(H, 1, D))
    assert all(torch.equal(qt.scale[i], layer.scale) for i in range(3))
    lo, hi = layer.limits()
    outside = (x < lo) | (x > hi)
    assert clipped == int(outside.sum()) == count_clipped(x, layer) > 0
    y = dequantize(qt)
    # clipped values land on the range ends; the others keep the usual error bound
    s = decode_scale(layer.scale, spec.scale_dtype)
    inside_err = (y - x).abs()[~outside]
    bound = (s / 2 if spec.dtype.is_int else hi.abs() / 8).expand_as(x)[~outside]
    assert (inside_err <= bound * 1.0001 + 1e-6).all()
    assert torch.allclose(y[outside], x.clamp(lo, hi)[outside], rtol=0.07, atol=float(s.max()))


def test_seal_with_static_refuses_mismatches_and_nan():
    x = torch.randn(1, H, B, D)
    layer = static_scales(_stats_of(x[0]), _key_spec("int8:channel"), "key").layer(0)
    with pytest.raises(CalibrationError, match="made for int8:channel"):
        seal_with_static(x, _key_spec("int4:channel:asym:static"), layer)
    with pytest.raises(CalibrationError, match="another model"):
        seal_with_static(torch.randn(1, H + 1, B, D), _key_spec("int8:channel:static"), layer)
    with pytest.raises(ShapeError):
        seal_with_static(x[0], _key_spec("int8:channel:static"), layer)
    bad = x.clone()
    bad[0, 1, 2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match="position 2"):
        seal_with_static(bad, _key_spec("int8:channel:static"), layer)
    with pytest.raises(CalibrationError, match="has 1 layers, asked for layer 3"):
        static_scales(_stats_of(x[0]), _key_spec("int8:channel"), "key").layer(3)


def test_static_specs_fail_closed():
    spec = _key_spec("int8:channel:static")
    x = torch.randn(H, B, D)
    with pytest.raises(CalibrationError, match="kvpack calibrate"):
        choose_qparams(x, spec)
    with pytest.raises(CalibrationError):
        quantize(x, spec)  # never a block-local (or default) scale behind the user's back
    fmt = parse_format("k=int8:channel:static,v=int8:token")
    assert fmt.is_static and not parse_format("int8").is_static
    with pytest.raises(CalibrationError, match="keys"):
        require_static_scales(fmt, None)
    require_static_scales(parse_format("int8"), None)
    assert parse_format(fmt.spec_string()) == fmt and "static" in fmt.spec_string()
    with pytest.raises(FormatError, match="per-token"):
        parse_format("k=int8:token:static,v=int8")
    with pytest.raises(FormatError):
        parse_format("k=int4:g32:static,v=int8")
    with pytest.raises(CalibrationError, match="cannot take static"):
        static_scales(_stats_of(x), _key_spec("int8:token"), "key")


def test_zero_range_channel_gets_a_tiny_scale_not_one():
    x = torch.randn(H, B, D)
    x[:, :, 5] = 0.0
    layer = static_scales(_stats_of(x), _key_spec("int8:channel"), "key").layer(0)
    s = decode_scale(layer.scale, layer.spec.scale_dtype)
    assert 0 < float(s[0, 0, 5]) < 1e-4
    y = x.unsqueeze(0).clone()
    y[0, 0, 0, 5] = 0.5  # drift into a channel that never moved
    _, clipped = seal_with_static(y, _key_spec("int8:channel:static"), layer)
    assert clipped == 1


def test_percentile_source_clips_about_what_it_promises():
    g = torch.Generator().manual_seed(11)
    calib = torch.randn(1, 1, 4096, D, generator=g)
    obs = KVObserver((99.0,))
    obs.observe(0, calib, calib)
    keys, _ = obs.stats()
    spec = _key_spec("int8:channel:static")
    p99 = static_scales(keys, spec, "key", "p99").layer(0)
    amax = static_scales(keys, spec, "key", "absmax").layer(0)
    fresh = torch.randn(4, 1, 64, D, generator=g)
    frac = count_clipped(fresh, p99) / fresh.numel()
    assert 0.002 < frac < 0.03  # ~1 % beyond the 99th percentile of |x|
    assert count_clipped(fresh, amax) < count_clipped(fresh, p99)
    _, c = seal_with_static(fresh, spec, p99)
    assert c == count_clipped(fresh, p99)


def test_clip_monitor_warns_once_per_layer_past_threshold():
    mon = ClipMonitor(3, threshold=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.record(0, 5, 1000)  # 0.5 %: quiet
    with pytest.warns(CalibrationDriftWarning, match="layer 0"):
        mon.record(0, 20, 1000)  # cumulative 1.25 %
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.record(0, 500, 1000)  # already warned for layer 0
    with pytest.warns(CalibrationDriftWarning, match="layer 2"):
        mon.record(2, 2, 100)
    rep = mon.report()
    assert rep["clipped"] == [525, 0, 2] and rep["sealed"] == [3000, 0, 100]
    assert rep["layers_over_threshold"] == [0, 2]
    with pytest.raises(CalibrationError):
        ClipMonitor(1, threshold=2.0)


def test_layer_scales_limits():
    spec = _key_spec("int4:channel:asym")
    scale = torch.full((1, 1, 2), 0.5, dtype=torch.float16)
    zero = torch.tensor([[[-1.0, 2.0]]], dtype=torch.float16)
    lo, hi = LayerScales(spec, scale, zero).limits()
    assert lo.tolist() == [[[-1.0, 2.0]]] and hi.tolist() == [[[6.5, 9.5]]]


# -- outlier channels ------------------------------------------------------------------------------------


def _planted(n=4, k=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, B, D, generator=g)
    chans = torch.stack([torch.randperm(D, generator=g)[:k].sort().values for _ in range(H)])
    for h in range(H):
        x[:, h, :, chans[h]] = x[:, h, :, chans[h]] * 20 + 15
    return x, chans


def test_outlier_channels_are_found_from_calibration_and_at_seal_time():
    x, chans = _planted()
    assert torch.equal(select_outlier_channels(x.abs().amax(dim=(0, 2)), 3), chans)
    per_block = seal_time_channels(x, 3)
    assert per_block.shape == (4, H, 3)
    assert all(torch.equal(per_block[i], chans) for i in range(4))
    with pytest.raises(ShapeError):
        select_outlier_channels(torch.rand(D), 2)
    with pytest.raises(ShapeError):
        seal_time_channels(x, D + 1)


@pytest.mark.parametrize("text", ["int4:g32:asym", "int4:token:asym", "int4:channel:asym", "int8:token"])
def test_outliers_kept_as_residuals_reconstruct_closely_and_help_per_token_keys(text):
    x, chans = _planted()
    spec = _key_spec(text)
    oq = quantize_outliers(x, spec, chans)
    y = dequantize_outliers(oq)
    mask = torch.zeros(H, D, dtype=torch.bool)
    mask.scatter_(-1, chans, True)
    full = mask[None, :, None, :].expand_as(x)
    # kept columns: dequantized fill + fp16 residual, so only the residual's fp16 rounding is lost
    base = dequantize(oq.qt)
    assert ((y - x).abs()[full] <= (x - base).abs()[full] * 2**-11 + 1e-6).all()
    plain = dequantize(quantize(x, spec))
    if "channel" not in text:
        # the outliers no longer dictate the per-token scale, so the ordinary channels get much finer steps
        assert snr_db(x[~full], y[~full]) > snr_db(x[~full], plain[~full]) + 10
    # the remainder's scales are the scales of the block without the outlier channels
    rest = quantize(torch.where(full, torch.zeros_like(x), x), spec)
    if spec.symmetric:
        assert_bitexact(oq.qt.scale, rest.scale, "scales ignore the outliers")
    # honest bytes: payload + scales (+ zero) + fp16 residuals + uint8 indices, per block (as the cache stores)
    n, k = x.shape[0], chans.shape[-1]
    payload = spec.payload_bytes(H, B, D) * n
    scales = spec.scale_bytes(H, B, D) * n
    assert oq.nbytes() == payload + scales + n * H * B * k * 2 + n * H * k
    per_block = quantize_outliers(x, spec, seal_time_channels(x, k))
    assert per_block.nbytes() == oq.nbytes()
    assert torch.equal(per_block.idx.long(), oq.idx.long())  # the planted channels are each block's largest


def test_outliers_reject_bad_channels():
    x, chans = _planted()
    with pytest.raises(ShapeError):
        quantize_outliers(x, _key_spec("int4:g32:asym"), chans[:1])


def test_default_range_source_follows_key_symmetry():
    from kvpack.calibration.run import DEFAULT_FORMAT, default_source

    assert default_source(DEFAULT_FORMAT) == "rope"
    assert default_source("kv=fp8:tensor:static:fp32") == "rope"
    assert default_source("k=int4:channel:asym:static,v=int4:g32") == "absmax"
