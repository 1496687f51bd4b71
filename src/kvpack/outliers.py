"""Outlier key channels at seal time, in pure torch: the semantic reference for ``QuantSpec.outliers``.

A few key channels per head run much larger than the rest, for every token. A key spec with
``outliers=k`` keeps ``k`` channels per kv head of each sealed block in full precision:

1. choose the channels: the block's ``k`` largest by abs-max over its tokens (:func:`seal_time_channels`),
   or given (a calibration artifact's top-k per layer and head, copied into every block);
2. overwrite the kept channels with a *neutral fill* (the smallest unmasked value of their scale group, 0
   where the whole group is kept) so the remainder's scales ignore the outliers, then quantize as usual;
3. store the fp16 *residual* ``x - dequantize(payload)`` at the kept channels.

Reconstruction: ``k = dequantize(payload); k[..., idx] += residual.float()`` (:func:`apply_residual`); a
kernel adds ``sum_j q[idx_j] * residual[t, j]`` to the score of token ``t``. Because the residual is taken
against the stored payload, it also works with static (calibrated) scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpack.errors import ShapeError
from kvpack.formats import QuantSpec
from kvpack.quant import QuantizedTensor, _raise_non_finite, dequantize, quantize

__all__ = [
    "OutlierBlocks",
    "apply_residual",
    "check_channels",
    "dequantize_outliers",
    "fill_outliers",
    "index_dtype",
    "neutral_fill",
    "outlier_mask",
    "outlier_residual",
    "quantize_outliers",
    "seal_time_channels",
]


_FP16_MAX = torch.finfo(torch.float16).max


def index_dtype(head_dim: int) -> torch.dtype:
    """Storage dtype of outlier channel indices: uint8 up to head_dim 256, int16 past it."""
    return torch.uint8 if head_dim <= 256 else torch.int16


def seal_time_channels(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest channels per head of each block (abs-max over the block's tokens).

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float, finite.
        k: channels kept per head, ``0 <= k <= head_dim``.

    Returns:
        ``[..., kv_heads, k]`` int64 channel indices, ascending.
    """
    if not 0 <= k <= x.shape[-1]:
        raise ShapeError(f"k must be in [0, head_dim={x.shape[-1]}], got {k}")
    return x.float().abs().amax(-2).topk(k, dim=-1).indices.sort(dim=-1).values


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


def neutral_fill(x: torch.Tensor, mask: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` ``[..., H, T, D]`` float32 with masked elements replaced by the smallest unmasked value of their
    scale group (0 where the whole group is masked), so the remainder's scales ignore the outliers."""
    h, t, d = x.shape[-3:]
    hs, ts, cs = spec.scale_shape(h, t, d)
    lead = x.shape[:-3]
    grouped = torch.where(mask, torch.full_like(x, float("inf")), x).reshape(
        *lead, hs, h // hs, ts, t // ts, cs, d // cs
    )
    fill = grouped.amin(dim=(-1, -3, -5), keepdim=True).expand_as(grouped).reshape(x.shape)
    fill = torch.where(torch.isinf(fill), torch.zeros_like(fill), fill)
    return torch.where(mask, fill, x)


def _expand_idx(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Indices ``[..., H, k]`` (or ``[H, k]``) as int64 ``[..., H, T, k]`` to gather from / scatter into ``like``."""
    idx = idx.to(like.device).long()
    return idx.unsqueeze(-2).expand(*like.shape[:-1], idx.shape[-1])


def apply_residual(x: torch.Tensor, residual: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` with ``residual`` added at the kept channels: ``x[..., idx] += residual.float()`` (a new tensor).

    Args:
        x: ``[..., H, T, D]`` float32, a dequantized payload.
        residual: ``[..., H, T, k]`` float16.
        idx: ``[..., H, k]`` uint8/int16/int64 ascending channel indices (or ``[H, k]``, shared).
    """
    return x.scatter_add(-1, _expand_idx(idx, x), residual.to(x.dtype))


@dataclass
class OutlierBlocks:
    """Key blocks sealed with outlier channels: the quantized payload plus the fp16 residuals and indices.

    Attributes:
        qt: the payload and scales, ``[..., H, T, D]`` logical shape, the spec's normal layout (the kept
            channels hold the quantized neutral fill).
        residual: ``[..., H, T, k]`` float16, ``x - dequantize(qt)`` at the kept channels.
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
    """Step 2 of a seal: ``x`` ``[..., H, T, D]`` as float32 with the kept ``channels`` neutrally filled.

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (checked first: a fill must never hide one).
        ShapeError: ``channels`` do not fit ``x``.
    """
    if not torch.isfinite(x).all():
        _raise_non_finite(x)
    check_channels(channels, x)
    xf = x.float()
    return neutral_fill(xf, outlier_mask(channels, xf), spec)


def outlier_residual(x: torch.Tensor, qt: QuantizedTensor, channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 of a seal: the stored residuals and indices of the kept channels.

    Args:
        x: ``[..., H, T, D]`` the original (unfilled) blocks.
        qt: the quantized filled blocks.
        channels: ``[H, k]`` or ``[..., H, k]`` integer indices.

    Returns:
        ``(residual, idx)``: ``[..., H, T, k]`` float16 ``x - dequantize(qt)`` at the kept channels (saturated
        at the fp16 range, never inf), and ``[..., H, k]`` indices in :func:`index_dtype`.
    """
    xf = x.float()
    gidx = _expand_idx(channels, xf)
    residual = xf.gather(-1, gidx) - dequantize(qt).gather(-1, gidx)
    residual = residual.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)  # saturate like the fp8 casts
    k = channels.shape[-1]
    idx = channels.to(x.device).expand(*x.shape[:-2], k).to(index_dtype(x.shape[-1])).contiguous()
    return residual.contiguous(), idx


def quantize_outliers(
    x: torch.Tensor,
    spec: QuantSpec,
    channels: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    k: int | None = None,
) -> OutlierBlocks:
    """Seal ``x`` keeping ``k`` channels per head as fp16 residuals (choose, fill, quantize, residual).

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float (one or more blocks).
        spec: the key spec (a ``static`` one needs ``scale``/``zero``).
        channels: ``[kv_heads, k]`` (calibrated, copied into each block) or ``[..., kv_heads, k]`` integer
            indices; ``None`` chooses them per block (:func:`seal_time_channels`).
        scale, zero: stored scales ``[..., Hs, Ts, Cs]``; ``None`` chooses them from the filled blocks.
        k: channels per head when ``channels`` is ``None`` (default ``spec.outliers``).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (checked before anything is filled).
        ShapeError: ``channels`` does not match ``x`` or ``k`` is out of range.
    """
    if not torch.isfinite(x).all():
        _raise_non_finite(x)
    if channels is None:
        channels = seal_time_channels(x, spec.outliers if k is None else k)
    filled = fill_outliers(x, spec, channels)
    qt = quantize(filled, spec, scale, zero)  # a static spec without scales is refused (CalibrationError)
    residual, idx = outlier_residual(x, qt, channels)
    return OutlierBlocks(qt, residual, idx)


def dequantize_outliers(ob: OutlierBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., H, T, D]``: ``dequantize(payload)`` with the residuals added at the kept channels."""
    return apply_residual(dequantize(ob.qt, torch.float32), ob.residual, ob.idx).to(dtype)
