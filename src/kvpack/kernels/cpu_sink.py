"""Compiled helpers of the CPU backend for sink positions (``PagedKV.sink_k``, contract in kernels.views).

The fused kernel runs with the sink rows' block copies masked; :func:`sink_partials` attends the few sink
rows of each (sequence, kv head) as one more partial result in the kernel's base-2 ``(max, sum, acc)`` form,
which the kernel's log-sum-exp merge (``cpu_numba.merge``) takes beside the chunks' partials. Written in
numba because the torch equivalent cost ~150 us per call, more than the whole kernel at short context.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sink_partials"]


@njit(cache=True, nogil=True)
def sink_partials(q, sink_k, sink_v, s_len, lo, scale_log2):
    """Each (sequence, kv head)'s attention over its sink rows ``[lo, s_len)``, unnormalized, base 2.

    Args:
        q: ``[batch, H * G, D]`` float32 queries.
        sink_k, sink_v: ``[batch, H, S, D]`` float32 sink rows.
        s_len: ``[batch]`` int, sink positions each sequence reads (``min(S, n_sealed)``).
        lo: ``[batch]`` int, first attended position (``start_pos`` and the window).
        scale_log2: ``sm_scale * log2(e)``.

    Returns:
        ``(m, l, acc)``: ``[batch * H, G]`` float32 largest base-2 logit (``-inf`` where no sink row is
        attended: the merge skips it), ``[batch * H, G]`` float32 ``sum 2**(x - m)`` and ``[batch * H, G, D]``
        float32 ``sum 2**(x - m) * v``, rows in the merge's ``(sequence, kv head)`` order.
    """
    batch, h_n, _, d = sink_k.shape
    g_n = q.shape[1] // h_n
    m = np.full((batch * h_n, g_n), -np.inf, np.float32)
    lsum = np.zeros((batch * h_n, g_n), np.float32)
    acc = np.zeros((batch * h_n, g_n, d), np.float32)
    for b in range(batch):
        for h in range(h_n):
            bh = b * h_n + h
            for g in range(g_n):
                qv = q[b, h * g_n + g]
                mx = -np.inf
                for p in range(lo[b], s_len[b]):
                    x = np.float32(0.0)
                    for i in range(d):
                        x += qv[i] * sink_k[b, h, p, i]
                    mx = max(mx, x * scale_log2)
                if mx == -np.inf:
                    continue
                m[bh, g] = mx
                for p in range(lo[b], s_len[b]):
                    x = np.float32(0.0)
                    for i in range(d):
                        x += qv[i] * sink_k[b, h, p, i]
                    w = np.float32(2.0 ** (x * scale_log2 - mx))
                    lsum[bh, g] += w
                    for i in range(d):
                        acc[bh, g, i] += w * sink_v[b, h, p, i]
    return m, lsum, acc
