"""The packed pools of every layer: payload and scales in separate contiguous arrays, indexed by block id.

Each pool carries the layer axis first, so ``k_data[layer]`` is the contiguous ``[num_blocks, H, B, Pk]``
array a kernel reads (see :class:`kvpack.kernels.views.PagedKV`), and whole-sequence moves (offload,
restore, crop) touch all layers in one indexing operation.
"""

from __future__ import annotations

import math

import torch

from kvpack.cache import hugepages
from kvpack.errors import ShapeError
from kvpack.formats import KVFormat, QuantSpec
from kvpack.outliers import apply_kept, index_dtype, residual_dtype
from kvpack.quant import QuantizedTensor, dequantize, payload_torch_dtype, scale_torch_dtype

__all__ = ["POOL_NAMES", "BlockStorage"]

POOL_NAMES = ("k_data", "k_scale", "k_zero", "k_outlier", "k_outlier_idx", "v_data", "v_scale", "v_zero")
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _words(t: torch.Tensor, lead: int = 1) -> torch.Tensor:
    """A contiguous tensor's rows as machine words: ``[*lead dims, row bytes / w]``, ``w`` the widest integer
    width (8, 4, 2, 1 bytes) dividing the row. Indexed copies move whole words then: torch's CPU
    ``index_copy_`` goes element by element, so int8 payload rows copy 8x faster as int64 (and fp8, which has
    no CPU ``index_copy_`` at all, copies as bytes)."""
    row = t.reshape(*t.shape[:lead], math.prod(t.shape[lead:])).view(torch.uint8)
    for width, dtype in _WORDS:
        if row.shape[-1] % width == 0 and (row.storage_offset() % width == 0):
            return row.view(dtype)
    return row


def _pools(spec: QuantSpec, lead: tuple[int, int], h: int, b: int, d: int, device: torch.device):
    data = hugepages.zeros((*lead, h, b, spec.packed_head_dim(d)), payload_torch_dtype(spec), device)
    shape = spec.scale_shape(h, b, d)
    if shape is None:
        return data, None, None
    scale = hugepages.zeros((*lead, *shape), scale_torch_dtype(spec.scale_dtype), device)
    zero = None
    if spec.has_zero:
        zero = hugepages.zeros((*lead, *shape), scale_torch_dtype(spec.zero_dtype), device)
    return data, scale, zero


class BlockStorage:
    """Payload, scale and zero-point pools of all layers.

    Attributes (``L`` layers, ``N`` blocks, ``H`` kv_heads, ``B`` block_size, ``[Hs, Ts, Cs]`` a spec's
    per-block scale shape):
        k_data: ``[L, N, H, B, Pk]``, dtype ``quant.payload_torch_dtype(format.key)``.
        k_scale: ``[L, N, Hs, Ts, Cs]``, dtype of the key scale storage; ``None`` for passthrough keys.
        k_zero: like ``k_scale``, dtype of ``format.key.zero_dtype``; ``None`` unless asymmetric.
        k_outlier: ``[L, N, H, B, k]`` float16, the residuals of a key spec with ``outliers=k`` (``refined``:
            ``[L, N, H, B, ceil(k / 2)]`` uint8 refinement codes); else ``None``.
        k_outlier_idx: ``[L, N, H, k]`` uint8 (int16 when head_dim > 256), the kept channels; else ``None``.
        v_data, v_scale, v_zero: the same for values.
    """

    def __init__(
        self, fmt: KVFormat, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, device: torch.device
    ) -> None:
        self.format = fmt
        self.head_dim = head_dim
        lead = (num_layers, num_blocks)
        b = fmt.block_size
        self.k_data, self.k_scale, self.k_zero = _pools(fmt.key, lead, kv_heads, b, head_dim, device)
        self.v_data, self.v_scale, self.v_zero = _pools(fmt.value, lead, kv_heads, b, head_dim, device)
        self.k_outlier = self.k_outlier_idx = None
        k = fmt.key.outliers
        if k:
            w = fmt.key.residual_width
            self.k_outlier = hugepages.zeros((*lead, kv_heads, b, w), residual_dtype(fmt.key), device)
            self.k_outlier_idx = hugepages.zeros((*lead, kv_heads, k), index_dtype(head_dim), device)

    def pools(self) -> dict[str, torch.Tensor]:
        """The existing pools by name (absent scales and zero-points left out)."""
        return {n: getattr(self, n) for n in POOL_NAMES if getattr(self, n) is not None}

    def block_nbytes(self) -> tuple[int, int, int]:
        """``(payload, scale + zero, outlier residuals + indices)`` bytes of one block in one layer, as allocated."""
        payload = scale = outlier = 0
        for name, t in self.pools().items():
            n = t[0, 0].numel() * t.element_size()
            if name.endswith("data"):
                payload += n
            elif "outlier" in name:
                outlier += n
            else:
                scale += n
        return payload, scale, outlier

    def write(
        self,
        layer: int,
        ids: torch.Tensor,
        k: QuantizedTensor,
        v: QuantizedTensor,
        k_outlier: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Scatter freshly sealed blocks into one layer's pools.

        Args:
            layer: the layer.
            ids: ``[n]`` int64 block ids (distinct, not 0).
            k, v: quantized ``[n, H, B, D]`` blocks from :func:`kvpack.quant.quantize`.
            k_outlier: ``(residual [n, H, B, k] float16, idx [n, H, k])`` of a key spec with outliers.
        """
        if (k_outlier is None) != (self.k_outlier is None):
            raise ShapeError("outlier residuals must be written exactly when the key spec keeps outlier channels")
        parts = [("k", "data", k.data), ("k", "scale", k.scale), ("k", "zero", k.zero)]
        if k_outlier is not None:
            parts += [("k", "outlier", k_outlier[0]), ("k", "outlier_idx", k_outlier[1])]
        parts += [("v", "data", v.data), ("v", "scale", v.scale), ("v", "zero", v.zero)]
        for prefix, part, src in parts:
            if src is not None:
                dst = getattr(self, f"{prefix}_{part}")[layer]
                _words(dst).index_copy_(0, ids, _words(src.contiguous()))

    def gather(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of blocks ``ids`` (``[n]`` int64) in every layer: name -> ``[L, n, ...]``."""
        return {
            name: _words(t, 2).index_select(1, ids).view(t.dtype).view(t.shape[0], len(ids), *t.shape[2:])
            for name, t in self.pools().items()
        }

    def scatter(self, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`gather`: write ``[L, n, ...]`` parts into blocks ``ids`` of every layer."""
        for name, t in self.pools().items():
            _words(t, 2).index_copy_(1, ids, _words(parts[name].to(t.device).contiguous(), 2))

    def dequantize_block(self, block: int, layers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one block in some layers, dequantized (keys with their outlier residuals
        added): two ``[n_layers, H, B, D]`` float32."""
        out = []
        for prefix, spec in (("k", self.format.key), ("v", self.format.value)):
            parts = [getattr(self, f"{prefix}_{n}") for n in ("data", "scale", "zero")]
            data, scale, zero = (None if p is None else p[layers, block] for p in parts)
            out.append(dequantize(QuantizedTensor(data, scale, zero, spec, self.head_dim)))
        if self.k_outlier is not None:
            res, idx = self.k_outlier[layers, block], self.k_outlier_idx[layers, block]
            scale = None if self.k_scale is None else self.k_scale[layers, block]
            out[0] = apply_kept(out[0], res, idx, self.format.key, scale)
        return out[0], out[1]
