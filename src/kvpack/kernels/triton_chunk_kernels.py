"""Triton code only: the multi-query ("chunk") attention kernel over the packed paged cache.

One program handles one sequence, one kv head and one tile of ``BLOCK_M`` query rows, where row
``r = t * GROUP + g`` is query ``t`` of the chunk for query head ``g`` of the kv head's group: the ``T x GROUP``
rows of a kv head share every read of a block. Per block the program loads the packed codes once, turns them
into scores and values with the decode kernel's helpers (:mod:`kvpack.kernels.triton_kernels`: scales folded
where the granularity allows, ``tl.dot`` on the tensor cores), and keeps an online softmax per row. Query
``t`` sits at position ``seq_len - T + t`` and attends causally; only blocks that cross some row's causal bound,
window start, ``start_pos`` or the end of the sink are masked. The sink rows are attended first, the
full-precision tail last. The compile-time constants (``K_*``, ``V_*``, ``CVT``, ...) are the decode kernel's
(:func:`kvpack.kernels.triton_decode.cache_constexprs`). Dequantized K/V never reach memory.

This module imports triton at module level; import it only after ``TRITON_INTERPRET`` is settled.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvpack.kernels.triton_kernels import (
    INTERPRETED,
    _chan_load,
    _kept_residuals,
    _key_scores,
    _key_zeros,
    _softmax_step,
    _store_cols,
    _tail_part,
    _value_part,
)

__all__ = ["INTERPRETED", "paged_chunk_kernel"]


@triton.jit
def _attend_full_rows(
    kr,  # [R, 1] pointers to full-precision key rows (the tail, or the sink)
    vr,  # [R, 1] pointers to the value rows
    offs_pk,
    offs_pv,
    load,  # [R, 1] rows to load (others are never read)
    valid,  # [BLOCK_M, R] which query row attends which key row (loaded, causal, inside its window)
    qd0, qd1, qd2, qd3, m_i, l_i, acc0, acc1, acc2, acc3,
    K_PER: tl.constexpr, V_PER: tl.constexpr, DOT: tl.constexpr,
    DK: tl.constexpr, K_DP: tl.constexpr, DV: tl.constexpr, V_DP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of every query row over ``R`` full-precision rows, split into parts like the
    payload (the decode kernel's ``_attend_rows`` with a mask per query row)."""
    s = tl.dot(qd0, tl.trans(_tail_part(kr, offs_pk, load, 0, K_PER, DOT, DK, K_DP)))
    if K_PER >= 2:
        s += tl.dot(qd1, tl.trans(_tail_part(kr, offs_pk, load, 1, K_PER, DOT, DK, K_DP)))
    if K_PER >= 4:
        s += tl.dot(qd2, tl.trans(_tail_part(kr, offs_pk, load, 2, K_PER, DOT, DK, K_DP)))
        s += tl.dot(qd3, tl.trans(_tail_part(kr, offs_pk, load, 3, K_PER, DOT, DK, K_DP)))
    s = tl.where(valid, s, float("-inf"))
    m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
    pd = p.to(DOT)
    acc0 = acc0 * alpha[:, None] + tl.dot(pd, _tail_part(vr, offs_pv, load, 0, V_PER, DOT, DV, V_DP))
    if V_PER >= 2:
        acc1 = acc1 * alpha[:, None] + tl.dot(pd, _tail_part(vr, offs_pv, load, 1, V_PER, DOT, DV, V_DP))
    if V_PER >= 4:
        acc2 = acc2 * alpha[:, None] + tl.dot(pd, _tail_part(vr, offs_pv, load, 2, V_PER, DOT, DV, V_DP))
        acc3 = acc3 * alpha[:, None] + tl.dot(pd, _tail_part(vr, offs_pv, load, 3, V_PER, DOT, DV, V_DP))
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _in_range(kpos, lo, pos):
    """``[BLOCK_M, R]``: query row ``m`` (at position ``pos[m]``, first attended ``lo[m]``) attends key position
    ``kpos[r]``: causal, inside its window and past ``start_pos``."""
    return (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= pos[:, None])


@triton.jit
def _load_q_part(q_rows, offs_p, r_mask, qk_scale, J: tl.constexpr, PER: tl.constexpr, NC: tl.constexpr):
    """Channels ``i * PER + J`` of the tile's query rows ``[BLOCK_M, DP]``, float32, times ``qk_scale`` (columns
    ``i >= NC`` pad the part to a power of two and read 0)."""
    mask = r_mask[:, None] & (offs_p < NC)[None, :]
    x = tl.load(q_rows[:, None] + (offs_p * PER + J)[None, :], mask=mask, other=0.0)
    return x.to(tl.float32) * qk_scale


@triton.jit
def _store_o_part(o_rows, offs_p, r_mask, acc, inv, J: tl.constexpr, PER: tl.constexpr, NC: tl.constexpr,
                  DP: tl.constexpr):  # fmt: skip
    """Store channels ``i * PER + J`` of the normalized output rows (padding rows of the tile and padding
    columns are not stored)."""
    ety = o_rows.dtype.element_ty
    _store_cols(o_rows[:, None] + (offs_p * PER + J)[None, :], (acc * inv[:, None]).to(ety), offs_p, r_mask, NC, DP)


@triton.jit
def paged_chunk_kernel(
    q_ptr, sq_b, sq_t, sq_h,  # q [batch, T, Hq, D]
    kd_ptr, skd_n, skd_h, skd_t,  # k_data [num_blocks, H, B, Pk]
    ks_ptr, sks_n, sks_h, sks_t, sks_c,  # k_scale [num_blocks, Hs, Ts, Cs] (stride 0 where shared)
    kz_ptr, skz_n, skz_h, skz_t, skz_c,  # k_zero, same layout
    vd_ptr, svd_n, svd_h, svd_t,
    vs_ptr, svs_n, svs_h, svs_t, svs_c,
    vz_ptr, svz_n, svz_h, svz_t, svz_c,
    ko_ptr, sko_n, sko_h, sko_t,  # k_outlier [num_blocks, H, B, N_OUT] fp16 residuals (REFINED: packed 4-bit codes)
    ki_ptr, ski_n, ski_h,  # k_outlier_idx [num_blocks, H, N_OUT] channel indices
    bt_ptr, sbt_b,  # block_tables [batch, max_blocks] int32
    seq_ptr, start_ptr,  # seq_lens [batch] int32, start_pos [batch] int32
    tk_ptr, stk_b, stk_h, stk_t,  # tail_k [batch, H, B, D]
    tv_ptr, stv_b, stv_h, stv_t,
    sk_ptr, ssk_b, ssk_h, ssk_t,  # sink_k [batch, H, S, D] (unread without HAS_SINK)
    sv_ptr, ssv_b, ssv_h, ssv_t,  # sink_v
    sink_len,  # S: positions [0, S) of a sequence with a sealed block are read from the sink
    o_ptr, so_b, so_t, so_h,  # out [batch, T, Hq, D]
    n_q, qk_scale, window,  # T, sm_scale * log2(e), the sliding window (unread without HAS_WINDOW)
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_START: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINK: tl.constexpr, BLOCK_SINK: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, K_SCALE: tl.constexpr,
    K_CGROUP: tl.constexpr, K_E8M0: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr, V_SCALE: tl.constexpr,
    V_CGROUP: tl.constexpr, V_E8M0: tl.constexpr,
    N_OUT: tl.constexpr, BLOCK_O: tl.constexpr, REFINED: tl.constexpr, O_DT: tl.constexpr, K_DP: tl.constexpr,
    V_DP: tl.constexpr,
    DOT: tl.constexpr, CVT: tl.constexpr, K_CD: tl.constexpr, V_CD: tl.constexpr,
    K_GF16: tl.constexpr, V_GF16: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_m = tl.program_id(2)
    DK: tl.constexpr = HEAD_DIM // K_PER  # real columns of a key part; K_DP of them are loaded (padding reads 0)
    DV: tl.constexpr = HEAD_DIM // V_PER

    seq_len = tl.load(seq_ptr + pid_b)
    n_sealed = seq_len // BLOCK_SIZE
    n_rows = n_q * GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = t * GROUP + g
    r_mask = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)  # padding rows of the last tile repeat its last row (never stored)
    t_idx = rows // GROUP
    heads = pid_h * GROUP + rows % GROUP
    pos = seq_len - n_q + t_idx  # [BLOCK_M] position of each row's query
    lo = pos * 0  # [BLOCK_M] first position each row attends
    if HAS_START:
        lo = tl.maximum(lo, tl.load(start_ptr + pid_b))
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    lo_sealed = lo  # first position each row reads from a sealed block
    n_sink = seq_len * 0
    if HAS_SINK:  # sealed rows of sink positions are replaced by the sink's full-precision rows
        n_sink = tl.minimum(sink_len, n_sealed * BLOCK_SIZE)
        lo_sealed = tl.maximum(lo, n_sink)

    # Blocks [first, last) hold a position some row attends; [mid_lo, mid_hi) are attended whole by every row
    # (inside every row's window and causal bound, past the sink): only the blocks outside need a mask.
    p_first = tl.min(pos, axis=0)
    p_last = tl.max(pos, axis=0)
    first = tl.min(lo_sealed, axis=0) // BLOCK_SIZE  # blocks before it are never read (they may be released)
    last = tl.minimum(n_sealed, p_last // BLOCK_SIZE + 1)
    mid_lo = tl.minimum(tl.maximum((tl.max(lo_sealed, axis=0) + BLOCK_SIZE - 1) // BLOCK_SIZE, first), last)
    mid_hi = tl.maximum(tl.minimum((p_first + 1) // BLOCK_SIZE, last), mid_lo)

    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_pk = tl.arange(0, K_DP)  # payload byte (or element) index of a key row
    offs_pv = tl.arange(0, V_DP)

    # The tile's query rows, split like the key payload: part j holds channels c = i * K_PER + j.
    # int64 offsets: a long chunk at a wide batch passes 2**31 elements (16 x 32k queries x 32 heads x 128)
    q_rows = q_ptr + pid_b.to(tl.int64) * sq_b + t_idx.to(tl.int64) * sq_t + heads * sq_h  # [BLOCK_M] pointers
    q0 = _load_q_part(q_rows, offs_pk, r_mask, qk_scale, 0, K_PER, DK)
    q1 = q0
    q2 = q0
    q3 = q0
    if K_PER >= 2:
        q1 = _load_q_part(q_rows, offs_pk, r_mask, qk_scale, 1, K_PER, DK)
    if K_PER >= 4:
        q2 = _load_q_part(q_rows, offs_pk, r_mask, qk_scale, 2, K_PER, DK)
        q3 = _load_q_part(q_rows, offs_pk, r_mask, qk_scale, 3, K_PER, DK)
    qd0 = q0.to(K_CD)  # sealed keys multiply in K_CD, the full-precision sink and tail rows in DOT
    qd1 = q1.to(K_CD)
    qd2 = q2.to(K_CD)
    qd3 = q3.to(K_CD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, V_DP], tl.float32)
    acc1 = tl.zeros([BLOCK_M, V_DP], tl.float32)
    acc2 = tl.zeros([BLOCK_M, V_DP], tl.float32)
    acc3 = tl.zeros([BLOCK_M, V_DP], tl.float32)

    # ---- the full-precision sink rows (positions [0, n_sink)), first: before the block loop nothing else is live
    if HAS_SINK:
        offs_r = tl.arange(0, BLOCK_SINK)  # sink slot r holds position r
        sink_valid = (offs_r < n_sink)[None, :] & _in_range(offs_r, lo, pos)
        kr = sk_ptr + pid_b * ssk_b + pid_h * ssk_h + offs_r[:, None] * ssk_t
        vr = sv_ptr + pid_b * ssv_b + pid_h * ssv_h + offs_r[:, None] * ssv_t
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_full_rows(
            kr, vr, offs_pk, offs_pv, (offs_r < n_sink)[:, None], sink_valid,
            q0.to(DOT), q1.to(DOT), q2.to(DOT), q3.to(DOT), m_i, l_i,
            acc0, acc1, acc2, acc3, K_PER, V_PER, DOT, DK, K_DP, DV, V_DP)  # fmt: skip

    # fmt: off
    for i in range(first, last):
        blk = tl.load(bt_ptr + pid_b * sbt_b + i).to(tl.int64)
        # ---- keys: scores [BLOCK_M, BLOCK_SIZE] of this block, scales folded where the granularity allows
        raw = _chan_load(kd_ptr + blk * skd_n + pid_h * skd_h + offs_t[:, None] * skd_t + offs_pk[None, :],
                         offs_pk * K_PER, DK, K_DP, K_PER)
        sb = ks_ptr + blk * sks_n + pid_h * sks_h
        zb = kz_ptr + blk * skz_n + pid_h * skz_h
        s = _key_scores(q0, qd0, raw, sb, zb, offs_t, offs_pk * K_PER, sks_t, sks_c, skz_t, skz_c,
                        0, K_KIND, K_BITS, K_SCALE, K_CGROUP, K_E8M0, K_GF16, CVT, K_CD, BLOCK_SIZE, K_DP, K_PER, DK)
        if K_PER >= 2:
            s += _key_scores(q1, qd1, raw, sb, zb, offs_t, offs_pk * K_PER + 1, sks_t, sks_c, skz_t, skz_c,
                             1, K_KIND, K_BITS, K_SCALE, K_CGROUP, K_E8M0, K_GF16, CVT, K_CD, BLOCK_SIZE, K_DP, K_PER, DK)
        if K_PER >= 4:
            s += _key_scores(q2, qd2, raw, sb, zb, offs_t, offs_pk * K_PER + 2, sks_t, sks_c, skz_t, skz_c,
                             2, K_KIND, K_BITS, K_SCALE, K_CGROUP, K_E8M0, K_GF16, CVT, K_CD, BLOCK_SIZE, K_DP, K_PER, DK)
            s += _key_scores(q3, qd3, raw, sb, zb, offs_t, offs_pk * K_PER + 3, sks_t, sks_c, skz_t, skz_c,
                             3, K_KIND, K_BITS, K_SCALE, K_CGROUP, K_E8M0, K_GF16, CVT, K_CD, BLOCK_SIZE, K_DP, K_PER, DK)
        if K_SCALE == 2 and (K_KIND == 2 or K_KIND == 4) and K_GF16:
            s = _key_zeros(s, q0, q1, q2, q3, zb, offs_pk, skz_c, K_CGROUP, K_PER, K_CD, BLOCK_SIZE, K_DP, DK)
        if N_OUT > 0:  # outlier key channels: + sum_j q[idx_j] * residual[t, j] (the unfolded query), one dot
            offs_o = tl.arange(0, BLOCK_O)
            o_mask = offs_o < N_OUT
            idx = tl.load(ki_ptr + blk * ski_n + pid_h * ski_h + offs_o, mask=o_mask, other=0).to(tl.int32)
            qo = tl.load(q_rows[:, None] + idx[None, :], mask=r_mask[:, None] & o_mask[None, :], other=0.0)
            r = _kept_residuals(ko_ptr + blk * sko_n + pid_h * sko_h, offs_t, sko_t, offs_o, o_mask, idx, sb, sks_c,
                                REFINED, K_E8M0)
            s += tl.dot((qo.to(tl.float32) * qk_scale).to(O_DT), tl.trans(r.to(O_DT)))
        if (i < mid_lo) | (i >= mid_hi):  # a block some row attends only in part
            s = tl.where(_in_range(i * BLOCK_SIZE + offs_t, lo_sealed, pos), s, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        pd = p.to(V_CD)
        # ---- values
        raw = _chan_load(vd_ptr + blk * svd_n + pid_h * svd_h + offs_t[:, None] * svd_t + offs_pv[None, :],
                         offs_pv * V_PER, DV, V_DP, V_PER)
        sb = vs_ptr + blk * svs_n + pid_h * svs_h
        zb = vz_ptr + blk * svz_n + pid_h * svz_h
        acc0 = acc0 * alpha[:, None] + _value_part(
            p, pd, raw, sb, zb, offs_t, offs_pv * V_PER, svs_t, svs_c, svz_t, svz_c,
            0, V_KIND, V_BITS, V_SCALE, V_CGROUP, V_E8M0, V_GF16, CVT, V_CD, BLOCK_SIZE, V_DP, V_PER, DV)
        if V_PER >= 2:
            acc1 = acc1 * alpha[:, None] + _value_part(
                p, pd, raw, sb, zb, offs_t, offs_pv * V_PER + 1, svs_t, svs_c, svz_t, svz_c,
                1, V_KIND, V_BITS, V_SCALE, V_CGROUP, V_E8M0, V_GF16, CVT, V_CD, BLOCK_SIZE, V_DP, V_PER, DV)
        if V_PER >= 4:
            acc2 = acc2 * alpha[:, None] + _value_part(
                p, pd, raw, sb, zb, offs_t, offs_pv * V_PER + 2, svs_t, svs_c, svz_t, svz_c,
                2, V_KIND, V_BITS, V_SCALE, V_CGROUP, V_E8M0, V_GF16, CVT, V_CD, BLOCK_SIZE, V_DP, V_PER, DV)
            acc3 = acc3 * alpha[:, None] + _value_part(
                p, pd, raw, sb, zb, offs_t, offs_pv * V_PER + 3, svs_t, svs_c, svz_t, svz_c,
                3, V_KIND, V_BITS, V_SCALE, V_CGROUP, V_E8M0, V_GF16, CVT, V_CD, BLOCK_SIZE, V_DP, V_PER, DV)
    # fmt: on

    # ---- the full-precision tail (positions n_sealed * B + t, t < n_tail), when some row of the tile reaches it
    t0 = n_sealed * BLOCK_SIZE
    if p_last >= t0:
        n_tail = seq_len - t0
        tail_valid = (offs_t < n_tail)[None, :] & _in_range(t0 + offs_t, lo, pos)
        tk = tk_ptr + pid_b * stk_b + pid_h * stk_h + offs_t[:, None] * stk_t
        tv = tv_ptr + pid_b * stv_b + pid_h * stv_h + offs_t[:, None] * stv_t
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_full_rows(
            tk, tv, offs_pk, offs_pv, (offs_t < n_tail)[:, None], tail_valid,  # never load unused (poisoned) slots
            q0.to(DOT), q1.to(DOT), q2.to(DOT), q3.to(DOT), m_i, l_i,
            acc0, acc1, acc2, acc3, K_PER, V_PER, DOT, DK, K_DP, DV, V_DP)  # fmt: skip

    # ---- normalized output; a row with nothing attended gets zeros
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o_rows = o_ptr + pid_b.to(tl.int64) * so_b + t_idx.to(tl.int64) * so_t + heads * so_h
    _store_o_part(o_rows, offs_pv, r_mask, acc0, inv, 0, V_PER, DV, V_DP)
    if V_PER >= 2:
        _store_o_part(o_rows, offs_pv, r_mask, acc1, inv, 1, V_PER, DV, V_DP)
    if V_PER >= 4:
        _store_o_part(o_rows, offs_pv, r_mask, acc2, inv, 2, V_PER, DV, V_DP)
        _store_o_part(o_rows, offs_pv, r_mask, acc3, inv, 3, V_PER, DV, V_DP)
