"""Compiled helpers of the CPU backend for sink positions (``PagedKV.sink_k``, contract in kernels.views).

The fused kernel runs with the sink rows' block copies masked; :func:`with_sink_partials` then attends the
few sink rows of each (sequence, kv head) and inserts them as one more partial result after that pair's
chunks, in the kernel's base-2 ``(max, sum, acc)`` form, ready for the kernel's log-sum-exp merge. Written in
numba because the torch equivalent cost ~150 us per call, more than the whole kernel at short context.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["with_sink_partials"]


@njit(cache=True, nogil=True)
def with_sink_partials(first, pm, pl, pacc, q, sink_k, sink_v, s_len, lo, scale_log2):
    """The kernel's partials with one sink partial per (sequence, kv head) placed after its chunks.

    Args:
        first: ``[batch * H + 1]`` int, chunk ranges per (sequence, kv head) from the kernel's plan.
        pm, pl: ``[n, G]`` float32 chunk maxima and sums; pacc: ``[n, G, D]`` float32 chunk accumulators.
        q: ``[batch, H * G, D]`` float32 queries.
        sink_k, sink_v: ``[batch, H, S, D]`` float32 sink rows.
        s_len: ``[batch]`` int, sink positions each sequence reads (``min(S, n_sealed)``).
        lo: ``[batch]`` int, first attended position (``start_pos`` and the window).
        scale_log2: ``sm_scale * log2(e)``.

    Returns:
        ``(first, pm, pl, pacc)`` with ``batch * H`` more items; a pair with no live sink row gets
        ``max = -inf`` (the merge skips it).
    """
    n_bh = first.shape[0] - 1
    h_n = sink_k.shape[1]
    g_n = pm.shape[1]
    d = pacc.shape[2]
    n = pm.shape[0]
    nf = np.empty_like(first)
    pm2 = np.empty((n + n_bh, g_n), np.float32)
    pl2 = np.empty((n + n_bh, g_n), np.float32)
    pacc2 = np.zeros((n + n_bh, g_n, d), np.float32)
    for bh in range(n_bh):
        nf[bh] = first[bh] + bh
        i0, i1 = first[bh], first[bh + 1]
        pm2[i0 + bh : i1 + bh] = pm[i0:i1]
        pl2[i0 + bh : i1 + bh] = pl[i0:i1]
        pacc2[i0 + bh : i1 + bh] = pacc[i0:i1]
        it = i1 + bh  # the sink partial of this pair
        b = bh // h_n
        h = bh % h_n
        for g in range(g_n):
            qv = q[b, h * g_n + g]
            mx = -np.inf
            for p in range(lo[b], s_len[b]):
                x = np.float32(0.0)
                for i in range(d):
                    x += qv[i] * sink_k[b, h, p, i]
                mx = max(mx, x * scale_log2)
            pm2[it, g] = mx
            pl2[it, g] = 0.0
            if mx == -np.inf:
                continue
            for p in range(lo[b], s_len[b]):
                x = np.float32(0.0)
                for i in range(d):
                    x += qv[i] * sink_k[b, h, p, i]
                w = np.float32(2.0 ** (x * scale_log2 - mx))
                pl2[it, g] += w
                for i in range(d):
                    pacc2[it, g, i] += w * sink_v[b, h, p, i]
    nf[n_bh] = first[n_bh] + n_bh
    return nf, pm2, pl2, pacc2
