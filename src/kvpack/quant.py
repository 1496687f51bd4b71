"""Quantization primitives in pure torch: choose scales, quantize, dequantize, pack.

This module is the semantic reference: every kernel and the cache must reproduce what it computes.

Tensors are block-shaped: ``x`` is ``[..., kv_heads, tokens, head_dim]`` (any leading batch axes, for
example ``num_blocks``), and its scales are ``[..., Hs, Ts, Cs]`` as given by the spec's granularity
(:meth:`kvpack.formats.Granularity.scale_shape`), which is also the layout of the cache's scale pools.

Rounding rules that make the error bound hold for every finite input:

* scales are rounded *up* when stored (fp16, bf16, or E8M0 powers of two), so no code overflows its range;
* zero-points (asymmetric int) are rounded *down*, and the scale is then chosen from the rounded zero,
  so every element lies inside ``[z, z + qmax * s]``;
* therefore an integer format reconstructs every element within half a quantization step ``s / 2``.

That holds while the scales fit their storage: fp16 scales and zero-points hold magnitudes up to 65504
(so int8 with fp16 scales covers ``|x|`` up to about 8e6, any fp16 input included), fp32, bf16 and E8M0
scales cover every float32 input whose group range ``max - min`` is finite. Past that, stored scales and
zero-points saturate at the largest finite value, as the fp8 casts do: values clip, nothing becomes
inf or NaN. Positive scales are kept normal (never subnormal, never zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpack.errors import CalibrationError, NonFiniteError, ShapeError
from kvpack.formats import DType, KVFormat, QuantSpec, ScaleDType

__all__ = [
    "TORCH_FP8",
    "QuantizedTensor",
    "all_finite",
    "choose_qparams",
    "decode_scale",
    "dequantize",
    "encode_scale",
    "find_non_finite",
    "pack_bits",
    "payload_torch_dtype",
    "quantize",
    "saturating_cast",
    "scale_torch_dtype",
    "snr_db",
    "tail_torch_dtype",
    "unpack_bits",
]

TORCH_FP8 = {DType.FP8_E4M3: torch.float8_e4m3fn, DType.FP8_E5M2: torch.float8_e5m2}
_TORCH_FLOAT = {DType.FP32: torch.float32, DType.FP16: torch.float16, DType.BF16: torch.bfloat16}
_TORCH_SCALE = {
    ScaleDType.FP32: torch.float32,
    ScaleDType.FP16: torch.float16,
    ScaleDType.BF16: torch.bfloat16,
    ScaleDType.E8M0: torch.uint8,
}


def payload_torch_dtype(spec: QuantSpec) -> torch.dtype:
    """Torch dtype of a spec's payload array: the float type, int8 (symmetric), fp8, or uint8."""
    if spec.dtype in _TORCH_FLOAT:
        return _TORCH_FLOAT[spec.dtype]
    if spec.dtype.is_fp8:
        return TORCH_FP8[spec.dtype]
    if spec.dtype is DType.INT8 and spec.symmetric:
        return torch.int8
    return torch.uint8  # asymmetric int8, and packed int4 / int2 in offset binary


def tail_torch_dtype(fmt: KVFormat, model_dtype: torch.dtype) -> torch.dtype:
    """Torch dtype of a format's tail and sink rows: its ``tail`` field, else ``model_dtype`` (the model's)."""
    return model_dtype if fmt.tail is None else _TORCH_FLOAT[fmt.tail]


def scale_torch_dtype(scale_dtype: ScaleDType) -> torch.dtype:
    """Torch dtype of a stored scale or zero-point (E8M0 exponents are uint8)."""
    return _TORCH_SCALE[scale_dtype]


@dataclass
class QuantizedTensor:
    """Quantized data as it is stored: payload, scales, zero-points and the spec that explains them.

    Attributes:
        data: payload, shape ``[..., H, T, spec.packed_head_dim(head_dim)]``, dtype
            :func:`payload_torch_dtype`.
        scale: shape ``[..., Hs, Ts, Cs]``, dtype :func:`scale_torch_dtype` of ``spec.scale_dtype``;
            ``None`` for passthrough specs.
        zero: same shape as ``scale``, dtype of ``spec.zero_dtype``; ``None`` unless asymmetric.
        spec: the spec.
        head_dim: logical last-axis length before packing.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    spec: QuantSpec
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., H, T, head_dim]``."""
        return (*self.data.shape[:-1], self.head_dim)

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.zero):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


# ----------------------------------------------------------------------------------------------------
# Scale storage


def encode_scale(s: torch.Tensor, scale_dtype: ScaleDType, round_up: bool = True) -> torch.Tensor:
    """Store float32 scales (or zero-points) ``s`` in ``scale_dtype``.

    Scales round up (``round_up=True``) so that ``x / stored_scale`` never exceeds the code range;
    zero-points round down (``round_up=False``). Positive scales never round to zero: they are clamped
    to the smallest normal number of the storage type. E8M0 stores ``ceil(log2(s)) + 127`` as uint8
    (positive scales only).
    """
    s = s.float()
    if scale_dtype is ScaleDType.FP32:
        if not round_up:
            return s.clone()
        # a subnormal scale has too few significant bits for the half-step bound: keep scales normal
        f32 = torch.finfo(torch.float32)
        return torch.where(s > 0, s.clamp(f32.tiny, f32.max), s)
    if scale_dtype is ScaleDType.E8M0:
        # 2**-126 .. 2**127, rounded up to a power of two
        mant, exp = torch.frexp(s.clamp(min=2.0**-126, max=2.0**127))
        exp = exp - (mant == 0.5).to(exp.dtype)  # exact powers of two stay as they are
        return (exp + 127).clamp(0, 254).to(torch.uint8)
    tdt = _TORCH_SCALE[scale_dtype]
    info = torch.finfo(tdt)
    out = s.to(tdt)
    direction = torch.full_like(out, float("inf") if round_up else float("-inf"))
    off = (out.float() < s) if round_up else (out.float() > s)
    out = torch.where(off, torch.nextafter(out, direction), out)
    if round_up:
        out = torch.where((s > 0) & (out.float() < info.tiny), torch.full_like(out, info.tiny), out)
    # saturate like the fp8 casts: past the storage range values clip instead of becoming inf/NaN
    return out.clamp(-info.max, info.max)


def decode_scale(stored: torch.Tensor, scale_dtype: ScaleDType) -> torch.Tensor:
    """Inverse of :func:`encode_scale`: stored scales as float32."""
    if scale_dtype is ScaleDType.E8M0:
        return torch.ldexp(torch.ones_like(stored, dtype=torch.float32), stored.to(torch.int32) - 127)
    return stored.float()


# ----------------------------------------------------------------------------------------------------
# Helpers over the block axes


def _check_shape(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() < 3:
        raise ShapeError(f"expected a tensor [..., kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ShapeError(f"expected a floating-point tensor, got {x.dtype}")
    reasons = spec.reasons_invalid(x.shape[-1])
    if reasons:
        raise ShapeError("; ".join(reasons))


def _grouped(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """View ``[..., H, T, D]`` as ``[..., Hs, H/Hs, Ts, T/Ts, Cs, D/Cs]``."""
    *lead, h, t, d = x.shape
    hs, ts, cs = shape
    return x.reshape(*lead, hs, h // hs, ts, t // ts, cs, d // cs)


def _reduce(x: torch.Tensor, shape: tuple[int, int, int], op: str) -> torch.Tensor:
    """Reduce ``[..., H, T, D]`` to ``[..., Hs, Ts, Cs]`` with ``op`` ("amax" or "amin")."""
    return getattr(_grouped(x, shape), op)(dim=(-1, -3, -5))


def _bcast(s: torch.Tensor) -> torch.Tensor:
    """View ``[..., Hs, Ts, Cs]`` scales as ``[..., Hs, 1, Ts, 1, Cs, 1]`` to broadcast over :func:`_grouped`."""
    *lead, hs, ts, cs = s.shape
    return s.reshape(*lead, hs, 1, ts, 1, cs, 1)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` (any shape, any dtype) is finite. One reduction, ``abs().amax()`` (a NaN
    propagates, an inf is the largest): on the CPU several times faster than ``torch.isfinite(x).all()``,
    which the append and seal paths would otherwise pay on every call."""
    if x.numel() == 0 or not x.is_floating_point():
        return True
    if x.element_size() == 1:  # fp8: no abs kernel
        x = x.float()
    return bool(x.abs().amax() < math.inf)


def find_non_finite(x: torch.Tensor) -> list[dict[str, int]]:
    """Locations of the first few NaN/inf elements of ``[..., H, T, D]`` (head, position, channel)."""
    bad = (~torch.isfinite(x)).nonzero()
    where = []
    for idx in bad[:4].tolist():
        *lead, h, t, d = idx
        loc = {"index": tuple(lead)} if lead else {}
        where.append({**loc, "head": h, "position": t, "channel": d})
    return where


def _raise_non_finite(x: torch.Tensor) -> None:
    where = find_non_finite(x)
    first = where[0]
    raise NonFiniteError(
        f"non-finite value ({x[tuple([*first.get('index', ()), first['head'], first['position'], first['channel']])].item()}) "
        f"at head {first['head']}, position {first['position']}, channel {first['channel']}"
        + (f", batch index {first['index']}" if "index" in first else "")
        + "; the model produced NaN/inf keys or values, nothing was quantized",
        where,
    )


# ----------------------------------------------------------------------------------------------------
# The three primitives


def choose_qparams(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Choose stored scales and zero-points for ``x``.

    Args:
        x: ``[..., H, T, D]``, floating point.
        spec: the quantization spec.

    Returns:
        ``(scale, zero)``: ``[..., Hs, Ts, Cs]`` in the stored dtypes (zero is ``None`` unless the spec is
        asymmetric int; both are ``None`` for passthrough specs).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (the location is named).
        CalibrationError: the spec is ``static``: its scales come from a calibration artifact, never from here.
    """
    _check_shape(x, spec)
    if spec.is_passthrough:
        return None, None
    if spec.static:
        raise CalibrationError(
            f"spec {spec} takes static (calibrated) scales and none were given; run `kvpack calibrate` and "
            "pass the artifact (kvpack.calibration.seal_with_static), or drop 'static' for block-local scales"
        )
    shape = spec.granularity.scale_shape(*x.shape[-3:])
    xf = x.float()
    if spec.has_zero:
        lo = _reduce(xf, shape, "amin")
        hi = _reduce(xf, shape, "amax")
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            _raise_non_finite(x)
        if spec.dtype.is_fp8:  # centred on the group's midpoint, scaled so the farther end is fp8's largest
            zero = encode_scale(lo * 0.5 + hi * 0.5, spec.zero_dtype, round_up=False)
            z = decode_scale(zero, spec.zero_dtype)
            s = torch.maximum(hi - z, z - lo) / spec.dtype.fp8_max
            s = torch.where(s > 0, s, torch.ones_like(s))
            return encode_scale(s, spec.scale_dtype), zero
        zero = encode_scale(lo, spec.zero_dtype, round_up=False)
        span = hi - decode_scale(zero, spec.zero_dtype)
        s = span / spec.qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        return encode_scale(s, spec.scale_dtype), zero
    amax = _reduce(xf.abs(), shape, "amax")
    if not torch.isfinite(amax).all():
        _raise_non_finite(x)
    top = spec.dtype.fp8_max if spec.dtype.is_fp8 else spec.qmax
    s = amax / top
    s = torch.where(s > 0, s, torch.ones_like(s))
    return encode_scale(s, spec.scale_dtype), None


def saturating_cast(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Cast float32 ``x`` to an fp8 dtype, clamping overflow to the largest finite value (never inf/NaN
    from overflow; NaN input stays NaN)."""
    m = dtype.fp8_max
    return x.float().clamp(-m, m).to(TORCH_FP8[dtype])


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` ``[..., H, T, D]`` to ``spec``; scales are chosen unless given (stored dtypes).

    Given (static) scales clip values outside their range instead of failing.
    """
    _check_shape(x, spec)
    d = x.shape[-1]
    if spec.is_passthrough:
        if not all_finite(x):
            _raise_non_finite(x)
        return QuantizedTensor(x.to(_TORCH_FLOAT[spec.dtype]).contiguous(), None, None, spec, d)
    if scale is None:
        scale, zero = choose_qparams(x, spec)
    elif not all_finite(x):
        _raise_non_finite(x)
    shape = tuple(scale.shape[-3:])
    xf = _grouped(x.float(), shape)  # a view: scales broadcast without being expanded in memory
    s = _bcast(decode_scale(scale, spec.scale_dtype))
    if spec.has_zero:
        if zero is None:
            raise ShapeError("an asymmetric spec needs zero-points with its scales")
        xf = xf - _bcast(decode_scale(zero, spec.zero_dtype))
    if spec.dtype.is_fp8:
        data = saturating_cast(xf / s, spec.dtype).reshape(x.shape)
        return QuantizedTensor(data.contiguous(), scale, zero, spec, d)
    q = torch.round(xf / s).clamp_(spec.qmin, spec.qmax).reshape(x.shape)
    if spec.dtype is DType.INT8:
        data = q.to(payload_torch_dtype(spec))
    else:
        if not spec.has_zero:
            q += 2 ** (spec.bits - 1)
        data = pack_bits(q.to(torch.uint8), spec.bits)
    return QuantizedTensor(data.contiguous(), scale, zero, spec, d)


def codes(qt: QuantizedTensor) -> torch.Tensor:
    """Integer codes of an int payload, unpacked, as float32 ``[..., H, T, D]`` (signed when symmetric)."""
    spec = qt.spec
    if spec.dtype is DType.INT8:
        return qt.data.float()
    q = unpack_bits(qt.data, spec.bits, qt.head_dim).float()
    return q if spec.has_zero else q - 2 ** (spec.bits - 1)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., H, T, D]`` in ``dtype`` from a :class:`QuantizedTensor`."""
    spec = qt.spec
    if spec.is_passthrough:
        return qt.data.to(dtype)
    if spec.dtype.is_fp8:
        q = qt.data.float()
    else:
        q = codes(qt)
    g = _grouped(q, tuple(qt.scale.shape[-3:]))
    x = g * _bcast(decode_scale(qt.scale, spec.scale_dtype))
    if spec.has_zero:
        x = x + _bcast(decode_scale(qt.zero, spec.zero_dtype))
    return x.reshape(q.shape).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Bit packing: little-end first (element j of a byte sits at bits [j*bits, (j+1)*bits))


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., D]`` (each ``< 2**bits``) into ``[..., ceil(D * bits / 8)]`` uint8.

    ``bits`` is 2, 4 or 8; a ragged last byte is zero-padded. Element ``j`` of a byte lives at bits
    ``[j * bits, (j + 1) * bits)``.
    """
    if bits == 8:
        return q.to(torch.uint8)
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    per = 8 // bits
    d = q.shape[-1]
    pad = (-d) % per
    q = q.to(torch.uint8)
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    out = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
    for j in range(per):
        out |= q[..., j] << (j * bits)
    return out


def unpack_bits(p: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., ceil(d * bits / 8)]`` uint8 to ``[..., d]`` uint8 codes."""
    if bits == 8:
        return p[..., :d]
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(p >> (j * bits)) & mask for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*p.shape[:-1], p.shape[-1] * per)[..., :d]


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``approx`` against ``reference`` (same shape, any float dtype) in dB; inf when
    identical. The measure of one quantize -> dequantize round trip."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).mean() / noise))
