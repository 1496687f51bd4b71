"""A kvpack block inside one vLLM page: where each pool of a block lives, and strided views over vLLM's pages.

vLLM allocates every layer's KV cache as pages of ``page_bytes`` bytes, one page per block id, and hands the
backend a ``[num_blocks, 1, block_size, C]`` int8 view of them (``page_bytes = block_size * C``). A page here is
one kvpack block of one layer, regions in this order, each 16-byte aligned:

``k_data [H, B, Pk]``, ``k_scale [Hs, Ts, Cs]``, ``k_zero``, for a key spec with outlier channels ``k_outlier [H, B, k]``
(fp16 residuals; refined: ``[H, B, ceil(k / 2)]`` uint8 codes) and ``k_outlier_idx [H, k]`` (their channels), ``v_data [H, B, Pv]``, ``v_scale``, ``v_zero``, and
with a sink (``format.sink = S``) ``sink_k [H, S, D]``, ``sink_v [H, S, D]`` in the tail dtype (the format's
``tail=``, else the model's activations), exactly as :class:`~kvpack.cache.PagedKVCache` keeps them.

The sink rows live in every page, not once per sequence as in :class:`~kvpack.cache.PagedKVCache`: vLLM shares a
cached first block between requests without telling the backend, so the rows must travel with the block. Only
the page of a sequence's first block uses them. Scales and payload are exactly the bytes :class:`KVFormat`
counts; the sink region and the round-up of the page to whole ``C``-byte cells are the only additions.

Each pool is a view with ``stride(0)`` = the page stride (in its elements), contiguous within a block: the layout
:class:`~kvpack.kernels.views.PagedKV` allows for pools. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpack.errors import ShapeError
from kvpack.formats import KVFormat
from kvpack.outliers import index_dtype, residual_dtype
from kvpack.quant import payload_torch_dtype, scale_torch_dtype, tail_torch_dtype
from kvpack.sizing import VLLM_ALIGN, vllm_page

__all__ = ["ALIGN", "PageLayout", "Region"]

ALIGN = VLLM_ALIGN  # bytes: every region starts on a multiple, so any element type of a pool is aligned


@dataclass(frozen=True)
class Region:
    """One pool's bytes inside a page: ``shape`` (per block) of ``dtype`` at byte ``offset``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PageLayout:
    """The regions of one kvpack block in one vLLM page.

    Attributes:
        format: the kvpack format (its ``block_size`` is vLLM's block size).
        kv_heads, head_dim: ``H`` and ``D`` of one layer.
        tail_dtype: dtype of the full-precision tail and sink rows (the format's ``tail``, else the model's).
        regions: the pools in page order.
        cell_bytes: ``C``: vLLM's bytes per token slot; ``page_bytes = block_size * C``.
    """

    format: KVFormat
    kv_heads: int
    head_dim: int
    tail_dtype: torch.dtype
    regions: tuple[Region, ...]
    cell_bytes: int

    @classmethod
    def build(cls, fmt: KVFormat, kv_heads: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
        """The layout of ``fmt`` for a layer of ``kv_heads`` x ``head_dim`` of a model whose activations are
        ``dtype`` (vLLM views the pages in it; the tail and sink rows take it unless the format names its own).

        Raises:
            FormatError: ``fmt`` cannot store vectors of ``head_dim``.
        """
        fmt.check(head_dim)
        h, b, d = kv_heads, fmt.block_size, head_dim
        shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for prefix, spec in (("k", fmt.key), ("v", fmt.value)):
            shapes[f"{prefix}_data"] = (payload_torch_dtype(spec), (h, b, spec.packed_head_dim(d)))
            shape = spec.scale_shape(h, b, d)
            if shape is not None:
                shapes[f"{prefix}_scale"] = (scale_torch_dtype(spec.scale_dtype), tuple(shape))
                shapes[f"{prefix}_zero"] = (scale_torch_dtype(spec.zero_dtype), tuple(shape))
            if spec.has_outliers:
                shapes[f"{prefix}_outlier"] = (residual_dtype(spec), (h, b, spec.residual_width))
                shapes[f"{prefix}_outlier_idx"] = (index_dtype(d), (h, spec.outliers))
        tail_dtype = tail_torch_dtype(fmt, dtype)
        shapes["sink_k"] = shapes["sink_v"] = (tail_dtype, (h, fmt.sink, d))
        page = vllm_page(
            fmt, h, d, torch.empty((), dtype=dtype).element_size()
        )  # the byte accounting kvpack size uses; the views follow it
        regions = []
        for name, offset, nbytes in page.regions:
            dtype, shape = shapes[name]
            region = Region(name, dtype, tuple(int(x) for x in shape), offset)
            if region.nbytes != nbytes:  # pragma: no cover - the two accountings must agree
                raise AssertionError(f"{name}: {region.nbytes} bytes from its shape, {nbytes} counted")
            regions.append(region)
        cell = page.cell_bytes
        return cls(fmt, h, d, tail_dtype, tuple(regions), cell)

    @property
    def block_size(self) -> int:
        return self.format.block_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one block of one layer) as vLLM allocates it."""
        return self.block_size * self.cell_bytes

    @property
    def format_block_bytes(self) -> int:
        """The bytes :class:`KVFormat` counts for one block of one layer (payload, scales, zero-points)."""
        return self.format.block_bytes(self.kv_heads, self.head_dim)

    def region(self, name: str) -> Region | None:
        return next((r for r in self.regions if r.name == name), None)

    def views(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every pool as a strided view of vLLM's pages (no copy).

        Args:
            kv_cache: ``[num_blocks, 1, block_size, C]`` bytes (int8/uint8, or ``C / itemsize`` elements of the
                model's dtype, as vLLM binds them), one layer's pages;
                the block axis may have any stride (other layers' pages may sit between blocks).

        Returns:
            name -> ``[num_blocks, *region.shape]`` view in the region's dtype, ``stride(0)`` = the page stride;
            plus ``name + "_bytes"`` -> ``[num_blocks, region.nbytes]`` uint8, the same bytes for writing.

        Raises:
            ShapeError: a cache tensor that does not hold this layout's pages.
        """
        want = (self.block_size, self.cell_bytes)
        if kv_cache.dim() == 4 and kv_cache.element_size() != 1 and kv_cache.stride(3) == 1:
            kv_cache = kv_cache.view(torch.uint8)  # vLLM binds the pages in the model's dtype: same bytes
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (1, *want) or kv_cache.element_size() != 1:
            raise ShapeError(
                f"the vLLM KV cache of this layer must be [num_blocks, 1, {want[0]}, {want[1]}] bytes for format "
                f"{self.format.name or self.format.spec_string()}, got {tuple(kv_cache.shape)} {kv_cache.dtype}: "
                "the page layout does not match (another backend's cache spec?)"
            )
        if kv_cache.stride(3) != 1 or kv_cache.stride(2) != self.cell_bytes:
            raise ShapeError(f"a vLLM page must be contiguous, got strides {kv_cache.stride()}")
        nb, page_stride = kv_cache.shape[0], kv_cache.stride(0)
        storage, base = kv_cache.untyped_storage(), kv_cache.storage_offset()
        out: dict[str, torch.Tensor] = {}
        for r in self.regions:
            es = torch.empty((), dtype=r.dtype).element_size()
            if (base + r.offset) % es or page_stride % es:
                raise ShapeError(f"pages at byte offset {base} / stride {page_stride} misalign {r.name} ({r.dtype})")
            inner = [math.prod(r.shape[i + 1 :]) for i in range(len(r.shape))]
            view = torch.empty(0, dtype=r.dtype, device=kv_cache.device)
            view.set_(storage, (base + r.offset) // es, (nb, *r.shape), (page_stride // es, *inner))
            raw = torch.empty(0, dtype=torch.uint8, device=kv_cache.device)
            raw.set_(storage, base + r.offset, (nb, r.nbytes), (page_stride, 1))
            out[r.name] = view
            out[r.name + "_bytes"] = raw
        return out
