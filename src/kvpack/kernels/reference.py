"""The torch oracle: attention over a :class:`PagedKV`, dequantizing with :mod:`kvpack.quant`.

Slow on purpose (it materializes the dequantized history); used as the test oracle and as the last-resort
fallback. Accumulates in float32.
"""

from __future__ import annotations

import math

import torch

from kvpack.errors import ShapeError
from kvpack.kernels.views import PagedKV
from kvpack.outliers import apply_kept
from kvpack.quant import QuantizedTensor, dequantize

__all__ = [
    "chunk_attention",
    "decode_attention",
    "dense_history",
    "paged_attention_reference",
    "reasons_unsupported",
]


def dense_history(kv: PagedKV, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized keys and values of sequence ``row``: two ``[H, seq_len, D]`` float32 tensors.

    Positions of released (out-of-window) blocks come back as zeros. Keys of a format with outlier
    channels get their residuals added at the kept channels (:func:`kvpack.outliers.apply_kept`); keys
    stored rotated (``kv.key_rotation``) come back unrotated. With a sink (``kv.sink_k``), positions
    ``p < min(S, sealed tokens)`` are the sink rows instead of their block rows (exactly what kernels read).
    """
    n = int(kv.seq_lens[row])
    b = kv.block_size
    nb, tail = divmod(n, b)
    ids = kv.block_tables[row, :nb].long()
    out = []
    for role, data, scale, zero, spec, tail_x in (
        ("key", kv.k_data, kv.k_scale, kv.k_zero, kv.format.key, kv.tail_k),
        ("value", kv.v_data, kv.v_scale, kv.v_zero, kv.format.value, kv.tail_v),
    ):
        qt = QuantizedTensor(
            data[ids],
            None if scale is None else scale[ids],
            None if zero is None else zero[ids],
            spec,
            kv.head_dim,
        )
        x = dequantize(qt)  # [nb, H, B, D]
        if role == "key" and kv.k_outlier is not None:
            x = _with_residuals(x, kv, ids)
        x = torch.where((ids == 0).view(-1, 1, 1, 1), torch.zeros_like(x), x)
        x = x.permute(1, 0, 2, 3).reshape(kv.kv_heads, nb * b, kv.head_dim)
        sink = kv.sink_k if role == "key" else kv.sink_v
        s = min(kv.sink, nb * b)
        if s and int(ids[0]):  # sink positions of a block the window released stay zero like the rest of it
            x = torch.cat([sink[row, :, :s].float(), x[:, s:]], dim=1)
        out.append(torch.cat([x, tail_x[row, :, :tail].float()], dim=1))
    if kv.key_rotation is not None:  # stored keys are k @ R: back to natural keys (released zeros stay zero)
        out[0] = out[0] @ kv.key_rotation.T.float()
    return out[0], out[1]


def _with_residuals(x: torch.Tensor, kv: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """Dequantized keys ``[nb, H, B, D]`` of blocks ``ids`` with their outlier residuals added."""
    null = (ids == 0).view(-1, 1, 1)
    spec = kv.format.key
    k = spec.outliers
    # the null block's indices and residuals are never meaningful: read channels 0..k-1 and add zero there
    # (a refinement code of 8 in each nibble is a zero residual; the null block's scales are zeroed too)
    idx = torch.where(null, torch.arange(k, device=x.device).view(1, 1, k), kv.k_outlier_idx[ids].long())
    zero = torch.tensor(0x88 if spec.refined else 0, dtype=kv.k_outlier.dtype, device=x.device)
    res = torch.where(null.unsqueeze(-1), zero, kv.k_outlier[ids])
    scale = None
    if spec.refined:
        scale = torch.where(
            null.unsqueeze(-1), torch.zeros((), dtype=kv.k_scale.dtype, device=x.device), kv.k_scale[ids]
        )
    return apply_kept(x, res, idx, spec, scale)


def check_query(q: torch.Tensor, kv: PagedKV) -> None:
    """Raise :class:`ShapeError` unless ``q`` is ``[batch, T, Hq, D]`` matching ``kv`` (``Hq`` a multiple of kv_heads)."""
    batch, _, hq, d = q.shape
    if batch != kv.batch or d != kv.head_dim or hq % kv.kv_heads:
        raise ShapeError(
            f"q must be [batch={kv.batch}, T, Hq (a multiple of {kv.kv_heads}), D={kv.head_dim}], got {tuple(q.shape)}"
        )


def row_history(kv: PagedKV, row: int, t: int, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the last ``t`` queries of sequence ``row`` attend: keys and values ``[H * group, n, D]`` float32
    (repeated for grouped-query attention) and the first attended position (``kv.start_pos``, else 0).
    Rows ``p < min(S, sealed tokens)`` are the sink rows of a view with a sink (:func:`dense_history`), so the
    reference and the transformers chunk path read what the fused kernels read.

    Raises:
        ShapeError: the sequence holds fewer than ``t`` tokens (the chunk was not appended first).
    """
    k, v = dense_history(kv, row)  # [H, n, D]
    n = k.shape[1]
    if n < t:
        raise ShapeError(f"sequence {row} holds {n} tokens, fewer than the {t} queries; append the chunk first")
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    return k, v, int(kv.start_pos[row]) if kv.start_pos is not None else 0


def attention_mask(n: int, q_lo: int, q_hi: int, window: int | None, start: int, device: torch.device) -> torch.Tensor:
    """``[q_hi - q_lo, n]`` bool: query at position ``p`` in ``[q_lo, q_hi)`` may attend key position ``j``
    when ``start <= j <= p`` and, with a window, ``j > p - window``."""
    qpos = torch.arange(q_lo, q_hi, device=device).view(-1, 1)
    kpos = torch.arange(n, device=device).view(1, -1)
    mask = (kpos <= qpos) & (kpos >= start)
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def paged_attention_reference(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the last ``T`` positions of each sequence over its whole cached history.

    The chunk's own keys and values must already be in the cache (``seq_len`` counts them); query ``i``
    sits at position ``seq_len - T + i`` and attends causally.

    Args:
        q: ``[batch, T, Hq, D]``, float; ``Hq`` a multiple of ``kv.kv_heads`` (grouped-query attention).
        kv: the layer's paged cache.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: if given, a query at position ``p`` attends only positions ``> p - window``.

    Positions before ``kv.start_pos`` (left padding) are masked. A query row with nothing to attend
    (all masked) returns zeros.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype``.
    """
    check_query(q, kv)
    batch, t, hq, d = q.shape
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = hq // kv.kv_heads
    out = torch.empty(batch, t, hq, d, dtype=torch.float32, device=q.device)
    for row in range(batch):
        k, v, start = row_history(kv, row, t, group)  # [Hq, n, D]
        n = k.shape[1]
        qr = q[row].float().transpose(0, 1)  # [Hq, T, D]
        scores = (qr @ k.transpose(1, 2)) * sm_scale  # [Hq, T, n]
        mask = attention_mask(n, n - t, n, window, start, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
        out[row] = (probs @ v).transpose(0, 1)
    return out.to(q.dtype)


def reasons_unsupported(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """The reference runs every case."""
    return []


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, one query per sequence: ``q`` ``[batch, Hq, D]`` -> ``[batch, Hq, D]`` (into ``out``
    when given). Raises :class:`ShapeError` for a view that does not match its format (:meth:`PagedKV.check`)."""
    kv.check()
    res = paged_attention_reference(q.unsqueeze(1), kv, sm_scale, window)[:, 0]
    if out is not None:
        out.copy_(res)
        return out
    return res


def chunk_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunk backend contract over :func:`paged_attention_reference`: ``q`` ``[batch, T, Hq, D]`` ->
    ``[batch, T, Hq, D]`` (into ``out`` when given); a view that does not match its format raises
    :class:`ShapeError` (:meth:`PagedKV.check`)."""
    kv.check()
    res = paged_attention_reference(q, kv, sm_scale, window)
    if out is not None:
        out.copy_(res)
        return out
    return res
