"""Sink positions (``PagedKV.sink_k`` / ``sink_v``) for backends that attend them beside their kernel.

A format with ``sink = S`` keeps each sequence's first ``S`` positions in full precision as well as in its
first sealed block; readers take those positions from the sink rows. A backend whose compiled kernel knows
nothing of sinks can still serve such a cache exactly:

1. run its kernel with the sealed rows at positions ``< min(S, n_sealed)`` masked, by raising the first
   attended position of each sequence (:func:`masked_start`): the kernel never reads the sink's block rows;
2. attend the few sink rows here in float32 (:func:`sink_partials`) as one more partial result, in the same
   base-2 ``(max, sum, acc)`` form the kernel's chunks take, and merge it with theirs by log-sum-exp.

The sink rows are at most one block per sequence, so step 2 is a small batched matmul.
"""

from __future__ import annotations

import torch

from kvpack.errors import ShapeError
from kvpack.kernels.views import PagedKV

__all__ = ["check_sink", "masked_start", "sink_partials"]


def check_sink(kv: PagedKV) -> None:
    """Raise :class:`ShapeError` unless ``sink_k`` / ``sink_v`` are absent together or ``[batch, H, S, D]``
    in the tail's dtype with ``S <= block_size``."""
    if kv.sink_k is None and kv.sink_v is None:
        return
    if kv.sink_k is None or kv.sink_v is None:
        raise ShapeError("sink_k and sink_v come together: pass both full-precision sink rows, or neither")
    s = kv.sink_k.shape[2] if kv.sink_k.dim() == 4 else -1
    want = (kv.batch, kv.kv_heads, s, kv.head_dim)
    for name, t, like in (("sink_k", kv.sink_k, kv.tail_k), ("sink_v", kv.sink_v, kv.tail_v)):
        if tuple(t.shape) != want or not 0 < s <= kv.block_size or t.dtype != like.dtype:
            raise ShapeError(
                f"{name} must be [batch={kv.batch}, H={kv.kv_heads}, S, D={kv.head_dim}] with 0 < S <= block_size="
                f"{kv.block_size} in the tail's dtype {like.dtype}, got {tuple(t.shape)} {t.dtype}"
            )


def _sink_len(kv: PagedKV) -> torch.Tensor:
    """``[batch]`` int32: sink positions each sequence reads, ``min(S, n_sealed)``."""
    n_sealed = kv.seq_lens // kv.block_size * kv.block_size
    return torch.clamp(n_sealed, max=kv.sink)


def masked_start(kv: PagedKV) -> torch.Tensor:
    """``[batch]`` int32: the first position a kernel may read from the sealed blocks and the tail.

    ``max(start_pos, min(S, n_sealed))``: the sink rows' block copies are masked like left padding. Tail
    positions (``>= n_sealed``) are never affected.
    """
    start = kv.start_pos if kv.start_pos is not None else torch.zeros_like(kv.seq_lens)
    if not kv.sink:
        return start
    return torch.maximum(start, _sink_len(kv).to(start.dtype))


def sink_partials(
    q: torch.Tensor, kv: PagedKV, scale_log2: float, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each query over its sequence's sink rows, unnormalized, base 2.

    Args:
        q: ``[batch, Hq, D]``, any float dtype; ``Hq = G * H``.
        kv: a view with sink rows (``kv.sink > 0``).
        scale_log2: ``sm_scale * log2(e)``: base-2 logits are ``(q . k) * scale_log2``.
        window: the sliding window of the call (``None``: none); masks by position like ``start_pos``.

    Returns:
        ``(m, l, acc)``: ``[batch, H, G]`` float32 largest logit (``-inf`` where no sink row is attended),
        ``[batch, H, G]`` float32 ``sum 2**(x - m)``, ``[batch, H, G, D]`` float32 ``sum 2**(x - m) * v``.
    """
    b, hq, d = q.shape
    h, s = kv.kv_heads, kv.sink
    g = hq // h
    qf = q.float().reshape(b, h, g, d)
    x = torch.einsum("bhgd,bhsd->bhgs", qf, kv.sink_k.float()) * scale_log2
    pos = torch.arange(s, device=q.device, dtype=torch.int32).view(1, s)
    start = kv.start_pos if kv.start_pos is not None else torch.zeros_like(kv.seq_lens)
    lo = start.view(b, 1)
    if window is not None:
        lo = torch.maximum(lo, (kv.seq_lens - int(window)).view(b, 1))
    live = (pos < _sink_len(kv).view(b, 1)) & (pos >= lo)  # [batch, S]
    x = x.masked_fill(~live.view(b, 1, 1, s), float("-inf"))
    m = x.amax(-1)
    p = torch.exp2(x - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1))
    p = torch.where(live.view(b, 1, 1, s), p, torch.zeros_like(p))
    acc = torch.einsum("bhgs,bhsd->bhgd", p, kv.sink_v.float())
    return m, p.sum(-1), acc
