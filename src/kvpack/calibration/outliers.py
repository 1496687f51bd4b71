"""Outlier key channels from calibration: the top-k channels per layer and head of an artifact.

The seal-level logic (choose per block, neutral fill, quantize, fp16 residual) lives in
:mod:`kvpack.outliers` and is what the paged cache runs for a key spec with ``outliers=k``
(``k=fp8:head:o4``, preset ``fp8-o4``). This module adds the calibrated choice: a calibration artifact
observes every key channel's range per layer and head, and :func:`select_outlier_channels` keeps the
``k`` largest; :func:`artifact_outlier_channels` does that for every layer, which is what
``PagedKVCache(calibration=artifact)`` copies into each sealed block.

:func:`quantize_with_outliers` / :func:`dequantize_with_outliers` are the quant-level entry points used by
:mod:`kvpack.calibration.compare`; they produce exactly the cache's bytes (indices stored per block).
"""

from __future__ import annotations

import torch

from kvpack.errors import CalibrationError, ShapeError
from kvpack.formats import QuantSpec
from kvpack.outliers import (
    OutlierBlocks,
    dequantize_outliers,
    outlier_mask,
    quantize_outliers,
    seal_time_channels,
)

__all__ = [
    "OutlierQuantized",
    "artifact_outlier_channels",
    "dequantize_with_outliers",
    "outlier_mask",
    "quantize_with_outliers",
    "seal_time_channels",
    "select_outlier_channels",
]

OutlierQuantized = OutlierBlocks  # the name this module used before the cache stored outliers


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


def quantize_with_outliers(x: torch.Tensor, spec: QuantSpec, channels: torch.Tensor | None = None) -> OutlierBlocks:
    """Keep ``channels`` of ``x`` ``[..., kv_heads, block_size, head_dim]`` as fp16 residuals and quantize the
    rest with ``spec`` (block-local scales), exactly as the cache seals: see
    :func:`kvpack.outliers.quantize_outliers`. ``channels`` ``[kv_heads, k]`` or ``[..., kv_heads, k]``;
    ``None`` chooses ``spec.outliers`` per block."""
    return quantize_outliers(x, spec, channels)


def dequantize_with_outliers(oq: OutlierBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., H, T, D]``: the dequantized payload with the residuals added at the kept channels."""
    return dequantize_outliers(oq, dtype)
