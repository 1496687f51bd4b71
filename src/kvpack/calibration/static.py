"""Static (calibrated) scales: choose them from calibration statistics, seal blocks with them, count clipping.

Block-local scales (the default) are chosen when a block is sealed. A ``static`` spec instead takes its
scales from a calibration artifact: per layer ``[Hs, 1, Cs]`` (``[kv_heads, 1, head_dim]`` for
per-channel keys), computed once from the observed abs-max or a percentile with exactly the rounding rules
of :func:`kvpack.quant.choose_qparams` (scales rounded up, zero-points down), and stored in the spec's
scale dtype. Sealing with them goes through :func:`kvpack.quant.quantize` with the scales given, so the
block layout, the scale pools and the kernels are unchanged: every block still carries its scale slot.

Values beyond the calibrated range are clipped; :func:`seal_with_static` returns how many, and
:class:`ClipMonitor` keeps the per-layer counts (the drift detector) and warns once per layer when the
clipped fraction passes a threshold.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from kvpack.calibration.observer import RoleStats
from kvpack.errors import CalibrationError, ShapeError
from kvpack.formats import KVFormat, PerChannel, PerHead, PerTensor, QuantSpec
from kvpack.quant import QuantizedTensor, decode_scale, encode_scale, quantize, scale_torch_dtype

__all__ = [
    "CalibrationDriftWarning",
    "ClipMonitor",
    "LayerScales",
    "StaticKeyScales",
    "StaticScales",
    "count_clipped",
    "require_static_scales",
    "same_quantization",
    "seal_with_static",
    "spec_takes_static",
    "static_scales",
]

# Fraction of a layer's sealed elements that may clip before the drift warning fires. A p99.9 calibration
# clips about 0.1 % of in-distribution values by design; ten times that means the inputs have moved.
DEFAULT_CLIP_THRESHOLD = 0.01


class CalibrationDriftWarning(UserWarning):
    """More values than expected fall outside the calibrated range: recalibrate on representative text."""


def spec_takes_static(spec: QuantSpec) -> bool:
    """True when static scales can exist for ``spec``: a quantized spec with one scale per channel, head or
    tensor (per-token scales only exist once their token does)."""
    return (
        not spec.is_passthrough
        and not spec.rotate  # statistics are of natural keys; rotated keys would need rotated ranges
        and isinstance(spec.granularity, (PerChannel, PerHead, PerTensor))
    )


def _plain(spec: QuantSpec) -> QuantSpec:
    return dataclasses.replace(spec, static=False, outliers=0)


def same_quantization(a: QuantSpec, b: QuantSpec) -> bool:
    """Same dtype, granularity, symmetry and scale dtype (the ``static`` flag and outlier channels aside:
    the scales of the quantized remainder do not depend on them)."""
    return _plain(a) == _plain(b)


@dataclass(frozen=True)
class LayerScales:
    """The stored static scales of one layer for one spec.

    Attributes:
        spec: the spec they were made for.
        scale: ``[Hs, 1, Cs]`` in the stored scale dtype (``[kv_heads, 1, head_dim]`` per channel).
        zero: same shape, zero-point dtype; ``None`` unless the spec is asymmetric int.
    """

    spec: QuantSpec
    scale: torch.Tensor
    zero: torch.Tensor | None

    def limits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The representable range ``(lo, hi)``, each float32 ``[Hs, 1, Cs]``; values outside it clip."""
        spec = self.spec
        s = decode_scale(self.scale, spec.scale_dtype)
        if spec.dtype.is_fp8:
            hi = s * spec.dtype.fp8_max
            return -hi, hi
        if spec.has_zero:
            z = decode_scale(self.zero, spec.zero_dtype)
            return z, z + s * spec.qmax
        hi = s * spec.qmax
        return -hi, hi


@dataclass(frozen=True)
class StaticScales:
    """Static scales of one role (keys or values) for every layer.

    Attributes:
        role: ``"key"`` or ``"value"``.
        spec: the spec they were made for.
        scale: ``[layers, Hs, 1, Cs]`` in the stored scale dtype.
        zero: same shape in the zero-point dtype; ``None`` unless asymmetric int.
        source: the statistic they come from, ``"absmax"`` or ``"p<P>"``.
    """

    role: str
    spec: QuantSpec
    scale: torch.Tensor
    zero: torch.Tensor | None
    source: str

    @property
    def num_layers(self) -> int:
        return self.scale.shape[0]

    def layer(self, i: int) -> LayerScales:
        """Scales of layer ``i``; :class:`CalibrationError` when the artifact has no such layer."""
        if not 0 <= i < self.num_layers:
            raise CalibrationError(
                f"the calibration artifact has {self.num_layers} layers, asked for layer {i}; "
                "it was made for another model: recalibrate"
            )
        return LayerScales(self.spec, self.scale[i], None if self.zero is None else self.zero[i])


# The brief's name for the common case: per-channel key scales [layers, kv_heads, 1, head_dim].
StaticKeyScales = StaticScales


def _reduce_range(t: torch.Tensor, spec: QuantSpec, op: str) -> torch.Tensor:
    """``[layers, H, D]`` per-channel statistic -> ``[layers, Hs, 1, Cs]`` for the spec's granularity."""
    g = spec.granularity
    if isinstance(g, PerChannel):
        return t.unsqueeze(2)
    if isinstance(g, PerHead):
        return getattr(t, op)(dim=-1, keepdim=True).unsqueeze(2)
    return getattr(t.flatten(1), op)(dim=-1).reshape(-1, 1, 1, 1)


def static_scales(stats: RoleStats, spec: QuantSpec, role: str, source: str = "absmax") -> StaticScales:
    """Static scales for ``spec`` from calibration statistics.

    The range per channel is the abs-max (``source="absmax"``), the RoPE pair bound (``"rope"``, valid at
    positions the calibration never reached) or a percentile of magnitudes (``"p99.9"``); for asymmetric
    int it is ``[max(min, -r), min(max, r)]`` (``[-r, r]`` for ``"rope"``: rotation can give any sign). Rounding follows
    :func:`kvpack.quant.choose_qparams`, so scales made from a block's own statistics quantize it bit-exactly
    as the block-local path would. A channel that never moved gets the smallest positive stored scale (so a
    later non-zero value is counted as clipped), never a default of 1.

    Raises:
        CalibrationError: the spec cannot take static scales (per-token, per-group or passthrough), or the
            statistic is missing.
    """
    if not spec_takes_static(spec):
        raise CalibrationError(
            f"{role}s in {spec} cannot take static scales: only channel, head or tensor granularity can; "
            "per-token scales are always computed at seal time"
        )
    mag = stats.magnitude(source).float()
    tiny = 1e-30  # encode_scale lifts any positive scale to the smallest normal of the stored dtype
    if spec.has_zero:
        lo, hi = -mag, mag
        if source != "rope":
            lo, hi = torch.maximum(stats.min.float(), lo), torch.minimum(stats.max.float(), hi)
        lo, hi = _reduce_range(lo, spec, "amin"), _reduce_range(hi, spec, "amax")
        zero = encode_scale(lo, spec.zero_dtype, round_up=False)
        s = ((hi - decode_scale(zero, spec.zero_dtype)) / spec.qmax).clamp(min=tiny)
        return StaticScales(role, spec, encode_scale(s, spec.scale_dtype), zero, source)
    top = spec.dtype.fp8_max if spec.dtype.is_fp8 else spec.qmax
    s = (_reduce_range(mag, spec, "amax") / top).clamp(min=tiny)
    return StaticScales(role, spec, encode_scale(s, spec.scale_dtype), None, source)


def count_clipped(x: torch.Tensor, scales: LayerScales) -> int:
    """Elements of ``x`` ``[..., H, T, D]`` outside the range ``scales`` can represent."""
    lo, hi = scales.limits()
    xf = x.float()
    return int(((xf < lo) | (xf > hi)).sum())


def seal_with_static(x_blocks: torch.Tensor, spec: QuantSpec, scales: LayerScales) -> tuple[QuantizedTensor, int]:
    """Quantize full blocks with static scales instead of block-local ones.

    Args:
        x_blocks: ``[n, kv_heads, block_size, head_dim]`` floating point (the tails being sealed).
        spec: the spec of this role in the cache's format (``static`` or not; its quantization must match
            the one the scales were made for).
        scales: one layer's scales, from :meth:`StaticScales.layer`.

    Returns:
        ``(qt, clipped)``: ``qt`` is laid out exactly like a block-local seal (``qt.scale`` is
        ``[n, Hs, 1, Cs]``, one copy per block, so the scale pools and kernels are unchanged); ``clipped``
        counts the elements that fell outside the calibrated range and were clipped.

    Raises:
        CalibrationError: the scales were made for another spec, or another kv_heads / head_dim.
        ShapeError: ``x_blocks`` is not 4-D.
        NonFiniteError: NaN or inf in ``x_blocks`` (nothing is quantized).
    """
    if x_blocks.dim() != 4:
        raise ShapeError(f"x_blocks must be [n, kv_heads, block_size, head_dim], got {tuple(x_blocks.shape)}")
    if not same_quantization(spec, scales.spec):
        raise CalibrationError(
            f"static scales were made for {_plain(scales.spec)}, the cache stores {_plain(spec)}; "
            "recalibrate for this format (kvpack calibrate --format ...)"
        )
    n, h, _, d = x_blocks.shape
    want = spec.scale_shape(h, 1, d)
    if tuple(scales.scale.shape) != want:
        raise CalibrationError(
            f"static scales have shape {tuple(scales.scale.shape)}, blocks of {h} kv_heads x head_dim {d} need "
            f"{want}; the artifact was made for another model: recalibrate"
        )
    sdt = scale_torch_dtype(spec.scale_dtype)
    scale = scales.scale.to(device=x_blocks.device, dtype=sdt).unsqueeze(0).expand(n, *want)
    zero = None if scales.zero is None else scales.zero.to(x_blocks.device).unsqueeze(0).expand(n, *want)
    qt = quantize(x_blocks, _plain(spec), scale=scale, zero=zero)  # raises on NaN/inf before anything else
    qt = QuantizedTensor(qt.data, scale.contiguous(), None if zero is None else zero.contiguous(), spec, d)
    return qt, count_clipped(x_blocks, scales)


class ClipMonitor:
    """Per-layer clipped-value counts of static sealing: the drift detector.

    ``record`` after each seal; a :class:`CalibrationDriftWarning` fires once per layer when the layer's
    clipped fraction (cumulative over everything it sealed) passes ``threshold``. ``report`` is what a
    cache's health report shows.
    """

    def __init__(self, num_layers: int, threshold: float = DEFAULT_CLIP_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise CalibrationError(f"clip threshold is a fraction in [0, 1], got {threshold}")
        self.threshold = threshold
        self.clipped = [0] * num_layers
        self.total = [0] * num_layers
        self._warned: set[int] = set()

    def record(self, layer: int, clipped: int, total: int) -> None:
        self.clipped[layer] += int(clipped)
        self.total[layer] += int(total)
        frac = self.clipped[layer] / max(1, self.total[layer])
        if frac > self.threshold and layer not in self._warned:
            self._warned.add(layer)
            warnings.warn(
                f"layer {layer}: {self.clipped[layer]} of {self.total[layer]} sealed values ({frac:.2%}) fell "
                f"outside the calibrated range (threshold {self.threshold:.2%}); the inputs differ from the "
                "calibration text: recalibrate on representative text or use block-local scales",
                CalibrationDriftWarning,
                stacklevel=2,
            )

    def report(self) -> dict[str, object]:
        """``{"clipped": [...], "sealed": [...], "fraction": [...], "layers_over_threshold": [...]}``."""
        frac = [c / t if t else 0.0 for c, t in zip(self.clipped, self.total)]
        return {
            "clipped": list(self.clipped),
            "sealed": list(self.total),
            "fraction": frac,
            "threshold": self.threshold,
            "layers_over_threshold": [i for i, f in enumerate(frac) if f > self.threshold],
        }


def require_static_scales(fmt: KVFormat, scales: object | None) -> None:
    """Fail closed, before anything is built: a format with ``static`` specs and no scales is refused, and so
    are scales given for a format without ``static`` specs (they would be ignored)."""
    if not fmt.is_static and scales is not None:
        raise CalibrationError(
            f"format {fmt.name!r} takes no static scales (no spec is marked 'static'), so the calibration given "
            "would be ignored; drop it, or mark the key spec static, e.g. 'k=int8:channel:static,v=int8:token'"
        )
    if fmt.is_static and scales is None:
        roles = [r for r, s in (("keys", fmt.key), ("values", fmt.value)) if s.static]
        raise CalibrationError(
            f"format {fmt.name!r} takes static (calibrated) scales for {' and '.join(roles)} and no calibration "
            "artifact was given; run `kvpack calibrate --format ... --out DIR` and pass the artifact, or drop "
            "'static' to use block-local scales (no scale is ever defaulted)"
        )
