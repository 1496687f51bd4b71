"""The kernel-facing view of one layer of the paged cache: plain tensors, no state.

The cache (:mod:`kvpack.cache`) builds these; every attention backend reads them. Layout per layer:

* payload and scales in separate pools, indexed by block id (block 0 is the null block);
* per sequence a row of ``block_tables`` and a full-precision tail of one block.

A pool may be strided along its block axis: contiguous within a block (``pool[n]``), its blocks ``stride(0)``
elements apart, at least a block's size, so the pools can be views into one page per block that holds all of
them (vLLM's layout: ``k_data``, ``k_scale``, ... at their own byte offsets in the page, ``stride(0)`` = the
page size in each pool's elements; the outlier pools too). Every backend reads such pools in place; the CPU
kernel refuses other layouts (:mod:`kvpack.kernels.cpu_decode`).

A sequence of ``seq_len`` tokens has ``seq_len // block_size`` sealed blocks (its first entries of
``block_tables``) and ``seq_len % block_size`` tokens in its tail: the tail is sealed the moment it holds
a full block. Entries past the sealed blocks, and blocks released because they left a sliding window,
are 0 (the null block) and must never be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import KVFormat, QuantSpec
from kvpack.outliers import residual_dtype
from kvpack.quant import payload_torch_dtype, scale_torch_dtype

__all__ = ["ROLES", "PagedKV", "Role", "refuse_rotated"]

# The two halves of a view, named the same in every check and message.
Role = Literal["key", "value"]
ROLES: tuple[Role, Role] = ("key", "value")
_TAIL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
            A ``refined`` spec stores ``[num_blocks, H, B, ceil(k / 2)]`` ``torch.uint8`` refinement codes
            instead (channel ``j`` in byte ``j // 2``, low nibble first): ``r = (u - 7.5) * s[idx_j] / 16`` with
            ``s`` the block's key scale of that channel (:func:`kvpack.outliers.unrefine`).
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

    def pools(self, role: Role) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(data, scale, zero)`` of ``role``: ``k_data, k_scale, k_zero`` or ``v_data, v_scale, v_zero``."""
        if role == "key":
            return self.k_data, self.k_scale, self.k_zero
        return self.v_data, self.v_scale, self.v_zero

    def spec(self, role: Role) -> QuantSpec:
        """The format's spec of ``role``."""
        return self.format.key if role == "key" else self.format.value

    def reasons_invalid(self) -> list[str]:
        """What makes this view inconsistent with its format, whatever backend reads it (empty list: nothing).

        The format-level invariants, checked here once for every backend: each spec stores ``head_dim``; tails
        ``[batch, H, B, D]`` of one float dtype; ``block_tables`` / ``seq_lens`` / ``start_pos`` int32 of the
        documented shapes; payload, scale and zero-point pools of the shape and dtype the format stores, with
        one block count; outlier pools present exactly when the key spec keeps outlier channels, of its
        shape; sink rows both or neither, ``[batch, H, S, D]`` in the tail dtype, ``0 < S <= block_size``;
        every tensor on one device. Layouts (strides) and the query are each backend's to check.
        """
        reasons: list[str] = []
        d = self.head_dim
        for role in ROLES:
            reasons += [f"{role}: {r}" for r in self.spec(role).reasons_invalid(d)]
        if self.seq_lens.dim() != 1 or self.seq_lens.dtype != torch.int32:
            reasons.append(f"seq_lens must be [batch] int32, got {tuple(self.seq_lens.shape)} {self.seq_lens.dtype}")
            return reasons  # no batch size to check the rest against
        if self.tail_k.dim() != 4:
            reasons.append(f"tails must be [batch, H, B, D], got {tuple(self.tail_k.shape)}")
            return reasons  # no kv_heads to check the rest against
        batch, h, b = self.batch, self.kv_heads, self.block_size
        want = (batch, h, b, d)
        if tuple(self.tail_k.shape) != want or tuple(self.tail_v.shape) != want:
            reasons.append(f"tails must be {list(want)}, got {tuple(self.tail_k.shape)} / {tuple(self.tail_v.shape)}")
        if self.tail_v.dtype != self.tail_k.dtype or self.tail_k.dtype not in _TAIL_DTYPES:
            reasons.append(
                f"tail_k and tail_v must share one of float16/bfloat16/float32, got {self.tail_k.dtype} and "
                f"{self.tail_v.dtype}"
            )
        t = self.block_tables
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != batch:
            reasons.append(f"block_tables must be [batch={batch}, max_blocks] int32, got {tuple(t.shape)} {t.dtype}")
        s = self.start_pos
        if s is not None and (s.dtype != torch.int32 or tuple(s.shape) != (batch,)):
            reasons.append(f"start_pos must be [batch={batch}] int32, got {tuple(s.shape)} {s.dtype}")
        for role in ROLES:
            reasons += self._pool_reasons(role)
        if self.v_data.dim() == 4 and self.k_data.dim() == 4 and self.v_data.shape[0] != self.k_data.shape[0]:
            reasons.append(
                f"key and value pools differ in blocks: k_data has {self.k_data.shape[0]}, v_data {self.v_data.shape[0]}"
            )
        reasons += self._outlier_reasons() + self._sink_reasons()
        if self.key_rotation is not None and tuple(self.key_rotation.shape) != (d, d):
            reasons.append(f"key_rotation must be [{d}, {d}], got {tuple(self.key_rotation.shape)}")
        where = {t.device for t in self._tensors()}
        if len(where) > 1:
            reasons.append(
                f"every tensor of the view must be on one device, found {sorted(map(str, where))}; move them together"
            )
        return reasons

    def check(self) -> None:
        """Raise :class:`ShapeError` naming everything :meth:`reasons_invalid` finds wrong (nothing: returns)."""
        reasons = self.reasons_invalid()
        if reasons:
            raise ShapeError(f"the view does not match its format {self.format.name}: " + "; ".join(reasons))

    def _pool_reasons(self, role: Role) -> list[str]:
        spec, (data, scale, zero) = self.spec(role), self.pools(role)
        h, b, d = self.kv_heads, self.block_size, self.head_dim
        p = role[0]  # the attributes' prefix: k_data, v_scale, ...
        reasons = []
        want = payload_torch_dtype(spec)
        if data.dtype != want:
            reasons.append(
                f"{p}_data: {role} payload dtype {data.dtype} does not match format {spec} (expected {want})"
            )
        if data.dim() != 4 or tuple(data.shape[1:]) != (h, b, spec.packed_head_dim(d)):
            reasons.append(
                f"{p}_data ({role} payload) must be [num_blocks, {h}, {b}, {spec.packed_head_dim(d)}], "
                f"got {tuple(data.shape)}"
            )
        shape = spec.scale_shape(h, b, d)
        if shape is None:
            return reasons
        stored = [("scale", scale, spec.scale_dtype)] + ([("zero", zero, spec.zero_dtype)] if spec.has_zero else [])
        for what, t, dt in stored:
            name = f"{p}_{what} ({role} {what})"
            if t is None:
                reasons.append(f"{name} is missing: format {spec} stores one per {spec.granularity.name}")
            elif t.dim() != 4 or tuple(t.shape[1:]) != shape or t.dtype != scale_torch_dtype(dt):
                reasons.append(
                    f"{name} must be [num_blocks, {', '.join(map(str, shape))}] {scale_torch_dtype(dt)}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )
            elif data.dim() == 4 and t.shape[0] != data.shape[0]:
                reasons.append(f"{name} has {t.shape[0]} blocks but {p}_data has {data.shape[0]}")
        return reasons

    def _outlier_reasons(self) -> list[str]:
        r, i, n = self.k_outlier, self.k_outlier_idx, self.format.key.outliers
        if (r is None) != (i is None):
            return ["k_outlier and k_outlier_idx come together: pass both residuals and channel indices, or neither"]
        if r is None:
            return [f"the key spec keeps {n} outlier channels: pass k_outlier and k_outlier_idx"] if n else []
        if not n:
            return ["the key spec keeps no outlier channels: k_outlier and k_outlier_idx must be None"]
        reasons = []
        nb, h, b = self.k_data.shape[0], self.kv_heads, self.block_size
        spec = self.format.key
        w, dt = spec.residual_width, residual_dtype(spec)
        if tuple(r.shape) != (nb, h, b, w) or r.dtype != dt:
            what = "uint8 refinement codes" if spec.refined else "float16"
            reasons.append(f"k_outlier must be [{nb}, {h}, {b}, {w}] {what}, got {tuple(r.shape)} {r.dtype}")
        if tuple(i.shape) != (nb, h, n) or i.dtype not in (torch.uint8, torch.int16):
            reasons.append(
                f"k_outlier_idx must be [{nb}, {h}, {n}] uint8 (int16 past head_dim 256), got {tuple(i.shape)} {i.dtype}"
            )
        return reasons

    def _sink_reasons(self) -> list[str]:
        if (self.sink_k is None) != (self.sink_v is None):
            return ["sink_k and sink_v come together: pass both full-precision sink rows, or both None"]
        if self.sink_k is None:
            return []
        n = self.sink_k.shape[2] if self.sink_k.dim() == 4 else -1
        want = (self.batch, self.kv_heads, n, self.head_dim)
        reasons = []
        for name, t in (("sink_k", self.sink_k), ("sink_v", self.sink_v)):
            if tuple(t.shape) != want or n < 1 or t.dtype != self.tail_k.dtype:
                reasons.append(
                    f"{name} must be [batch={self.batch}, H={self.kv_heads}, S, D={self.head_dim}] in the tail dtype "
                    f"({self.tail_k.dtype}), S > 0 the same for both, got {tuple(t.shape)} {t.dtype}"
                )
        if n > self.block_size:
            reasons.append(
                f"sink_k holds {n} positions, more than block_size={self.block_size}: a sink keeps at most one block "
                "(S <= block_size)"
            )
        return reasons

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of the view but ``key_rotation`` (the dispatcher moves that one to the query)."""
        ts = (self.k_data, self.k_scale, self.k_zero, self.v_data, self.v_scale, self.v_zero, self.block_tables,
              self.seq_lens, self.tail_k, self.tail_v, self.start_pos, self.k_outlier, self.k_outlier_idx,
              self.sink_k, self.sink_v)  # fmt: skip
        return [t for t in ts if t is not None]


def refuse_rotated(kv: PagedKV) -> None:
    """Raise :class:`UnsupportedError` for a view of rotated keys: a fused backend called directly would read
    them with an unrotated query (the dispatcher rotates the query and passes a view without the rotation)."""
    if kv.key_rotation is not None:
        raise UnsupportedError(
            "this view stores rotated keys (key_rotation): call kvpack.kernels.decode_attention, which rotates "
            "the query, instead of the backend directly",
            ["rotated keys need a rotated query"],
        )
