"""The kernel-facing view of one layer of the paged cache: plain tensors, no state.

The cache (:mod:`kvpack.cache`) builds these; every attention backend reads them. Layout per layer:

* payload and scales in separate pools, indexed by block id (block 0 is the null block);
* per sequence a row of ``block_tables`` and a full-precision tail of one block.

A pool may be strided along its block axis: contiguous within a block (``pool[n]``), its blocks ``stride(0)``
elements apart, at least a block's size, so the pools can be views into one page per block that holds all of
them (vLLM's layout: ``k_data``, ``k_scale``, ... at their own byte offsets in the page, ``stride(0)`` = the
page size in each pool's elements). Every backend reads such pools in place; the CPU kernel refuses other
layouts (:mod:`kvpack.kernels.cpu`) and outlier pools that are not contiguous.

A sequence of ``seq_len`` tokens has ``seq_len // block_size`` sealed blocks (its first entries of
``block_tables``) and ``seq_len % block_size`` tokens in its tail: the tail is sealed the moment it holds
a full block. Entries past the sealed blocks, and blocks released because they left a sliding window,
are 0 (the null block) and must never be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import KVFormat

__all__ = ["PagedKV", "check_sink", "refuse_rotated"]


@dataclass(frozen=True)
class PagedKV:
    """One layer's paged K/V cache for a batch of sequences, as attention kernels consume it.

    Pools (``k_data``, ``k_scale``, ``k_zero``, ``v_data``, ``v_scale``, ``v_zero``) may be strided along the block
    axis (views into one page per block): each block ``pool[n]`` contiguous, ``pool.stride(0)`` at least its
    element count and aligned to the element size; the tails may be strided along the batch axis the same way.
    ``k_outlier`` / ``k_outlier_idx`` must be contiguous for the CPU kernel.

    Attributes:
        format: the cache format (key spec, value spec, block size ``B``).
        head_dim: ``D``, the logical head dimension.
        k_data: ``[num_blocks, H, B, Pk]``, dtype ``quant.payload_torch_dtype(format.key)``;
            ``Pk = format.key.packed_head_dim(D)``.
        k_scale: ``[num_blocks, Hs, Ts, Cs]`` (key granularity's scale shape), dtype of the key's scale
            storage (float32/float16/bfloat16, or uint8 E8M0 exponents); ``None`` for passthrough keys.
        k_zero: same shape as ``k_scale``, dtype of ``format.key.zero_dtype``; ``None`` unless asymmetric.
        v_data, v_scale, v_zero: the same for values.
        block_tables: ``[batch, max_blocks]``, dtype ``torch.int32``: block ids of each sequence's sealed
            blocks in order; 0 where unused or released.
        seq_lens: ``[batch]``, dtype ``torch.int32``: tokens per sequence, sealed plus tail.
        tail_k: ``[batch, H, B, D]``, float16/bfloat16/float32: the full-precision tail; slot ``t`` holds
            position ``(seq_len // B) * B + t`` for ``t < seq_len % B``; other slots are garbage.
        tail_v: ``[batch, H, B, D]``, same dtype as ``tail_k``.
        start_pos: optional ``[batch]``, dtype ``torch.int32``: positions before it are never attended (left
            padding in a batch); combined with a sliding window, a query at ``p`` attends positions in
            ``[max(start_pos, p - window + 1), p]``. ``None`` means 0 for every sequence.
        k_outlier: ``[num_blocks, H, B, k]``, dtype ``torch.float16``: for a key spec with ``outliers=k``, the
            residual ``x - dequantize(payload)`` at the block's kept channels; ``None`` when the format has none.
        k_outlier_idx: ``[num_blocks, H, k]``, dtype ``torch.uint8`` (``torch.int16`` when ``D > 256``): the
            kept channels of each block and head, ascending. Keys are ``dequantize(payload)`` with
            ``k[..., idx] += k_outlier.float()``, so a score is ``q . deq(k_t) + sum_j q[idx_j] * r[t, j]``.
        key_rotation: ``[D, D]`` float32 (:func:`kvpack.rotation.key_rotation`) for a key spec with
            ``rotate``: the stored keys (sealed blocks and tail) are ``k @ key_rotation``, read with the query
            ``q @ key_rotation``; :func:`~kvpack.kernels.reference.dense_history` returns natural keys.
            ``None`` otherwise. Fused backends take it already applied (the dispatcher rotates the query
            and passes a view without it).
        sink_k: ``[batch, H, S, D]``, same dtype as ``tail_k``, for a format with ``sink = S > 0`` (attention
            sinks): full-precision copies of each sequence's first ``S`` positions (stored rotated like the
            tail when the key spec rotates). For a sequence with ``n_sealed = (seq_len // B) * B`` sealed tokens,
            positions ``p < min(S, n_sealed)`` are read from ``sink_k[b, :, p]`` / ``sink_v[b, :, p]`` instead
            of their sealed block rows (payload and outlier residuals of those rows are ignored); positions in
            the tail come from the tail as always. Window and ``start_pos`` masks apply to them by position.
            ``None`` when the format has no sink.
        sink_v: ``[batch, H, S, D]``, same dtype as ``tail_v``; ``None`` exactly when ``sink_k`` is.
    """

    format: KVFormat
    head_dim: int
    k_data: torch.Tensor
    k_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_data: torch.Tensor
    v_scale: torch.Tensor | None
    v_zero: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    start_pos: torch.Tensor | None = None
    k_outlier: torch.Tensor | None = None
    k_outlier_idx: torch.Tensor | None = None
    key_rotation: torch.Tensor | None = None
    sink_k: torch.Tensor | None = None
    sink_v: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def sink(self) -> int:
        """``S``: leading positions read from ``sink_k`` / ``sink_v`` (0 without a sink)."""
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.tail_k.shape[1]

    @property
    def block_size(self) -> int:
        return self.format.block_size

    @property
    def device(self) -> torch.device:
        return self.tail_k.device


def refuse_rotated(kv: PagedKV) -> None:
    """Raise :class:`UnsupportedError` for a view of rotated keys: a fused backend called directly would read
    them with an unrotated query (the dispatcher rotates the query and passes a view without the rotation)."""
    if kv.key_rotation is not None:
        raise UnsupportedError(
            "this view stores rotated keys (key_rotation): call kvpack.kernels.decode_attention, which rotates "
            "the query, instead of the backend directly",
            ["rotated keys need a rotated query"],
        )


def check_sink(kv: PagedKV) -> None:
    """Raise :class:`ShapeError` unless ``sink_k`` / ``sink_v`` are both ``None`` or both ``[batch, H, S, D]``
    in the tail dtype with ``0 < S <= block_size``."""
    if (kv.sink_k is None) != (kv.sink_v is None):
        raise ShapeError("sink_k and sink_v come together: pass both full-precision sink rows, or both None")
    if kv.sink_k is None:
        return
    n = kv.sink_k.shape[2] if kv.sink_k.dim() == 4 else -1
    want = (kv.batch, kv.kv_heads, n, kv.head_dim)
    for name, t in (("sink_k", kv.sink_k), ("sink_v", kv.sink_v)):
        if tuple(t.shape) != want or n < 1 or t.dtype != kv.tail_k.dtype:
            raise ShapeError(
                f"{name} must be [batch={kv.batch}, H={kv.kv_heads}, S, D={kv.head_dim}] in the tail dtype "
                f"({kv.tail_k.dtype}), S > 0 the same for both, got {tuple(t.shape)} {t.dtype}"
            )
    if n > kv.block_size:
        raise ShapeError(
            f"sink_k holds {n} positions, more than block_size={kv.block_size}: a sink keeps at most one block "
            "(S <= block_size)"
        )
