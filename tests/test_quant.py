"""Quantization primitives: bit-exact packing, the half-step bound, fp8 bounds, scales, SNR floors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack.errors import NonFiniteError, ShapeError
from kvpack.formats import (
    DType,
    PerChannel,
    PerGroup,
    PerHead,
    PerTensor,
    PerToken,
    QuantSpec,
    ScaleDType,
    parse_format,
)
from kvpack.quant import (
    codes,
    decode_scale,
    dequantize,
    encode_scale,
    pack_bits,
    quantize,
    saturating_cast,
    unpack_bits,
)
from kvpack.testing import SNR_FLOOR_DB, assert_bitexact, realistic_keys, snr_db

FP32_TINY = torch.finfo(torch.float32).tiny
EPS32 = 2.0**-23


def _expand(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast block scales ``[Hs, Ts, Cs]`` to ``like``'s ``[H, T, D]`` (independently of quant.py)."""
    h, t, d = like.shape[-3:]
    hs, ts, cs = s.shape[-3:]
    return s.repeat_interleave(h // hs, -3).repeat_interleave(t // ts, -2).repeat_interleave(d // cs, -1)


# ----------------------------------------------------------------------------------------------------
# Packing: bit-exact


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 63, 64, 65, 97])
def test_pack_unpack_roundtrip_bitexact(bits: int, d: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + d)
    q = torch.randint(0, 2**bits, (3, 5, d), generator=g, dtype=torch.uint8)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 5, math.ceil(d * bits / 8))
    assert_bitexact(unpack_bits(packed, bits, d), q)


def test_pack_layout_is_little_end_first_and_pads_with_zero() -> None:
    # element j of a byte sits at bits [j*bits, (j+1)*bits)
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00_11_10_01]
    assert pack_bits(torch.tensor([0xF, 0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0xAF, 0x05]
    assert pack_bits(torch.tensor([3, 3, 3, 3, 2], dtype=torch.uint8), 2).tolist() == [0xFF, 0x02]


def test_pack_rejects_other_widths() -> None:
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)


def test_sub_byte_symmetric_codes_are_offset_binary() -> None:
    spec = QuantSpec(DType.INT4, PerToken(), symmetric=True, scale_dtype=ScaleDType.FP32)
    x = torch.tensor([[[-7.0, 0.0, 7.0, 1.0]]])  # amax 7 -> scale 1, codes -7, 0, 7, 1
    qt = quantize(x, spec)
    assert unpack_bits(qt.data, 4, 4).tolist() == [[[1, 8, 15, 9]]]
    assert codes(qt).tolist() == [[[-7.0, 0.0, 7.0, 1.0]]]


def test_int8_payload_dtypes() -> None:
    x = torch.randn(2, 4, 8)
    assert quantize(x, QuantSpec(DType.INT8, PerToken())).data.dtype == torch.int8
    assert quantize(x, QuantSpec(DType.INT8, PerToken(), symmetric=False)).data.dtype == torch.uint8
    assert quantize(x, QuantSpec(DType.FP8_E5M2, PerHead())).data.dtype == torch.float8_e5m2


# ----------------------------------------------------------------------------------------------------
# The half-step bound, for any finite input of any allowed shape


def _needed_scale(x: torch.Tensor, spec: QuantSpec, zero: torch.Tensor | None) -> torch.Tensor:
    """The exact scale the data needs, ``[Hs, Ts, Cs]`` float64 (from the stored zero when asymmetric)."""
    shape = spec.granularity.scale_shape(*x.shape[-3:])
    h, t, d = x.shape
    hs, ts, cs = shape
    xg = x.double().reshape(hs, h // hs, ts, t // ts, cs, d // cs)
    if zero is not None:
        hi = xg.amax(dim=(1, 3, 5))
        return (hi - decode_scale(zero, spec.zero_dtype).double()) / spec.qmax
    top = spec.dtype.fp8_max if spec.dtype.is_fp8 else spec.qmax
    return xg.abs().amax(dim=(1, 3, 5)) / top


@st.composite
def int_cases(draw):
    d = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 20, 40]))
    h = draw(st.integers(1, 3))
    t = draw(st.integers(1, 5))
    # groups that do not divide d too: narrower groups that do (PerGroup.groups)
    grans = [PerTensor(), PerHead(), PerChannel(), PerToken()] + [PerGroup(g) for g in (1, 2, 4, 8, 16, 32)]
    spec = QuantSpec(
        draw(st.sampled_from([DType.INT8, DType.INT4, DType.INT2])),
        draw(st.sampled_from(grans)),
        draw(st.booleans()),
        draw(st.sampled_from(list(ScaleDType))),
    )
    # fp16 storage (scales, or E8M0's fp16 zero-points) holds values up to 65504: stay in range
    fp16_bound = spec.scale_dtype is ScaleDType.FP16 or (spec.has_zero and spec.zero_dtype is ScaleDType.FP16)
    magnitude = draw(
        st.sampled_from([2.0**-100, 2.0**-20, 1.0, 1024.0, 32768.0] + ([] if fp16_bound else [2.0**40, 2.0**123]))
    )
    values = draw(
        st.lists(
            st.floats(-magnitude, magnitude, allow_nan=False, allow_infinity=False, width=32),
            min_size=h * t * d,
            max_size=h * t * d,
        )
    )
    return spec, torch.tensor(values, dtype=torch.float32).reshape(h, t, d)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(int_cases())
def test_int_reconstructs_within_half_a_step(case) -> None:
    spec, x = case
    qt = quantize(x, spec)
    xh = dequantize(qt)
    assert torch.isfinite(xh).all()
    s = decode_scale(qt.scale, spec.scale_dtype).double()
    z = decode_scale(qt.zero, spec.zero_dtype).double() if qt.zero is not None else None
    assert (s > 0).all()
    # the step is the one the data needs, rounded up by at most the scale dtype's resolution
    need = _needed_scale(x, spec, qt.zero)
    slack = {
        ScaleDType.FP32: 1 + 4 * EPS32,
        ScaleDType.FP16: 1 + 2**-10,
        ScaleDType.BF16: 1 + 2**-7,
        ScaleDType.E8M0: 2,
    }
    floor = {ScaleDType.FP16: 2.0**-14, ScaleDType.BF16: FP32_TINY, ScaleDType.E8M0: 2.0**-126}
    assert (s >= need * (1 - 4 * EPS32)).all()
    top = torch.clamp(need * slack[spec.scale_dtype], min=floor.get(spec.scale_dtype, FP32_TINY))
    # a constant group (or one whose range underflows float32) may take any positive scale
    assert ((s <= top) | (need < FP32_TINY)).all()
    # half a step per element, plus float32 rounding of q*s + z
    err = (xh.double() - x.double()).abs()
    bound = _expand(s, x) / 2 * (1 + 1e-5) + 4 * EPS32 * x.double().abs()
    if qt.zero is not None:
        bound = bound + 4 * EPS32 * _expand(z.abs(), x)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int4", "kivi2", "int4-g32"])
def test_half_precision_input_within_half_a_step(dtype: torch.dtype, fmt: str) -> None:
    x = realistic_keys(2, 64, 64).to(dtype)
    for spec in (parse_format(fmt).key, parse_format(fmt).value):
        qt = quantize(x, spec)
        s = _expand(decode_scale(qt.scale, spec.scale_dtype), x).double()
        err = (dequantize(qt).double() - x.double()).abs()
        assert (err <= s / 2 * (1 + 1e-5) + 1e-6).all()


# ----------------------------------------------------------------------------------------------------
# fp8: relative bound, subnormals, saturation

# (mantissa bits, smallest normal exponent) of the fp8 codes
FP8_GRID = {DType.FP8_E4M3: (3, -6), DType.FP8_E5M2: (2, -14)}


def fp8_error_bound(x: torch.Tensor, s: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Rounding to nearest on the fp8 grid of ``x / s``: half a spacing.

    A normal code ``v`` in ``[2^e, 2^(e+1))`` has spacing ``2^(e-m)``, so the error is at most
    ``2^-(m+1) * |v|``; below the smallest normal ``2^emin`` the spacing is the fixed ``2^(emin-m)``.
    """
    m, emin = FP8_GRID[dtype]
    v = (x / s).abs()
    return s * torch.maximum(v * 2.0 ** -(m + 1), torch.full_like(v, 2.0 ** (emin - m - 1)))


@st.composite
def fp8_cases(draw):
    d = draw(st.sampled_from([1, 3, 8, 16]))
    h, t = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    grans = [PerTensor(), PerHead(), PerChannel(), PerToken()] + ([PerGroup(8)] if d % 8 == 0 else [])
    spec = QuantSpec(
        draw(st.sampled_from([DType.FP8_E4M3, DType.FP8_E5M2])),
        draw(st.sampled_from(grans)),
        True,
        draw(st.sampled_from([ScaleDType.FP32, ScaleDType.BF16, ScaleDType.E8M0, ScaleDType.FP16])),
    )
    magnitude = draw(
        st.sampled_from(
            [2.0**-66, 2.0**-10, 1.0, 256.0, 32768.0] + ([] if spec.scale_dtype is ScaleDType.FP16 else [2.0**100])
        )
    )
    values = draw(st.lists(st.floats(-magnitude, magnitude, width=32), min_size=h * t * d, max_size=h * t * d))
    return spec, torch.tensor(values, dtype=torch.float32).reshape(h, t, d)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_cases())
def test_fp8_reconstructs_within_relative_bound(case) -> None:
    spec, x = case
    qt = quantize(x, spec)
    xh = dequantize(qt).double()
    assert torch.isfinite(xh).all()
    s = _expand(decode_scale(qt.scale, spec.scale_dtype), x).double()
    bound = fp8_error_bound(x.double(), s, spec.dtype) * (1 + 1e-5) + 4 * EPS32 * x.double().abs()
    err = (xh - x.double()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", [DType.FP8_E4M3, DType.FP8_E5M2])
def test_fp8_bound_is_tight_and_subnormals_are_used(dtype: DType) -> None:
    # every fp32 value between 0 and twice the largest code, unit scale: the bound holds and is reached
    spec = QuantSpec(dtype, PerTensor(), scale_dtype=ScaleDType.FP32)
    top = dtype.fp8_max
    x = torch.linspace(0, top, 200_001).reshape(1, 1, -1)
    one = torch.ones(1, 1, 1)
    xh = dequantize(quantize(x, spec, scale=one)).double()
    ratio = (xh - x.double()).abs() / fp8_error_bound(x.double(), one.double(), dtype)
    m, emin = FP8_GRID[dtype]
    assert ratio.max() <= 1 + 1e-6
    # not loose: at a midpoint just above 2^e the error is half a spacing and |v| exceeds 2^e by that much
    assert ratio.max() >= 1 / (1 + 2.0 ** -(m + 1)) - 1e-3
    tiny = torch.tensor([[[2.0 ** (emin - m)]]])  # smallest subnormal survives
    assert dequantize(quantize(tiny, spec, scale=one)).item() == tiny.item()


@pytest.mark.parametrize("dtype", [DType.FP8_E4M3, DType.FP8_E5M2])
def test_fp8_saturating_cast_never_makes_inf_or_nan(dtype: DType) -> None:
    big = torch.tensor([3.0e38, -3.0e38, 1e6, -1e6, dtype.fp8_max * 1.01, -dtype.fp8_max * 1.01, 0.0])
    out = saturating_cast(big, dtype).float()
    assert torch.isfinite(out).all()
    assert out.tolist()[:6] == [dtype.fp8_max, -dtype.fp8_max] * 3
    # static scales that are too small clip to the largest code instead of overflowing
    spec = QuantSpec(dtype, PerTensor(), scale_dtype=ScaleDType.FP32)
    qt = quantize(big.reshape(1, 1, -1), spec, scale=torch.ones(1, 1, 1))
    assert torch.isfinite(dequantize(qt)).all()
    # chosen scales: huge finite input stays finite end to end
    qt = quantize(big.reshape(1, 1, -1), spec)
    assert torch.isfinite(dequantize(qt)).all()


# ----------------------------------------------------------------------------------------------------
# Scales: E8M0 powers of two, double quantization, saturation


def test_e8m0_scales_are_powers_of_two_at_least_the_needed_scale() -> None:
    g = torch.Generator().manual_seed(3)
    need = torch.exp(torch.empty(10_000).uniform_(-80, 80, generator=g))  # ~1e-35 .. 1e35
    need = torch.cat([need, 2.0 ** torch.arange(-126, 127).float()])  # exact powers stay exact
    stored = encode_scale(need, ScaleDType.E8M0)
    assert stored.dtype == torch.uint8
    s = decode_scale(stored, ScaleDType.E8M0).double()
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # powers of two
    assert (s >= need.double()).all()
    assert (s < 2 * need.double()).all()
    assert torch.equal(s[-253:], need[-253:].double())
    # through choose_qparams: the stored scale covers the absmax
    spec = QuantSpec(DType.INT8, PerToken(), scale_dtype=ScaleDType.E8M0)
    x = torch.randn(2, 16, 32, generator=g) * 3
    qt = quantize(x, spec)
    s = decode_scale(qt.scale, ScaleDType.E8M0)
    assert (s * 127 >= x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("scale_dtype", [ScaleDType.FP16, ScaleDType.BF16])
def test_scales_round_up_and_zero_points_round_down(scale_dtype: ScaleDType) -> None:
    g = torch.Generator().manual_seed(4)
    s = torch.rand(5000, generator=g) * 10
    up = encode_scale(s, scale_dtype).float()
    down = encode_scale(-s, scale_dtype, round_up=False).float()
    assert (up >= s).all() and (down <= -s).all()
    assert (up > 0).all()  # never rounds to zero, even for tiny scales
    assert (encode_scale(torch.tensor([1e-30]), scale_dtype).float() > 0).all()


def test_scale_storage_saturates_instead_of_overflowing() -> None:
    # values past what fp16 scales can describe clip (like fp8 saturation): never inf/NaN
    for fmt in ("int8", "int4", "kivi2"):
        spec = parse_format(fmt).key
        x = torch.tensor([[[1e6, -1e6, 5.0, 7e4]]]).expand(1, 4, 4).contiguous()
        qt = quantize(x, spec)
        assert torch.isfinite(decode_scale(qt.scale, spec.scale_dtype)).all()
        if qt.zero is not None:
            assert torch.isfinite(decode_scale(qt.zero, spec.zero_dtype)).all()
        assert torch.isfinite(dequantize(qt)).all()


def _rel_mse(x: torch.Tensor, spec: QuantSpec) -> float:
    return float(((dequantize(quantize(x, spec)) - x) ** 2).mean() / (x**2).mean())


@pytest.mark.parametrize("dtype", [DType.INT8, DType.INT4, DType.FP8_E4M3])
def test_double_quantization_error_is_included(dtype: DType) -> None:
    x = realistic_keys(4, 64, 128, generator=torch.Generator().manual_seed(5))
    gran = PerHead() if dtype.is_fp8 else PerToken()
    err = {sd: _rel_mse(x, QuantSpec(dtype, gran, True, sd)) for sd in ScaleDType}
    assert err[ScaleDType.E8M0] >= err[ScaleDType.FP32]
    assert err[ScaleDType.E8M0] > err[ScaleDType.FP16]  # coarser scale, visibly more error
    if not dtype.is_fp8:  # an int step one power of two too wide costs up to 2x in error amplitude
        assert err[ScaleDType.E8M0] > 1.2 * err[ScaleDType.FP32]
    # dequantize reads the stored (rounded) scale, not the exact one
    spec = QuantSpec(dtype, gran, True, ScaleDType.FP16)
    qt = quantize(x, spec)
    assert qt.scale.dtype == torch.float16
    q = qt.data.float() if dtype.is_fp8 else codes(qt)
    assert_bitexact(dequantize(qt), q * _expand(qt.scale.float(), q))


# ----------------------------------------------------------------------------------------------------
# Non-finite input: a typed error that names where

NONFINITE_SPECS = ["int8:channel:sym:fp16", "int4:g8:asym:fp16", "fp8_e4m3:head:fp16", "int2:token:asym:e8m0", "fp16"]


@pytest.mark.parametrize("spec_str", NONFINITE_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_names_head_position_channel(spec_str: str, bad: float) -> None:
    spec = parse_format(f"kv={spec_str}").key
    x = torch.randn(3, 16, 32)
    x[2, 11, 5] = bad
    with pytest.raises(NonFiniteError) as info:
        quantize(x, spec)
    assert info.value.where[0] == {"head": 2, "position": 11, "channel": 5}
    msg = str(info.value)
    assert "head 2" in msg and "position 11" in msg and "channel 5" in msg
    assert ("nan" if math.isnan(bad) else "inf") in msg


def test_non_finite_names_the_batch_index_and_leaves_input_untouched() -> None:
    spec = parse_format("int8").key
    x = torch.randn(4, 2, 8, 16)  # [num_blocks, H, T, D]
    x[3, 1, 7, 0] = float("nan")
    before = x.clone()
    with pytest.raises(NonFiniteError) as info:
        quantize(x, spec)
    assert info.value.where[0] == {"index": (3,), "head": 1, "position": 7, "channel": 0}
    assert "batch index (3,)" in str(info.value)
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


def test_non_finite_with_static_scales_is_refused() -> None:
    spec = QuantSpec(DType.INT8, PerToken(), scale_dtype=ScaleDType.FP32)
    x = torch.randn(1, 4, 8)
    x[0, 2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match="position 2"):
        quantize(x, spec, scale=torch.ones(1, 4, 1))


def test_bad_shapes_are_typed_errors() -> None:
    spec = parse_format("int4").value  # groups of 32
    assert quantize(torch.randn(2, 4, 48), spec).scale.shape == (2, 4, 2)  # 48 = 2 x 24: narrower, not refused
    with pytest.raises(ShapeError, match="leave nothing to quantize"):
        quantize(torch.randn(2, 4, 4), parse_format("int4-o4").key)
    with pytest.raises(ShapeError, match="kv_heads, tokens, head_dim"):
        quantize(torch.randn(4, 32), spec)
    with pytest.raises(ShapeError, match="floating-point"):
        quantize(torch.ones(2, 4, 32, dtype=torch.int32), spec)


# ----------------------------------------------------------------------------------------------------
# Signal-to-noise on realistic keys


def _blocks(seed: int = 0) -> torch.Tensor:
    """``[num_blocks, H, block_size, D]`` keys with persistent outlier channels per head."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([realistic_keys(8, 64, 128, generator=g) for _ in range(4)])


@pytest.mark.parametrize("spec_str", sorted(SNR_FLOOR_DB))
def test_snr_floor(spec_str: str) -> None:
    spec = parse_format(f"kv={spec_str}").key
    assert str(spec) == spec_str
    x = _blocks()
    snr = snr_db(x, dequantize(quantize(x, spec)))
    assert snr >= SNR_FLOOR_DB[spec_str], f"{spec_str}: {snr:.1f} dB < floor {SNR_FLOOR_DB[spec_str]} dB"


@pytest.mark.parametrize(
    ("channel", "token", "margin_db"),
    [("int8:channel:sym:fp16", "int8:token:sym:fp16", 5.0), ("int4:channel:asym:fp16", "int4:token:asym:fp16", 5.0)],
)
def test_per_channel_keys_beat_per_token_keys(channel: str, token: str, margin_db: float) -> None:
    x = _blocks(seed=1)
    snr = {s: snr_db(x, dequantize(quantize(x, parse_format(f"kv={s}").key))) for s in (channel, token)}
    assert snr[channel] >= snr[token] + margin_db, snr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_non_finite_element(dtype: torch.dtype, bad: float) -> None:
    from kvpack.quant import all_finite

    x = torch.randn(2, 3, 17, 8).to(dtype)
    assert all_finite(x)
    x[1, 2, 16, 7] = bad
    assert not all_finite(x)
    assert all_finite(torch.full((4,), torch.finfo(dtype).max, dtype=dtype))  # the largest finite value is finite
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))
