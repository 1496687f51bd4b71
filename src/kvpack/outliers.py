"""Outlier key channels at seal time, in pure torch: the semantic reference for ``QuantSpec.outliers``.

A few key channels per head run much larger than the rest, for every token. A key spec with
``outliers=k`` keeps ``k`` channels per kv head of each sealed block in full precision:

1. choose the channels: the block's ``k`` largest by abs-max over its tokens (:func:`seal_time_channels`),
   or, for ``o<k>q``, by the queries' energy times the channel's squared spread in the block
   (:func:`query_ranked_channels`), or given (a calibration artifact's top-k per layer and head, copied into
   every block);
2. quantize with the kept channels left out of the scales (:func:`quantize_kept`): scales come from the
   block with the kept channels *neutrally filled* (:func:`neutral_fill`), and each kept element stores
   whichever code makes it reconstruct best (the fill's, or its own clipped to the scales' range);
3. store the fp16 *residual* ``x - dequantize(payload)`` at the kept channels, or, for a ``refined`` spec
   (``o<k>r``), a 4-bit code of it on a grid of the channel's own scale step (:func:`refine`): each kept
   element keeps its own payload code, and its residual, within half a step, is stored as ``u`` with
   ``residual = (u - 7.5) * s / 16`` (:func:`unrefine`).

Reconstruction: ``k = dequantize(payload); k[..., idx] += residual.float()`` (:func:`apply_residual`); a
kernel adds ``sum_j q[idx_j] * residual[t, j]`` to the score of token ``t`` (refined: ``sum_j q[idx_j] *
s[idx_j] * (u[t, j] - 7.5) / 16``, the query with the key scales folded in). Because the residual is taken
against the stored payload, it also works with static (calibrated) scales.

The guarantee: every kept channel of a block reconstructs with a largest error (over the block's tokens) no
larger than the spec without outliers gives it, for every finite input; a symmetric spec reconstructs kept
fp16 values exactly. A residual past the fp16 range saturates only where that is still no worse: otherwise
the scale groups of that channel are sealed as the spec without outliers seals them. A refined spec's kept
elements reconstruct within 1/32 of their channel's step (the spec without outliers: within 1/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpack.errors import CalibrationError, ShapeError
from kvpack.formats import QuantSpec
from kvpack.quant import QuantizedTensor, _raise_non_finite, choose_qparams, decode_scale, dequantize, quantize

__all__ = [
    "OutlierBlocks",
    "apply_kept",
    "apply_residual",
    "artifact_outlier_channels",
    "check_channels",
    "dequantize_outliers",
    "fill_outliers",
    "index_dtype",
    "kept_steps",
    "neutral_fill",
    "outlier_mask",
    "outlier_residual",
    "quantize_kept",
    "quantize_outliers",
    "query_ranked_channels",
    "refine",
    "residual_dtype",
    "seal_time_channels",
    "select_outlier_channels",
    "unrefine",
]


_FP16_MAX = torch.finfo(torch.float16).max


def index_dtype(head_dim: int) -> torch.dtype:
    """Storage dtype of outlier channel indices: uint8 up to head_dim 256, int16 past it."""
    return torch.uint8 if head_dim <= 256 else torch.int16


def seal_time_channels(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest channels per head of each block (abs-max over the block's tokens; ties to the lower).

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float, finite.
        k: channels kept per head, ``0 <= k <= head_dim``.

    Returns:
        ``[..., kv_heads, k]`` int64 channel indices, ascending.
    """
    if not 0 <= k <= x.shape[-1]:
        raise ShapeError(f"k must be in [0, head_dim={x.shape[-1]}], got {k}")
    # ties to the lower channel (a stable order, as the compiled seal breaks them: the same bytes either way)
    order = torch.argsort(x.float().abs().amax(-2), dim=-1, descending=True, stable=True)
    return order[..., :k].sort(dim=-1).values


def query_ranked_channels(x: torch.Tensor, k: int, energy: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """The ``k`` channels per head of each block whose quantization error the queries read most.

    An int channel's error in a block grows with its spread there (the range ``max - min`` for an asymmetric
    spec, ``2 * abs-max`` for a symmetric one), and reaches the score ``q . k`` weighted by the query in that
    channel: channels are ranked by ``energy * spread^2``. Ties (channels no query reads) fall to the wider one.

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float, finite.
        k: channels kept per head, ``0 <= k <= head_dim``.
        energy: ``[kv_heads, head_dim]`` (or ``[..., kv_heads, head_dim]``) float32, ``>= 0``, finite: the
            queries' mean square per channel, averaged over each kv head's query heads.
        symmetric: the key spec is symmetric.

    Returns:
        ``[..., kv_heads, k]`` int64 channel indices, ascending.
    """
    d = x.shape[-1]
    if not 0 <= k <= d:
        raise ShapeError(f"k must be in [0, head_dim={d}], got {k}")
    if energy.shape[-2:] != x.shape[-3:-2] + x.shape[-1:]:
        raise ShapeError(
            f"query energy must be [..., kv_heads, head_dim] = [..., {x.shape[-3]}, {d}], got {tuple(energy.shape)}"
        )
    xf = x.float()
    spread = 2 * xf.abs().amax(-2) if symmetric else xf.amax(-2) - xf.amin(-2)  # [..., H, D]
    score = energy.to(xf.device, torch.float32) * spread.square()
    # ties in the score (energy 0) fall to the wider channel: sort by spread, then stably by score
    order = torch.argsort(spread, dim=-1, descending=True, stable=True)
    order = order.gather(-1, torch.argsort(score.gather(-1, order), dim=-1, descending=True, stable=True))
    return order[..., :k].sort(dim=-1).values


def outlier_mask(channels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Boolean ``like.shape`` ``[..., H, T, D]`` mask of the kept channels.

    Args:
        channels: ``[..., H, k]`` (per block) or ``[H, k]`` (shared by all blocks), integer indices.
        like: ``[..., H, T, D]``.
    """
    *lead, h, t, d = like.shape
    idx = channels.to(like.device).long()
    m = torch.zeros((*idx.shape[:-1], d), dtype=torch.bool, device=like.device)
    m.scatter_(-1, idx, True)  # [..., H, D]
    return m.unsqueeze(-2).expand(*lead, h, t, d)


def _group_view(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View ``[..., H, T, D]`` as ``[..., Hs, H/Hs, Ts, T/Ts, Cs, D/Cs]``: the spec's scale groups."""
    *lead, h, t, d = x.shape
    hs, ts, cs = spec.scale_shape(h, t, d)
    return x.reshape(*lead, hs, h // hs, ts, t // ts, cs, d // cs)


def _group_reduce(x: torch.Tensor, spec: QuantSpec, op: str) -> torch.Tensor:
    """Reduce float ``[..., H, T, D]`` over each scale group with ``op`` (``"amin"``/``"amax"``) to
    ``[..., Hs, Ts, Cs]``."""
    return getattr(_group_view(x, spec), op)(dim=(-1, -3, -5))


def _per_group(x: torch.Tensor, spec: QuantSpec, op: str) -> torch.Tensor:
    """Reduce float ``[..., H, T, D]`` over each scale group with ``op`` and broadcast back to ``[..., H, T, D]``."""
    g = _group_view(x, spec)
    return getattr(g, op)(dim=(-1, -3, -5), keepdim=True).expand_as(g).reshape(x.shape)


def neutral_fill(x: torch.Tensor, mask: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` ``[..., H, T, D]`` float32 with the masked (kept) elements replaced by a value that cannot widen
    their scale group's range: 0 for a symmetric spec (it quantizes to code 0, which dequantizes to exactly
    0), the nearest value of the group's unmasked range ``[min, max]`` for an asymmetric one; 0 where the
    whole group is masked.

    Args:
        x: ``[..., H, T, D]`` float32.
        mask: ``[..., H, T, D]`` bool, True at the kept channels.
        spec: the key spec (its granularity gives the scale groups).
    """
    if not spec.has_zero:
        return torch.where(mask, torch.zeros_like(x), x)
    inf = torch.full_like(x, float("inf"))
    lo = _per_group(torch.where(mask, inf, x), spec, "amin")  # +inf where the whole group is masked
    hi = _per_group(torch.where(mask, -inf, x), spec, "amax")
    fill = torch.where(torch.isinf(lo), torch.zeros_like(x), torch.minimum(torch.maximum(x, lo), hi))
    return torch.where(mask, fill, x)


def _expand_idx(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Indices ``[..., H, k]`` (or ``[H, k]``) as int64 ``[..., H, T, k]`` to gather from / scatter into ``like``."""
    idx = idx.to(like.device).long()
    return idx.unsqueeze(-2).expand(*like.shape[:-1], idx.shape[-1])


def residual_dtype(spec: QuantSpec) -> torch.dtype:
    """Dtype of a key spec's stored residuals: ``torch.uint8`` (packed refinement codes) when ``refined``,
    else ``torch.float16``."""
    return torch.uint8 if spec.refined else torch.float16


# A refinement code u in [0, 16) stands for the residual (u - REFINE_MID) * step / REFINE_LEVELS
REFINE_LEVELS = 16
REFINE_MID = 7.5


def kept_steps(scale: torch.Tensor, spec: QuantSpec, idx: torch.Tensor) -> torch.Tensor:
    """The kept channels' own scale steps: float32 ``[..., H, 1, k]`` from stored per-channel block scales
    ``scale`` ``[..., H, 1, D]`` (the spec's scale dtype) at ``idx`` ``[..., H, k]`` (or ``[H, k]``)."""
    steps = decode_scale(scale, spec.scale_dtype)
    at = idx.to(scale.device).long().unsqueeze(-2)
    return steps.gather(-1, at.expand(*steps.shape[:-1], at.shape[-1]))


def refine(residual: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Refinement codes of residuals within half a step: ``u = clamp(floor(r / step * 16 + 8), 0, 15)``, so
    ``(u - 7.5) * step / 16`` is within ``step / 32`` of ``r`` (a zero step codes 8, which decodes to 0).

    Args:
        residual: ``[..., H, T, k]`` float, ``x - dequantize(payload)`` at the kept channels.
        step: ``[..., H, 1, k]`` float32, their scale steps (:func:`kept_steps`).

    Returns:
        ``[..., H, T, ceil(k / 2)]`` uint8: channel ``j`` in byte ``j // 2``, the low nibble for even ``j``.
    """
    r = residual.float()
    u = torch.where(step > 0, torch.floor(r / step * REFINE_LEVELS + REFINE_LEVELS / 2), REFINE_LEVELS / 2)
    u = u.nan_to_num(REFINE_LEVELS / 2).clamp(0, REFINE_LEVELS - 1).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1))
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unrefine(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The residuals that packed refinement ``codes`` ``[..., H, T, ceil(k / 2)]`` uint8 stand for: float32
    ``[..., H, T, k]``, ``(u - 7.5) * step / 16`` with ``step`` ``[..., H, 1, k]`` float32."""
    k = step.shape[-1]
    u = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)[..., :k].float()
    return (u - REFINE_MID) * (step / REFINE_LEVELS)


def apply_residual(
    x: torch.Tensor, residual: torch.Tensor, idx: torch.Tensor, step: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` with ``residual`` added at the kept channels: ``x[..., idx] += residual.float()`` (a new tensor).

    Args:
        x: ``[..., H, T, D]`` float32, a dequantized payload.
        residual: ``[..., H, T, k]`` float16, or ``[..., H, T, ceil(k / 2)]`` uint8 refinement codes.
        idx: ``[..., H, k]`` uint8/int16/int64 ascending channel indices (or ``[H, k]``, shared).
        step: ``[..., H, 1, k]`` float32, the kept channels' scale steps (:func:`kept_steps`): refinement codes
            need them.

    Raises:
        ShapeError: refinement codes without ``step``.
    """
    if residual.dtype == torch.uint8:
        if step is None:
            raise ShapeError("refinement codes (uint8 residuals) need the kept channels' scale steps: pass step")
        residual = unrefine(residual, step)
    return x.scatter_add(-1, _expand_idx(idx, x), residual.to(x.dtype))


def apply_kept(
    x: torch.Tensor, residual: torch.Tensor, idx: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None
) -> torch.Tensor:
    """:func:`apply_residual` for stored blocks of key spec ``spec``: refinement codes take their steps from the
    blocks' stored per-channel scales ``scale`` ``[..., H, 1, D]`` (unread for fp16 residuals)."""
    step = kept_steps(scale, spec, idx) if spec.refined else None
    return apply_residual(x, residual, idx, step)


@dataclass
class OutlierBlocks:
    """Key blocks sealed with outlier channels: the quantized payload plus the residuals and indices.

    Attributes:
        qt: the payload and scales, ``[..., H, T, D]`` logical shape, the spec's normal layout (the kept
            channels hold the quantized neutral fill).
        residual: ``[..., H, T, k]`` float16, ``x - dequantize(qt)`` at the kept channels; for a refined spec
            ``[..., H, T, ceil(k / 2)]`` uint8 refinement codes of it (:func:`refine`).
        idx: ``[..., H, k]``, dtype :func:`index_dtype`, ascending channel indices.
    """

    qt: QuantizedTensor
    residual: torch.Tensor
    idx: torch.Tensor

    def nbytes(self) -> int:
        """Stored bytes: payload, scales, zero-points, residuals and indices."""
        return self.qt.nbytes() + sum(t.numel() * t.element_size() for t in (self.residual, self.idx))


def check_channels(channels: torch.Tensor, x: torch.Tensor) -> None:
    """Raise :class:`ShapeError` unless ``channels`` (``[H, k]`` or ``[..., H, k]``) fit ``x`` ``[..., H, T, D]``."""
    if channels.dim() not in (2, x.dim() - 1) or channels.shape[-2] != x.shape[-3]:
        raise ShapeError(
            f"outlier channels {tuple(channels.shape)} do not match blocks {tuple(x.shape)}: "
            "expected [kv_heads, k] or [..., kv_heads, k]"
        )
    d = x.shape[-1]
    if channels.numel() and (int(channels.min()) < 0 or int(channels.max()) >= d):
        raise ShapeError(
            f"outlier channel indices must lie in [0, {d}), got {int(channels.min())}..{int(channels.max())}"
        )


def fill_outliers(x: torch.Tensor, spec: QuantSpec, channels: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., H, T, D]`` as float32 with the kept ``channels`` neutrally filled (what the scales and the
    static clip count are taken on).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (checked first: a fill must never hide one).
        ShapeError: ``channels`` do not fit ``x``.
    """
    if not torch.isfinite(x).all():
        _raise_non_finite(x)
    check_channels(channels, x)
    xf = x.float()
    return neutral_fill(xf, outlier_mask(channels, xf), spec)


def _residual(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """fp16 ``x - base`` ``[..., H, T, D]``, saturated at the fp16 range (never inf)."""
    return (x - base).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def _kept_error(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """float64 ``|x - (base + residual)|`` ``[..., H, T, D]``: the error a kept element reconstructs with
    when its payload dequantizes to ``base`` (the sum is taken in float32, as :func:`apply_residual` does)."""
    rec = base + _residual(x, base).float()
    return (x.double() - rec.double()).abs()


def outlier_residual(x: torch.Tensor, qt: QuantizedTensor, channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 of a seal: the stored residuals and indices of the kept channels.

    Args:
        x: ``[..., H, T, D]`` the original (unfilled) blocks.
        qt: the quantized blocks (:func:`quantize_kept`).
        channels: ``[H, k]`` or ``[..., H, k]`` integer indices.

    Returns:
        ``(residual, idx)``: ``[..., H, T, k]`` float16 ``x - dequantize(qt)`` at the kept channels (saturated
        at the fp16 range, never inf), or for a refined spec its ``[..., H, T, ceil(k / 2)]`` uint8 refinement
        codes (:func:`refine`), and ``[..., H, k]`` indices in :func:`index_dtype`.
    """
    xf = x.float()
    gidx = _expand_idx(channels, xf)
    k = channels.shape[-1]
    idx = channels.to(x.device).expand(*x.shape[:-2], k).to(index_dtype(x.shape[-1])).contiguous()
    if qt.spec.refined:
        residual = refine(xf.gather(-1, gidx) - dequantize(qt).gather(-1, gidx), kept_steps(qt.scale, qt.spec, idx))
    else:
        residual = _residual(xf.gather(-1, gidx), dequantize(qt).gather(-1, gidx))
    return residual.contiguous(), idx


def quantize_kept(
    x: torch.Tensor,
    spec: QuantSpec,
    channels: torch.Tensor,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Step 2 of a seal: the payload of ``x`` with the kept ``channels``, chosen so that every kept channel
    reconstructs (payload + fp16 residual) at least as well as the spec without outliers gives it.

    1. Scales: given (static), or chosen from the neutrally filled blocks (:func:`neutral_fill`), so the
       kept channels cannot widen them; a scale group that holds only kept elements gets the scales of its
       own values (nothing else reads them).
    2. Each kept element's code is the better of two: the fill's (0 for a symmetric spec: the residual is
       then ``x`` itself, exact for every fp16 value) and ``x``'s own, clipped to the scales' range (the
       code the spec without outliers stores under the same scales).
    3. Block-local scales only: where a kept channel's largest error over the block's tokens would still
       exceed the spec without outliers' (a residual past the fp16 range), the scale groups holding that
       channel are sealed as that spec seals them (its scales, ``x``'s codes): the residuals are then the
       plain quantization error, which the fp16 rounding can only shrink.

    Args:
        x: ``[..., H, T, D]`` float, finite.
        spec: the key spec.
        channels: ``[H, k]`` or ``[..., H, k]`` integer indices.
        scale, zero: stored scales ``[..., Hs, Ts, Cs]``; ``None`` chooses them (block-local).

    Returns:
        The quantized ``[..., H, T, D]`` payload, scales and zero-points.
    """
    xf = x.float()
    mask = outlier_mask(channels, xf)
    filled = neutral_fill(xf, mask, spec)
    local = scale is None
    if local:
        scale, zero = choose_qparams(filled, spec)
        own_s, own_z = choose_qparams(xf, spec)  # the spec without outliers
        only_kept = _group_reduce(mask.float(), spec, "amin") > 0  # [..., Hs, Ts, Cs]
        scale = torch.where(only_kept, own_s, scale)
        zero = None if zero is None else torch.where(only_kept, own_z, zero)
    base_fill = dequantize(quantize(filled, spec, scale, zero))
    base_own = dequantize(quantize(xf, spec, scale, zero))
    # a refinement code reaches half a step around the element's own code only: kept elements keep their own
    use_own = mask & ((_kept_error(xf, base_own) < _kept_error(xf, base_fill)) | spec.refined)
    payload = torch.where(use_own, xf, filled)
    if local:
        # per kept channel (its largest error over the block's tokens): never worse than without outliers
        plain_err = torch.where(mask, (xf.double() - dequantize(quantize(xf, spec, own_s, own_z)).double()).abs(), 0)
        base = torch.where(use_own, base_own, base_fill)
        kept_err = torch.where(mask, _kept_error(xf, base), 0)
        worse = mask & (kept_err.amax(-2, keepdim=True) > plain_err.amax(-2, keepdim=True))  # [..., H, T, D]
        fall_back = _group_reduce(worse.float(), spec, "amax") > 0  # [..., Hs, Ts, Cs]
        if fall_back.any():
            scale = torch.where(fall_back, own_s, scale)
            zero = None if zero is None else torch.where(fall_back, own_z, zero)
            payload = torch.where(_per_group(worse.float(), spec, "amax") > 0, xf, payload)
    return quantize(payload, spec, scale, zero)


def quantize_outliers(
    x: torch.Tensor,
    spec: QuantSpec,
    channels: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    k: int | None = None,
) -> OutlierBlocks:
    """Seal ``x`` keeping ``k`` channels per head as fp16 residuals (choose, quantize, residual).

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float (one or more blocks).
        spec: the key spec (a ``static`` one needs ``scale``/``zero``).
        channels: ``[kv_heads, k]`` (calibrated, copied into each block) or ``[..., kv_heads, k]`` integer
            indices; ``None`` chooses them per block (:func:`seal_time_channels`).
        scale, zero: stored scales ``[..., Hs, Ts, Cs]``; ``None`` chooses them (:func:`quantize_kept`).
        k: channels per head when ``channels`` is ``None`` (default ``spec.outliers``).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (checked before anything is filled).
        ShapeError: ``channels`` does not match ``x`` or ``k`` is out of range.
        CalibrationError: a ``static`` spec without ``scale``.
    """
    if not torch.isfinite(x).all():
        _raise_non_finite(x)
    if channels is None:
        channels = seal_time_channels(x, spec.outliers if k is None else k)
    check_channels(channels, x)
    qt = quantize_kept(x, spec, channels, scale, zero)  # a static spec without scales: CalibrationError
    residual, idx = outlier_residual(x, qt, channels)
    return OutlierBlocks(qt, residual, idx)


def dequantize_outliers(ob: OutlierBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., H, T, D]``: ``dequantize(payload)`` with the residuals added at the kept channels."""
    return apply_kept(dequantize(ob.qt, torch.float32), ob.residual, ob.idx, ob.qt.spec, ob.qt.scale).to(dtype)


# Calibrated channels: the top-k per layer and head of a calibration artifact, copied into every sealed block.


def select_outlier_channels(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest channels per head, from calibration.

    Args:
        magnitude: ``[kv_heads, head_dim]`` float, a per-channel range (abs-max or a percentile).
        k: channels kept per head, ``0 <= k <= head_dim``.

    Returns:
        ``[kv_heads, k]`` int64 channel indices, ascending within each head.
    """
    if magnitude.dim() != 2:
        raise ShapeError(f"magnitude must be [kv_heads, head_dim], got {tuple(magnitude.shape)}")
    if not 0 <= k <= magnitude.shape[-1]:
        raise ShapeError(f"k must be in [0, head_dim={magnitude.shape[-1]}], got {k}")
    return magnitude.float().topk(k, dim=-1).indices.sort(dim=-1).values


def artifact_outlier_channels(artifact, k: int, num_layers: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The calibrated outlier channels of every layer: ``[num_layers, kv_heads, k]`` int64, ascending.

    Ranks channels by the artifact's observed key abs-max (``keys.absmax``, after RoPE).

    Args:
        artifact: a :class:`~kvpack.calibration.Artifact`.
        k: channels kept per kv head.
        num_layers, kv_heads, head_dim: the cache geometry the artifact must have been made for.

    Raises:
        CalibrationError: the artifact's key statistics have another shape (another model), or hold
            non-finite values.
    """
    mag = artifact.keys.absmax
    want = (num_layers, kv_heads, head_dim)
    if tuple(mag.shape) != want:
        raise CalibrationError(
            f"the calibration artifact's key statistics have shape {tuple(mag.shape)}, this cache needs "
            f"layers x kv_heads x head_dim = {want}: the artifact was made for another model; recalibrate"
        )
    if not bool(torch.isfinite(mag).all()):
        raise CalibrationError("the calibration artifact's key abs-max holds non-finite values; recalibrate")
    return torch.stack([select_outlier_channels(mag[layer], k) for layer in range(num_layers)])
