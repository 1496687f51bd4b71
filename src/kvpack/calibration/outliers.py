"""Outlier key channels kept in full precision: a quant-level measurement, not yet a cache format.

A few key channels per head run much larger than the rest, for every token. Keeping the top-k of them
dense (fp16) and quantizing the rest changes two things: under per-token (or per-group) key scales the
outliers no longer dictate the scale of every other channel, and under per-channel scales the largest
absolute errors (the outlier channels' own) disappear.

:func:`quantize_with_outliers` splits a block into the dense outlier columns plus a quantized remainder
that keeps the normal block layout (the outlier columns are overwritten with a value that cannot widen
their scale group's range, so a kernel could read the block as usual and patch k columns);
:meth:`OutlierQuantized.nbytes` counts every stored byte: payload (including the neutralized columns),
scales, zero-points, the fp16 outlier columns and their channel indices.

The channels come from calibration (:func:`select_outlier_channels`, one index list per layer and head,
stored once per layer) or are chosen at seal time per block (:func:`seal_time_channels`, indices stored
per block). The paged cache and the kernels do not support this layout yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpack.errors import ShapeError
from kvpack.formats import QuantSpec
from kvpack.quant import QuantizedTensor, dequantize, quantize

__all__ = [
    "OutlierQuantized",
    "dequantize_with_outliers",
    "outlier_mask",
    "quantize_with_outliers",
    "seal_time_channels",
    "select_outlier_channels",
]


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


def seal_time_channels(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest channels per head of each block, chosen at seal time.

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float.

    Returns:
        ``[..., kv_heads, k]`` int64, ascending.
    """
    if not 0 <= k <= x.shape[-1]:
        raise ShapeError(f"k must be in [0, head_dim={x.shape[-1]}], got {k}")
    return x.float().abs().amax(-2).topk(k, dim=-1).indices.sort(dim=-1).values


def outlier_mask(channels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Boolean ``like.shape`` ``[..., H, T, D]`` mask of the outlier channels (``channels`` ``[..., H, k]``
    per block, or ``[H, k]`` shared by all blocks)."""
    *lead, h, t, d = like.shape
    idx = channels.to(like.device)
    m = torch.zeros((*idx.shape[:-1], d), dtype=torch.bool, device=like.device)
    m.scatter_(-1, idx, True)  # [..., H, D]
    return m.unsqueeze(-2).expand(*lead, h, t, d)


def _neutral_fill(x: torch.Tensor, mask: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` with masked elements replaced by the smallest unmasked value of their scale group (0 where the
    whole group is masked), so the remainder's scales ignore the outliers."""
    h, t, d = x.shape[-3:]
    hs, ts, cs = spec.scale_shape(h, t, d)
    lead = x.shape[:-3]
    grouped = torch.where(mask, torch.full_like(x, float("inf")), x).reshape(
        *lead, hs, h // hs, ts, t // ts, cs, d // cs
    )
    fill = grouped.amin(dim=(-1, -3, -5), keepdim=True).expand_as(grouped).reshape(x.shape)
    fill = torch.where(torch.isinf(fill), torch.zeros_like(fill), fill)
    return torch.where(mask, fill, x)


@dataclass
class OutlierQuantized:
    """A key block stored as dense outlier columns plus a quantized remainder.

    Attributes:
        rest: the remainder, ``[..., H, T, D]`` logical shape, the spec's normal layout.
        outliers: ``[..., H, T, k]`` fp16, the kept columns.
        channels: ``[H, k]`` (calibrated, shared by every block of a layer) or ``[..., H, k]`` (per block).
        per_block_channels: whether the indices are stored with each block.
    """

    rest: QuantizedTensor
    outliers: torch.Tensor
    channels: torch.Tensor
    per_block_channels: bool

    @property
    def index_bytes(self) -> int:
        """Bytes of the channel indices: uint8 when head_dim <= 256, int16 otherwise."""
        width = 1 if self.rest.head_dim <= 256 else 2
        return self.channels.numel() * width

    def nbytes(self, include_shared_indices: bool = False) -> int:
        """Stored bytes of the blocks: remainder payload + scales + zero-points + fp16 outliers, plus the
        indices when they are per block (or when ``include_shared_indices``)."""
        n = self.rest.nbytes() + self.outliers.numel() * self.outliers.element_size()
        if self.per_block_channels or include_shared_indices:
            n += self.index_bytes
        return n


def quantize_with_outliers(
    x: torch.Tensor, spec: QuantSpec, channels: torch.Tensor, outlier_dtype: torch.dtype = torch.float16
) -> OutlierQuantized:
    """Keep ``channels`` of ``x`` dense, quantize the rest with ``spec`` (block-local scales).

    Args:
        x: ``[..., kv_heads, block_size, head_dim]`` float (one or more blocks).
        spec: the remainder's spec (not static).
        channels: ``[kv_heads, k]`` or ``[..., kv_heads, k]`` int64 indices.
        outlier_dtype: storage of the kept columns.
    """
    if channels.shape[-2] != x.shape[-3]:
        raise ShapeError(f"channels {tuple(channels.shape)} do not match {x.shape[-3]} kv_heads")
    mask = outlier_mask(channels, x)
    rest = quantize(_neutral_fill(x.float(), mask, spec), spec)
    idx = channels.to(x.device).unsqueeze(-2).expand(*x.shape[:-1], channels.shape[-1])
    outliers = torch.gather(x, -1, idx).to(outlier_dtype)
    return OutlierQuantized(rest, outliers.contiguous(), channels, per_block_channels=channels.dim() > 2)


def dequantize_with_outliers(oq: OutlierQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., H, T, D]``: the dequantized remainder with the dense columns put back."""
    x = dequantize(oq.rest, torch.float32)
    idx = oq.channels.to(x.device).unsqueeze(-2).expand(*x.shape[:-1], oq.channels.shape[-1])
    return x.scatter(-1, idx, oq.outliers.float()).to(dtype)
