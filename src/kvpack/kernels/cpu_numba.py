"""Compiled loops of the fused CPU decode kernel (numba, cached on disk). Launch it through
:mod:`kvpack.kernels.cpu`, which checks shapes, builds the arguments and runs :func:`work` on threads.

One set of compiled functions serves every format, so the code is compiled once per machine: pools
arrive flattened as tuples of typed views ``(uint8, uint16, float32)`` (only the slot a spec uses is real,
the others are 1-element dummies) and a spec is a small int vector (the ``P_*`` indices). The decoder is
compiled once per payload kind (``literally``), everything else is kind-independent.

Math per sealed block of ``B`` tokens, for the ``G`` query heads of one kv head (its K/V read once):

* keys whose scale is constant over the block's tokens (tensor/head/channel granularity) are folded into
  the query once per block: ``qf[g, c] = q[g, c] * s[c]``, plus a per-block constant
  ``kc[g] = sum_c q[g, c] * (z[c] - off * s[c])`` that carries zero-points and offset-binary codes; the
  loop over tokens is then a dot of ``qf`` with the raw codes;
* keys with per-token scales: the dot is scaled per token (token granularity) or the codes are scaled
  per group while decoded (group granularity), zero-points add ``sum_grp qsum[g, grp] * z[t, grp]``;
* values: a per-token (or per-block) scale goes into the attention weight, ``w = p[t] * s[t]``; scales
  along the row (groups, channels) multiply the codes while they are decoded; zero-points and offsets
  add ``sum_t p[t] * (z - off * s)`` per group, once at the end;
* online softmax in base 2 (the query is pre-multiplied by ``sm_scale * log2(e)``) with a vectorizable
  polynomial ``exp2``; the tail is one more block with a passthrough spec.

Work per block: rows are decoded ``TILE`` (8) at a time into a small float32 tile (2-4 KB, it stays in
L1; the history is never materialized), then dotted with four query heads at once (16 accumulators in
registers) and accumulated into four heads' outputs per pass (one load/store of the accumulator per 8
tokens). The next block's rows, scales and zero-points are prefetched while a block is computed: block
ids are arbitrary, so the hardware prefetcher cannot guess them.

Packed int4/int2 rows are read in "plane order": element ``per * j + k`` of a row is plane ``k``, byte
``j``; the query is permuted into the keys' plane order and the accumulator lives in the values' plane
order (permuted back at the end), so every inner loop runs over contiguous bytes with constant shifts.

Numba details that decide the speed: index arithmetic in inner loops is unsigned (numba wraps negative
signed indices, and that select blocks vectorization); bit tricks stay in int32 (int64 lanes halve the
vector width); the per-block helpers are compiled without reference counting (numba's ``_nrt=False``:
otherwise every call increfs and decrefs each array argument, atomics that cost more than a tile's
arithmetic). This module is one file on purpose: numba's disk cache is invalidated by the source file
of the cached function only, so helpers kept in another file could be served stale.

Long histories are split into chunks of blocks (work items: batch x kv_heads x chunks) that threads run
in parallel; chunk results ``(max, sum, acc)`` are merged with log-sum-exp (:func:`merge`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import literally, njit, types
from numba.core import cgutils
from numba.core.options import DefaultOptions
from numba.extending import intrinsic

# payload kinds
S8, U8, U4, U2, E4M3, E5M2, FLT = range(7)
# passthrough float kinds (FLT rows: tails and fp16/bf16/fp32 formats)
FK_F16, FK_BF16, FK_F32 = range(3)
# scale / zero-point kinds
SC_NONE, SC_F32, SC_F16, SC_BF16, SC_E8M0 = range(5)
# indices of a spec's parameter vector
P_KIND, P_OFF, P_PER, P_SKIND, P_ZKIND, P_HS, P_TS, P_CS, P_ROW, P_FK = range(10)
N_PARAMS = 10

# No ninf: -inf marks positions outside the window and must survive max() and exp2().
FASTMATH = {"nnan", "reassoc", "contract", "nsz", "arcp", "afn"}
# Helpers that allocate nothing skip reference counting (see the module docstring); the option is
# numba's private one, so it is only passed where this numba knows it.
_NOREF = {"_nrt": False} if hasattr(DefaultOptions, "_nrt") else {}
TILE = 8  # rows decoded at a time

U64 = np.uint64
_LOG2_MIN = np.float32(-126.0)
# 2**f on [-0.5, 0.5], relative error 2.3e-7 in float32 (least squares on Chebyshev nodes)
_C0, _C1, _C2, _C3, _C4, _C5 = (
    np.float32(1.00000007),
    np.float32(0.69314695),
    np.float32(0.24022122),
    np.float32(0.05550743),
    np.float32(0.00967546),
    np.float32(0.0013267),
)
_TWO_M24 = np.float32(2.0**-24)
_TWO_M9 = np.float32(2.0**-9)
_TWO_M127 = np.float32(2.0**-127)
_ZERO = np.float32(0.0)


@intrinsic
def _as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (free: a register bitcast)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hint the cache to fetch the line holding ``arr[idx]`` (1-D array; never faults, never checked)."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer2(context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
                                        strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                        inds=[args[1]], wraparound=False)  # fmt: skip
        ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        name = "llvm.prefetch.p0" if str(ptr.type) == "ptr" else "llvm.prefetch.p0i8"  # opaque or typed pointers
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@njit(**_NOREF)
def _prefetch_rows(pay, kind, fk, base, rs, t, nt):
    """Prefetch rows ``t .. t + nt - 1`` of a block (flat offset ``base + row * rs`` elements)."""
    start = base + U64(t) * rs
    n = U64(nt) * rs
    if kind != FLT:
        for off in range(U64(0), n, U64(64)):
            _prefetch(pay[0], start + off)
    elif fk == FK_F32:
        for off in range(U64(0), n, U64(16)):
            _prefetch(pay[2], start + off)
    else:
        for off in range(U64(0), n, U64(32)):
            _prefetch(pay[1], start + off)


@njit(**_NOREF)
def _prefetch_scales(arrs, kind, o, n):
    """Prefetch ``n`` stored scales (or zero-points) at flat offset ``o``."""
    if kind == SC_F32:
        for off in range(U64(0), U64(n), U64(16)):
            _prefetch(arrs[2], o + off)
    elif kind == SC_F16 or kind == SC_BF16:
        for off in range(U64(0), U64(n), U64(32)):
            _prefetch(arrs[1], o + off)
    elif kind == SC_E8M0:
        for off in range(U64(0), U64(n), U64(64)):
            _prefetch(arrs[0], o + off)


@njit(fastmath=FASTMATH, **_NOREF)
def _exp2(x):
    """2**x for float32 ``x <= 0`` (exactly 0 below 2**-126, so -inf gives 0); vectorizes."""
    xc = max(x, _LOG2_MIN)
    xi = np.rint(xc)
    f = xc - xi
    p = _C5 * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    r = _as_f32((np.int32(xi) + np.int32(127)) << np.int32(23)) * p
    return r if x > _LOG2_MIN else _ZERO


@njit(**_NOREF)
def _half(h):
    """IEEE fp16 bits (any int holding 16 bits) to float32; branch-free, so loops over it vectorize."""
    hi = np.int32(h)
    sign = np.int32(hi & np.int32(0x8000)) << np.int32(16)
    em = np.int32(hi & np.int32(0x7FFF))
    normal = _as_f32(sign | np.int32((em << np.int32(13)) + np.int32(112 << 23)))
    sub = np.float32(em) * _TWO_M24  # zero / subnormal: em * 2**-24
    sub = -sub if sign else sub
    special = _as_f32(sign | np.int32(0x7F800000) | (np.int32(em & np.int32(0x3FF)) << np.int32(13)))
    r = sub if em < 0x0400 else normal
    return special if em >= 0x7C00 else r


@njit(**_NOREF)
def _bf16(h):
    return _as_f32(np.int32(h) << np.int32(16))


@njit(**_NOREF)
def _e4m3(b):
    """float8_e4m3fn byte to float32 (bias 7, no infinities, 0x7f/0xff are NaN)."""
    bi = np.int32(b)
    sign = np.int32(bi & np.int32(0x80)) << np.int32(24)
    em = np.int32(bi & np.int32(0x7F))
    if em == 0x7F:
        return np.float32(np.nan)
    if em < 8:  # zero / subnormal: em * 2**-9
        v = np.float32(em) * _TWO_M9
        return -v if sign else v
    return _as_f32(sign | np.int32((em << np.int32(20)) + np.int32(120 << 23)))


@njit(fastmath=FASTMATH, **_NOREF)
def _decode_rows(kind, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf):
    """Codes of rows ``t .. t + nt - 1`` (flat offset ``base + row * rs``) as float32 into ``buf``
    ``[TILE, D]``, plane order; tile rows past ``nt`` repeat the last row (valid numbers, weight 0 later).

    With ``cs > 0`` the codes are multiplied by scales that vary along the row (value groups, key groups,
    per-channel values): ``sv[grp * svt + token]`` (``svt`` 1 when they do not depend on the token), ``cs``
    groups of ``dp // cs`` consecutive bytes of every plane; ``sx`` ``[dp]`` is scratch for one token's
    scale per byte. Compiled once per payload kind. Packed int4/int2 bytes are unpacked one plane per loop
    (constant shifts, one store stream each); FLT rows (passthrough: tails and fp16/bf16/fp32 formats) are
    read in the plane order of ``per`` and never scaled.
    """
    literally(kind)
    ud = U64(dp)
    scaled = cs > 0
    span = U64(dp // cs) if scaled else U64(0)
    for r in range(TILE):
        row = t + min(r, nt - 1)
        o = base + U64(row) * rs
        if scaled and kind != FLT:
            tok = row if svt > 1 else 0
            for grp in range(cs):
                v = sv[grp * svt + tok]
                gb = U64(grp) * span
                for j in range(span):
                    sx[gb + j] = v
        if kind == S8:
            for j in range(ud):
                c = np.float32(np.int8(p8[o + j]))
                buf[r, j] = c * sx[j] if scaled else c
        elif kind == U8:
            for j in range(ud):
                c = np.float32(p8[o + j])
                buf[r, j] = c * sx[j] if scaled else c
        elif kind == E4M3:
            for j in range(ud):
                c = _e4m3(p8[o + j])
                buf[r, j] = c * sx[j] if scaled else c
        elif kind == E5M2:
            for j in range(ud):
                c = _half(np.int32(p8[o + j]) << np.int32(8))  # e5m2 is the top byte of an fp16
                buf[r, j] = c * sx[j] if scaled else c
        elif kind == U4:
            for j in range(ud):
                c = np.float32(np.int32(p8[o + j]) & np.int32(15))
                buf[r, j] = c * sx[j] if scaled else c
            for j in range(ud):
                c = np.float32(np.int32(p8[o + j]) >> np.int32(4))
                buf[r, ud + j] = c * sx[j] if scaled else c
        elif kind == U2:
            for j in range(ud):
                c = np.float32(np.int32(p8[o + j]) & np.int32(3))
                buf[r, j] = c * sx[j] if scaled else c
            for j in range(ud):
                c = np.float32(np.int32(np.int32(p8[o + j]) >> np.int32(2)) & np.int32(3))
                buf[r, ud + j] = c * sx[j] if scaled else c
            for j in range(ud):
                c = np.float32(np.int32(np.int32(p8[o + j]) >> np.int32(4)) & np.int32(3))
                buf[r, U64(2) * ud + j] = c * sx[j] if scaled else c
            for j in range(ud):
                c = np.float32(np.int32(p8[o + j]) >> np.int32(6))
                buf[r, U64(3) * ud + j] = c * sx[j] if scaled else c
        else:
            pu = U64(per)
            for k in range(per):
                kb = U64(k) * ud
                ku = U64(k)
                if fk == FK_F16:
                    for j in range(ud):
                        buf[r, kb + j] = _half(p16[o + pu * j + ku])
                elif fk == FK_BF16:
                    for j in range(ud):
                        buf[r, kb + j] = _bf16(p16[o + pu * j + ku])
                else:
                    for j in range(ud):
                        buf[r, kb + j] = p32[o + pu * j + ku]


@njit(fastmath=FASTMATH, **_NOREF)
def _decode_tile(kind, pay, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf, nxt_base):
    """:func:`_decode_rows` for a runtime ``kind`` (the one place a payload kind picks its decoder); also
    prefetches the same rows of the next block (at flat offset ``nxt_base``; 0: none)."""
    p8, p16, p32 = pay
    if nxt_base:
        _prefetch_rows(pay, kind, fk, nxt_base, rs, t, nt)
    if kind == S8:
        _decode_rows(S8, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    elif kind == U8:
        _decode_rows(U8, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    elif kind == U4:
        _decode_rows(U4, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    elif kind == U2:
        _decode_rows(U2, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    elif kind == E4M3:
        _decode_rows(E4M3, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    elif kind == E5M2:
        _decode_rows(E5M2, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)
    else:
        _decode_rows(FLT, p8, p16, p32, base, rs, t, nt, per, dp, fk, sv, svt, cs, sx, buf)


@njit(fastmath=FASTMATH, **_NOREF)
def _kdot_tile(buf, nt, qf, out, t, mx):
    """``out[g, t + r] = sum_i qf[g, i] * buf[r, i]`` for tile rows ``r < nt``; ``mx[g]`` keeps the max.

    buf: ``[TILE, D]`` decoded codes; qf: ``[G4, D]`` (rows past G are padding); out: ``[G, *]``. Rows go
    four and heads four at a time, so each decoded element feeds 16 independent accumulators.
    """
    g_n = out.shape[0]
    d = U64(buf.shape[1])
    for r0 in range(0, nt, 4):
        _kdot4(buf, r0, nt - r0, qf, out, t + r0, mx, g_n, d)


@njit(fastmath=FASTMATH, **_NOREF)
def _kdot4(buf, r0, nt, qf, out, t, mx, g_n, d):
    """Rows ``r0 .. r0 + min(nt, 4) - 1`` of :func:`_kdot_tile`."""
    for g0 in range(0, g_n, 4):
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _ZERO
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = _ZERO
        for i in range(d):
            x0 = buf[r0, i]
            x1 = buf[r0 + 1, i]
            x2 = buf[r0 + 2, i]
            x3 = buf[r0 + 3, i]
            qa = qf[g0, i]
            qb = qf[g0 + 1, i]
            qc = qf[g0 + 2, i]
            qd = qf[g0 + 3, i]
            a0 += qa * x0
            a1 += qa * x1
            a2 += qa * x2
            a3 += qa * x3
            b0 += qb * x0
            b1 += qb * x1
            b2 += qb * x2
            b3 += qb * x3
            c0 += qc * x0
            c1 += qc * x1
            c2 += qc * x2
            c3 += qc * x3
            d0 += qd * x0
            d1 += qd * x1
            d2 += qd * x2
            d3 += qd * x3
        for gi, s0, s1, s2, s3 in ((0, a0, a1, a2, a3), (1, b0, b1, b2, b3), (2, c0, c1, c2, c3), (3, d0, d1, d2, d3)):
            g = g0 + gi
            if g < g_n:
                for r, s in enumerate((s0, s1, s2, s3)):
                    if r < nt:
                        out[g, t + r] = s
                        mx[g] = s if s > mx[g] else mx[g]


@njit(**_NOREF)
def _w8(w, g, g_n, t, nt):
    """Weights ``w[g, t:t + 8]`` of one head, zero past ``nt`` rows or past the last head."""
    if g >= g_n:
        return (_ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO)
    return (
        w[g, t],
        w[g, t + 1] if nt > 1 else _ZERO,
        w[g, t + 2] if nt > 2 else _ZERO,
        w[g, t + 3] if nt > 3 else _ZERO,
        w[g, t + 4] if nt > 4 else _ZERO,
        w[g, t + 5] if nt > 5 else _ZERO,
        w[g, t + 6] if nt > 6 else _ZERO,
        w[g, t + 7] if nt > 7 else _ZERO,
    )


@njit(**_NOREF)
def _dot8(wt, x0, x1, x2, x3, x4, x5, x6, x7):
    """``sum_r wt[r] * x_r`` as a balanced tree (short dependency chains)."""
    return ((wt[0] * x0 + wt[1] * x1) + (wt[2] * x2 + wt[3] * x3)) + (
        (wt[4] * x4 + wt[5] * x5) + (wt[6] * x6 + wt[7] * x7)
    )


@njit(fastmath=FASTMATH, **_NOREF)
def _vacc8(buf, nt, w, t, acc, g_n):
    """``acc[g, i] += sum_{r < nt} w[g, t + r] * buf[r, i]`` for heads ``g < g_n``.

    buf: ``[TILE, D]`` decoded rows (rows past ``nt`` repeat a valid row and get weight 0); w: ``[G, B]``;
    acc: ``[G4, D]`` (G rounded up to 4; the padding rows are scratch). Four heads are updated per pass
    over the tile, eight rows per load/store of the accumulator.
    """
    d = U64(buf.shape[1])
    for g0 in range(0, g_n, 4):
        wa = _w8(w, g0, g_n, t, nt)
        wb = _w8(w, g0 + 1, g_n, t, nt)
        wc = _w8(w, g0 + 2, g_n, t, nt)
        wd = _w8(w, g0 + 3, g_n, t, nt)
        aa = acc[g0]
        ab = acc[g0 + 1]
        ac = acc[g0 + 2]
        ad = acc[g0 + 3]
        for i in range(d):
            x0 = buf[0, i]
            x1 = buf[1, i]
            x2 = buf[2, i]
            x3 = buf[3, i]
            x4 = buf[4, i]
            x5 = buf[5, i]
            x6 = buf[6, i]
            x7 = buf[7, i]
            aa[i] += _dot8(wa, x0, x1, x2, x3, x4, x5, x6, x7)
            ab[i] += _dot8(wb, x0, x1, x2, x3, x4, x5, x6, x7)
            ac[i] += _dot8(wc, x0, x1, x2, x3, x4, x5, x6, x7)
            ad[i] += _dot8(wd, x0, x1, x2, x3, x4, x5, x6, x7)


@njit(fastmath=FASTMATH, **_NOREF)
def _scales(arrs, kind, o, n, out):
    """``out[:n]`` = the stored scales (or zero-points) at flat offset ``o``, as float32 (0 for none)."""
    if kind == SC_F32:
        src32 = arrs[2]
        for i in range(U64(n)):
            out[i] = src32[o + i]
    elif kind == SC_F16:
        src16 = arrs[1]
        for i in range(U64(n)):
            out[i] = _half(src16[o + i])
    elif kind == SC_BF16:
        src16 = arrs[1]
        for i in range(U64(n)):
            out[i] = _bf16(src16[o + i])
    elif kind == SC_E8M0:
        src8 = arrs[0]
        for i in range(U64(n)):
            e = np.int32(src8[o + i])
            out[i] = _as_f32(e << np.int32(23)) if e > 0 else _TWO_M127
    else:
        for i in range(n):
            out[i] = _ZERO


@njit(fastmath=FASTMATH, **_NOREF)
def _scales_t(arrs, kind, o, nt, cs, tmp, out):
    """The ``[nt, cs]`` slab of scales at flat offset ``o``, transposed: ``out[grp * nt + t]`` (float32),
    so loops over the tokens of one group run with unit stride. ``tmp``: scratch of ``nt * cs``."""
    _scales(arrs, kind, o, nt * cs, tmp)
    if cs == 1:
        for t in range(nt):
            out[t] = tmp[t]
        return
    for t in range(nt):
        for grp in range(cs):
            out[grp * nt + t] = tmp[t * cs + grp]


@njit(fastmath=FASTMATH, **_NOREF)
def _attend(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j0, j1, n, lo, tail, h, kv_heads, bs, st):
    """Attend row ``b``'s sealed blocks ``[j0, j1)`` (or, when ``tail``, its tail), positions ``>= lo`` only.

    The block loop lives here so the many array arguments are passed once per chunk, not once per block.
    tables: ``[batch, max_blocks]`` int32; n: the row's seq_len; for the tail, kpay/vpay are the tails'
    views and kp/vp their passthrough specs, and the "block" is indexed by ``b``. kp/vp: spec parameters;
    ``st`` = (qp, qsum, m, lsum, acc, zacc, sc, w, mxb, qf, kc, sk, zk, sv, zv, pk, zp, buf, sx):
    qp ``[G4, D]`` the query in the keys' plane order, pre-scaled by ``sm_scale * log2(e)`` (G rounded up to
    a multiple of 4, padding rows zero); qsum
    ``[G, nkg]`` its sums per key scale group; m, lsum ``[G]`` running max (base 2) and sum; acc ``[G, D]``
    in the values' plane order; zacc ``[G, nvg]`` zero-point / offset terms per value group; buf
    ``[TILE, D]`` the decoded rows; mxb ``[G]`` the block's max logit per head; the rest is scratch.
    """
    qp, qsum, m, lsum, acc, zacc, sc, w, mxb, qf, kc, sk, zk, sv, zv, pk, zp, buf, sx = st
    g_n, d = sc.shape[0], qp.shape[1]
    kper, kskind, kts, kcs = kp[P_PER], kp[P_SKIND], kp[P_TS], kp[P_CS]
    vper, vskind, vts, vcs = vp[P_PER], vp[P_SKIND], vp[P_TS], vp[P_CS]
    kdp = d // kper
    vdp = d // vper
    khs = h // (kv_heads // kp[P_HS])
    vhs = h // (kv_heads // vp[P_HS])
    koff = np.float32(kp[P_OFF])
    voff = np.float32(vp[P_OFF])
    krs = U64(kp[P_ROW])
    vrs = U64(vp[P_ROW])
    grouped = kskind != SC_NONE and kts > 1
    for j in range(j0, j1):
        if tail:
            idx = b
            pos0 = (n // bs) * bs
            t1 = n - pos0
        else:
            idx = np.int64(tables[b, j])
            pos0 = j * bs
            t1 = bs
            if idx == 0:  # released (left the window): never read the null block
                continue
        if pos0 + t1 <= lo:
            continue
        t0 = max(lo - pos0, 0)
        u0, u1 = U64(t0), U64(t1)  # unsigned token bounds: see the module docstring on indices
        # the next block is fetched while this one is computed (block ids are random: no hardware prefetch)
        nxt = np.int64(tables[b, j + 1]) if (not tail and j + 1 < j1) else np.int64(0)
        knext = U64(nxt * kv_heads + h) * U64(bs) * krs if nxt else U64(0)
        vnext = U64(nxt * kv_heads + h) * U64(bs) * vrs if nxt else U64(0)
        if nxt:  # its scales and zero-points too: a few scattered cache lines per block
            kn = kts * kcs
            kso = U64((nxt * kp[P_HS] + khs) * kn)
            _prefetch_scales(kscl, kskind, kso, kn)
            _prefetch_scales(kzero, kp[P_ZKIND], kso, kn)
            vn = vts * vcs
            vso = U64((nxt * vp[P_HS] + vhs) * vn)
            _prefetch_scales(vscl, vskind, vso, vn)
            _prefetch_scales(vzero, vp[P_ZKIND], vso, vn)
        # ---- keys -> base-2 logits sc[g, t] + kc[g]
        kbase = U64(idx * kv_heads + h) * U64(bs) * krs
        qsrc = qp
        for g in range(g_n):
            kc[g] = _ZERO
        if kskind != SC_NONE and not grouped:
            # scale constant over the block's tokens: fold it into the query once per block
            so = U64((idx * kp[P_HS] + khs) * kcs)
            _scales(kscl, kskind, so, kcs, sk)
            _scales(kzero, kp[P_ZKIND], so, kcs, zk)
            if kcs == 1:
                for i in range(d):
                    pk[i] = sk[0]
                    zp[i] = zk[0] - koff * sk[0]
            else:
                for k in range(kper):  # natural channel kper * j + k -> plane index k * kdp + j
                    kb = U64(k * kdp)
                    for jj in range(U64(kdp)):
                        c = U64(kper) * jj + U64(k)
                        pk[kb + jj] = sk[c]
                        zp[kb + jj] = zk[c] - koff * sk[c]
            for g in range(g_n):
                c0 = _ZERO
                for i in range(d):
                    qf[g, i] = qp[g, i] * pk[i]
                    c0 += qp[g, i] * zp[i]
                kc[g] = c0
            qsrc = qf
        elif grouped:
            # per-token scales (token or group granularity); groups are applied to the decoded tile
            so = U64((idx * kp[P_HS] + khs) * bs * kcs)
            _scales_t(kscl, kskind, so, bs, kcs, pk, sk)  # sk[grp * bs + t]
            _scales_t(kzero, kp[P_ZKIND], so, bs, kcs, pk, zk)
        for g in range(g_n):
            mxb[g] = -np.inf
        for t in range(t0, t1, TILE):
            nt = min(TILE, t1 - t)
            _decode_tile(kp[P_KIND], kpay, kbase, krs, t, nt, kper, kdp, kp[P_FK], sk, bs,
                         kcs if (grouped and kcs > 1) else 0, sx, buf, knext)  # fmt: skip
            _kdot_tile(buf, nt, qsrc, sc, t, mxb)
            if grouped:  # per-token scale / zero-point terms; the max is taken again below
                for g in range(g_n):
                    for r in range(nt):
                        tr = t + r
                        if kcs == 1:
                            sc[g, tr] = sc[g, tr] * sk[tr] + qsum[g, 0] * (zk[tr] - koff * sk[tr])
                        else:
                            zt = _ZERO
                            for grp in range(kcs):
                                e = grp * bs + tr
                                zt += qsum[g, grp] * (zk[e] - koff * sk[e])
                            sc[g, tr] += zt
        # ---- online softmax (base 2)
        for g in range(g_n):
            mb = mxb[g]
            if grouped:
                mb = sc[g, t0]
                for t in range(u0, u1):
                    x = sc[g, t]
                    mb = x if x > mb else mb
            mb += kc[g]
            mnew = mb if mb > m[g] else m[g]
            alpha = _exp2(m[g] - mnew)
            shift = kc[g] - mnew
            ls = _ZERO
            for t in range(u0, u1):
                p = _exp2(sc[g, t] + shift)
                sc[g, t] = p
                ls += p
            lsum[g] = lsum[g] * alpha + ls
            m[g] = mnew
            if alpha != 1.0:
                for i in range(d):
                    acc[g, i] *= alpha
                for grp in range(zacc.shape[1]):
                    zacc[g, grp] *= alpha
        # ---- values: the per-token (group) scale folded into the weight, zero-points summed per group
        vbase = U64(idx * kv_heads + h) * U64(bs) * vrs
        if vskind != SC_NONE:
            so = U64((idx * vp[P_HS] + vhs) * vts * vcs)
            _scales_t(vscl, vskind, so, vts, vcs, pk, sv)  # sv[grp * vts + t]
            _scales_t(vzero, vp[P_ZKIND], so, vts, vcs, pk, zv)
            for grp in range(vcs if (vp[P_ZKIND] != SC_NONE or voff != 0) else 0):
                # zero-point / offset terms: sum_t p * (z - off * s), per group
                gb = U64(grp * vts)
                for g in range(g_n):
                    zsum = _ZERO
                    if vts > 1:
                        for t in range(u0, u1):
                            zsum += sc[g, t] * (zv[gb + t] - voff * sv[gb + t])
                    else:
                        zz = zv[grp] - voff * sv[grp]
                        for t in range(u0, u1):
                            zsum += sc[g, t] * zz
                    zacc[g, grp] += zsum
            for g in range(g_n):  # weights: p, times the scale when it is one per token (or block)
                if vcs == 1 and vts > 1:
                    for t in range(u0, u1):
                        w[g, t] = sc[g, t] * sv[t]
                else:
                    s0 = sv[0] if vcs == 1 else np.float32(1.0)
                    for t in range(u0, u1):
                        w[g, t] = sc[g, t] * s0
        else:
            for g in range(g_n):
                for t in range(u0, u1):
                    w[g, t] = sc[g, t]
        for t in range(t0, t1, TILE):
            nt = min(TILE, t1 - t)
            # scales along the row (groups, channels) are applied to the decoded rows
            _decode_tile(vp[P_KIND], vpay, vbase, vrs, t, nt, vper, vdp, vp[P_FK], sv, vts,
                         vcs if (vskind != SC_NONE and vcs > 1) else 0, sx, buf, vnext)  # fmt: skip
            _vacc8(buf, nt, w, t, acc, g_n)


@njit(cache=True)
def plan(seq_lens, start_pos, window, block_size, kv_heads, target_items, min_chunk):
    """Split the work into items ``(row, head, first_block, end_block, with_tail)``.

    Returns ``(items [n, 5] int64, first [batch * kv_heads + 1] int64)``: the items of ``(row, head)`` are
    ``items[first[row * kv_heads + head]:first[row * kv_heads + head + 1]]``.
    """
    batch = seq_lens.shape[0]
    lo = np.empty(batch, np.int64)
    nblk = np.zeros(batch, np.int64)
    total = 0
    for b in range(batch):
        n = np.int64(seq_lens[b])
        lo_b = max(np.int64(start_pos[b]), 0)
        if window >= 0:
            lo_b = max(lo_b, n - window)
        lo[b] = lo_b
        if lo_b < n:
            nblk[b] = max(n // block_size - lo_b // block_size, 0)
            total += (nblk[b] + 1) * kv_heads
    chunk = max(min_chunk, -(-total // max(target_items, 1)))
    nitems = 0
    for b in range(batch):
        if lo[b] < seq_lens[b]:
            nitems += max(1, -(-nblk[b] // chunk)) * kv_heads
    items = np.empty((nitems, 5), np.int64)
    first = np.zeros(batch * kv_heads + 1, np.int64)
    it = 0
    for b in range(batch):
        n = np.int64(seq_lens[b])
        for h in range(kv_heads):
            first[b * kv_heads + h] = it
            if lo[b] >= n:
                continue
            j0 = lo[b] // block_size
            nb = n // block_size
            splits = max(1, -(-nblk[b] // chunk))
            for s in range(splits):
                items[it, 0] = b
                items[it, 1] = h
                items[it, 2] = min(j0 + s * chunk, nb)
                items[it, 3] = min(j0 + (s + 1) * chunk, nb) if s < splits - 1 else nb
                items[it, 4] = 1 if (s == splits - 1 and n % block_size > 0) else 0
                it += 1
    first[batch * kv_heads] = it
    return items, first


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def work(i0, i1, items, q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tailk, tailv, tpk, tpv, tables, seq_lens,
         start_pos, window, qscale, kv_heads, block_size, pm, pl, pacc):  # fmt: skip
    """Run work items ``[i0, i1)`` (releases the GIL: the launcher runs slices on several threads).

    q: ``[batch, Hq, D]`` float32. kpay/vpay: flat (uint8, uint16, float32) views of the payload pools
    ``[num_blocks, H, B, P]``; kscl/vscl, kzero/vzero: flat views of ``[num_blocks, Hs, Ts, Cs]``; kp/vp:
    int64 spec parameters (``P_*``); tailk/tailv: flat views of the tails ``[batch, H, B, D]``, read with
    the passthrough specs tpk/tpv (same plane order as kp/vp); tables: ``[batch, max_blocks]`` int32;
    seq_lens, start_pos: ``[batch]`` int32; window: -1 for none; qscale: ``sm_scale * log2(e)``;
    items: from :func:`plan`. Writes the partial results pm, pl ``[n_items, G]`` (base-2 max, sum) and
    pacc ``[n_items, G, D]`` (unnormalized output, natural channel order).
    """
    hq, d = q.shape[1], q.shape[2]
    g_n = hq // kv_heads
    bs = block_size
    kper = kp[P_PER]
    vper = vp[P_PER]
    kdp = d // kper
    vdp = d // vper
    nkg = kp[P_CS] if (kp[P_TS] > 1 and kp[P_SKIND] != SC_NONE) else 1
    nvg = vp[P_CS] if vp[P_SKIND] != SC_NONE else 1
    vgs = d // nvg
    kspan = (d // nkg) // kper
    nscr = max(d, kp[P_TS] * kp[P_CS], vp[P_TS] * vp[P_CS])
    g4 = (g_n + 3) // 4 * 4  # heads are processed four at a time; rows past g_n are zero padding
    qp = np.zeros((g4, d), np.float32)
    qsum = np.zeros((g_n, nkg), np.float32)
    m = np.empty(g_n, np.float32)
    lsum = np.empty(g_n, np.float32)
    acc = np.empty((g4, d), np.float32)
    zacc = np.empty((g_n, nvg), np.float32)
    st = (qp, qsum, m, lsum, acc, zacc, np.empty((g_n, bs), np.float32), np.empty((g_n, bs), np.float32),
          np.empty(g_n, np.float32), np.zeros((g4, d), np.float32), np.empty(g_n, np.float32),
          np.empty(nscr, np.float32), np.empty(nscr, np.float32), np.empty(nscr, np.float32),
          np.empty(nscr, np.float32), np.empty(nscr, np.float32), np.empty(nscr, np.float32),
          np.empty((TILE, d), np.float32), np.empty(d, np.float32))  # fmt: skip
    for it in range(i0, i1):
        b = items[it, 0]
        h = items[it, 1]
        n = np.int64(seq_lens[b])
        lo = max(np.int64(start_pos[b]), 0)
        if window >= 0:
            lo = max(lo, n - window)
        for g in range(g_n):
            for k in range(kper):
                for j in range(kdp):
                    qp[g, k * kdp + j] = q[b, h * g_n + g, kper * j + k] * qscale
            for grp in range(nkg):
                s = _ZERO
                for k in range(kper):
                    for j in range(kspan):
                        s += qp[g, k * kdp + grp * kspan + j]
                qsum[g, grp] = s
        m[:] = -np.inf
        lsum[:] = 0.0
        acc[:] = 0.0
        zacc[:] = 0.0
        _attend(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, items[it, 2], items[it, 3], n, lo, False, h,
                kv_heads, bs, st)  # fmt: skip
        if items[it, 4]:  # the tail: one more block, passthrough, indexed by the sequence's row
            _attend(tailk, kscl, kzero, tpk, tailv, vscl, vzero, tpv, tables, b, 0, 1, n, lo, True, h, kv_heads, bs, st)
        for g in range(g_n):
            pm[it, g] = m[g]
            pl[it, g] = lsum[g]
            for k in range(vper):
                for j in range(vdp):
                    c = vper * j + k
                    pacc[it, g, c] = acc[g, k * vdp + j] + zacc[g, c // vgs]


@njit(fastmath=FASTMATH, cache=True)
def merge(first, kv_heads, pm, pl, pacc, out):
    """Combine the chunks of each ``(row, head)`` with log-sum-exp into ``out`` ``[batch, Hq, D]`` float32.

    first: ``[batch * kv_heads + 1]`` from :func:`plan`; pm, pl, pacc: the partials from :func:`work`.
    A row with nothing to attend gets zeros.
    """
    g_n = out.shape[1] // kv_heads
    d = out.shape[2]
    for bh in range(first.shape[0] - 1):
        b = bh // kv_heads
        h = bh % kv_heads
        i0 = first[bh]
        i1 = first[bh + 1]
        for g in range(g_n):
            o = out[b, h * g_n + g]
            o[:] = 0.0
            mx = np.float32(-np.inf)
            for it in range(i0, i1):
                mx = max(mx, pm[it, g])
            if mx == -np.inf:
                continue
            den = _ZERO
            for it in range(i0, i1):
                if pm[it, g] == -np.inf:
                    continue
                f = _exp2(pm[it, g] - mx)
                den += f * pl[it, g]
                for i in range(d):
                    o[i] += f * pacc[it, g, i]
            inv = np.float32(1.0) / den
            for i in range(d):
                o[i] *= inv
