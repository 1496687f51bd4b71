"""Compiled loops of the fused CPU decode kernel (numba, cached on disk). Launch it through
:mod:`kvpack.kernels.cpu`, which checks shapes, builds the arguments and runs :func:`work` on threads.

One set of compiled functions serves every format, so the code is compiled once per machine: pools
arrive flattened as tuples of typed views ``(uint8, uint16, float32)`` (only the slot a spec uses is real,
the others are 1-element dummies) and a spec is a small int vector (the ``P_*`` indices). A pool is
contiguous within a block; its block stride is a parameter (``P_BST``, ``P_SBST``, ``P_ZBST``), so pools
that are views into larger pages per block are read in place. The decoder is compiled once per payload
kind (``literally``), everything else is kind-independent.

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
  polynomial ``exp2``; the tail is one more block with a passthrough spec, in natural channel order (the
  accumulator is put into that order before it); float32 rows (tails, the fp32 format) are read in place.

Work per block: rows are decoded ``TILE`` (8) at a time into a small float32 tile (2-4 KB, it stays in
L1; the history is never materialized), then dotted with four query heads at once (16 accumulators in
registers) and accumulated into four heads' outputs per pass (one load/store of the accumulator per 8
tokens). The rows, scales and zero-points of the block after next are prefetched while a block is
computed: block ids are arbitrary, so the hardware prefetcher cannot guess them.

Integer path (int8/int4/int2 and fp8 codes on AVX-512 BW CPUs, see :func:`_kdot_ir`, :func:`_vdot_ir`): the
codes are never converted to float (fp8 bytes become int16 words on a 12-bit grid through a table,
:func:`_ir_lut`; one code unit is then worth :func:`_code_unit`). The folded query is rounded to int16 once per block and head
(:func:`_q16_keys`) and dotted with the codes widened to int16 words by ``vpdpwssd`` (exact int32 sums),
four rows by four heads per pass, the sixteen sums reduced together by a transposing shuffle tree; the
attention weights are rounded to int16 per block (:func:`_w16_values`) and two rows at a time are
interleaved word by word, so one ``vpdpwssd`` accumulates 16 channels of both rows. Offset-binary codes
are centred in the loop (``code - off``), which leaves the per-block constants without the offset. These
two loops are LLVM IR text (numba has no vector types) linked into the caller; they also prefetch the
block after next into L2 and (rows of 128 bytes or more: int8) the next block into L1, spread over their
own loops. Outlier key channels add ``q[idx_j] * r[t, j]`` to the scores (:func:`_outlier_scores`).
A block whose operands would lose more than the format (the folded query or the value scales spread over too
many binary orders: one huge key or value; fp8 codes far below the table's range: tiny data under a clamped
scale) takes the float path instead (:func:`_keys_fit`, :func:`_values_fit`; bounds from ``cpu._int_dot_guards``).
Where keys and values both take the integer path (key scales constant over a block, no outlier channels),
the blocks go in runs (:func:`_attend_runs`) that share one softmax step (:func:`_attend_multi`): the max
comes from the key loop, and the exponentials and the rescale run once per run instead of once per block.

Packed int4/int2 rows are read in "plane order": element ``per * j + k`` of a row is plane ``k``, byte
``j``; the query is permuted into the keys' plane order and the accumulator lives in the values' plane
order (permuted back at the end), so every inner loop runs over contiguous bytes with constant shifts.

Numba details that decide the speed: index arithmetic in inner loops is unsigned (numba wraps negative
signed indices, and that select blocks vectorization); bit tricks stay in int32 (int64 lanes halve the
vector width); the per-block helpers are compiled without reference counting (numba's ``_nrt=False``:
otherwise every call increfs and decrefs each array argument, atomics that cost more than a tile's
arithmetic), and those called once per block are inlined into the block loop (``inline="always"``: as
calls, their exploded array arguments were pushed and reloaded every block); float max reductions are done
on int32 order keys (:func:`_order_key`: LLVM keeps float max reductions scalar). This module is one file on purpose: numba's disk cache is invalidated by the source
file of the cached function only, so helpers (the IR text generators included) kept in another file
could be served stale.

Long histories are split into chunks of blocks (work items: batch x kv_heads x chunks). Each thread calls
:func:`work` once and takes items from a shared lock-free queue (:func:`take_item`: its own run in order,
then the tail ends of the others'); a thread that takes the item after the one it just did carries the
softmax state on, so only items taken by different threads leave separate results ``(max, sum, acc)``,
merged with log-sum-exp (:func:`merge`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
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
(P_KIND, P_OFF, P_PER, P_SKIND, P_ZKIND, P_HS, P_TS, P_CS, P_ROW, P_FK, P_DOT, P_NOUT, P_IDX16, P_FAR,
 P_MULTI, P_BST, P_SBST, P_ZBST, P_SPREAD, P_CMIN) = range(20)  # fmt: skip
N_PARAMS = 20
# P_BST, P_SBST, P_ZBST: elements between consecutive blocks of the payload, scale and zero-point pools (of the
# flat array each is read as; for a tail, between sequences). A pool is contiguous within a block; its blocks
# may lie further apart (pools inside one page per block, as vLLM lays them out): see _row0, _scale0.
# P_SPREAD, P_CMIN: where a block's int16 operands or fp8 codes would lose more than the format, the block takes
# the float path (see _spread_ok, _codes_reach; 0: no such check).

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


def _host_has_half() -> bool:
    """Whether the host converts fp16 to float32 in hardware (x86 F16C, or any aarch64)."""
    import platform

    from llvmlite import binding as llvm
    from numba.core import config

    feats = (config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(",")
    return "+f16c" in feats or platform.machine().lower() in ("aarch64", "arm64")


_HW_HALF = _host_has_half()  # a compile-time constant in the kernels: the branch not taken is not emitted


@intrinsic
def _half_hw(typingctx, bits):
    """IEEE fp16 bits (the low 16 bits of an integer) to float32 by the hardware conversion (``fpext half``:
    ``vcvtph2ps`` on x86, 16 per instruction once the loop vectorizes); exact, like :func:`_half`. Only
    used where :data:`_HW_HALF` (elsewhere LLVM would call a runtime helper numba may not link)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 16:
            v = builder.trunc(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The bits of a float32 as an int32 (free: a register bitcast)."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


@intrinsic
def _abs_bits(typingctx, x):
    """``|x|`` of a float32 as int32 bits: non-negative, ordered like ``|x|`` (NaN aside)."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.and_(builder.bitcast(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 0x7FFFFFFF))

    return types.int32(x), codegen


@intrinsic
def _max_i32(typingctx, a, b):
    """The larger of two int32, as an int32. numba widens int32 arithmetic (the ``&`` of the bits) to int64, so
    the same max reduction written in Python vectorized over 8 lanes (``vpmaxuq``) instead of 16."""
    if a != types.int32 or b != types.int32:
        return None

    def codegen(context, builder, signature, args):
        x, y = args
        return builder.select(builder.icmp_signed(">", x, y), x, y)

    return types.int32(a, b), codegen


@intrinsic
def _min_i32(typingctx, a, b):
    """The smaller of two int32, as an int32 (see :func:`_max_i32`)."""
    if a != types.int32 or b != types.int32:
        return None

    def codegen(context, builder, signature, args):
        x, y = args
        return builder.select(builder.icmp_signed("<", x, y), x, y)

    return types.int32(a, b), codegen


@njit(**_NOREF)
def _order_key(x):
    """An int32 that orders like the float32 ``x`` (NaN aside): max/min reductions over it vectorize, where
    LLVM keeps float max reductions scalar (they must respect NaN and signed zeros)."""
    i = _f32_bits(x)
    return i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(**_NOREF)
def _from_order_key(i):
    return _as_f32(i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF)))


def _prefetch_intrinsic(locality: int):
    """An intrinsic ``(arr, idx)`` that hints the cache to fetch the line holding ``arr[idx]`` (1-D array;
    never faults, never checked); ``locality`` as LLVM's: 2 = into L2 (x86 ``prefetcht1``), 3 = into L1."""

    @intrinsic
    def prefetch(typingctx, arr, idx):
        if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(idx, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer2(context, builder, data=ary.data,
                                            shape=cgutils.unpack_tuple(builder, ary.shape),
                                            strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                            inds=[args[1]], wraparound=False)  # fmt: skip
            ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
            name = "llvm.prefetch.p0" if str(ptr.type) == "ptr" else "llvm.prefetch.p0i8"  # opaque or typed pointers
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            builder.call(fn, [ptr, i32(0), i32(locality), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return prefetch


_prefetch = _prefetch_intrinsic(2)  # into L2: rows and scales of the block after next
_prefetch_l1 = _prefetch_intrinsic(3)  # into L1 (the integer loops emit their own; see _ir_prefetch)


def _slot_pointer(context, builder, aryty, ary_val, idx):
    """Pointer to element ``idx`` of a 1-D array (no bounds or wraparound check)."""
    ary = context.make_array(aryty)(context, builder, ary_val)
    return cgutils.get_item_pointer2(context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
                                     strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                     inds=[idx], wraparound=False)  # fmt: skip


@intrinsic
def _atomic_load(typingctx, arr, idx):
    """``arr[idx]`` of an int64 array read atomically (sequentially consistent)."""
    if not isinstance(arr, types.Array) or arr.dtype != types.int64 or arr.ndim != 1:
        return None

    def codegen(context, builder, signature, args):
        ptr = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def _cas(typingctx, arr, idx, old, new):
    """Compare-and-swap ``arr[idx]`` (int64 array) from ``old`` to ``new``; returns the value it held (the swap
    happened if that equals ``old``)."""
    if not isinstance(arr, types.Array) or arr.dtype != types.int64 or arr.ndim != 1:
        return None

    def codegen(context, builder, signature, args):
        ptr = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        old_v = context.cast(builder, args[2], signature.args[2], types.int64)
        new_v = context.cast(builder, args[3], signature.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(ptr, old_v, new_v, "seq_cst", "seq_cst"), 0)

    return types.int64(arr, idx, old, new), codegen


_RUN_MASK = np.int64(0xFFFFFFFF)


def pack_run(first: int, end: int) -> int:
    """One thread's run of work items ``[first, end)`` as the int64 word :func:`take_item` works on."""
    return int(first) | (int(end) << 32)


@njit(**_NOREF)
def take_item(runs, t):
    """The next work item for thread ``t``, or -1 when none is left anywhere.

    runs: ``[threads]`` int64, each thread's run of items ``[first, end)`` packed as ``first | end << 32``
    (:func:`pack_run`), shared by the threads. A thread takes its own run upwards, in order (a kv head's
    blocks sit next to the previous head's, so the next item is partly in the last-level cache already);
    once its run is done it takes the last item of the run with the most left. Lock-free: each take is one
    compare-and-swap on the run's word, retried if another thread changed it first."""
    while True:
        cur = _atomic_load(runs, t)
        first, end = cur & _RUN_MASK, cur >> 32
        if first < end:
            if _cas(runs, t, cur, (first + 1) | (end << 32)) == cur:
                return first
            continue
        best = -1
        most = np.int64(0)
        seen = np.int64(0)
        for r in range(runs.shape[0]):
            c = _atomic_load(runs, r)
            left = (c >> 32) - (c & _RUN_MASK)
            if left > most:
                best, most, seen = r, left, c
        if best < 0:
            return -1
        last = (seen >> 32) - 1
        if _cas(runs, best, seen, (seen & _RUN_MASK) | (last << 32)) == seen:
            return last


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


@njit(inline="always", **_NOREF)
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
        elif per == 1:  # contiguous rows (tails, fp16/bf16 formats): the loops vectorize
            if fk == FK_F16:
                if _HW_HALF:
                    for j in range(ud):
                        buf[r, j] = _half_hw(p16[o + j])
                else:
                    for j in range(ud):
                        buf[r, j] = _half(p16[o + j])
            elif fk == FK_BF16:
                for j in range(ud):
                    buf[r, j] = _bf16(p16[o + j])
            else:
                for j in range(ud):
                    buf[r, j] = p32[o + j]
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
def _kdot_tile(x, base, rs, nt, qf, out, t, mx):
    """``out[g, t + r] = sum_i qf[g, i] * x[base + r * rs + i]`` for rows ``r < nt``; ``mx[g]`` keeps the max.

    x: a flat float32 array holding the rows ``rs`` elements apart: the decoded tile (``buf`` ``[TILE, D]``
    flattened, ``base`` 0, ``rs`` D) or float32 rows read in place from their pool; qf: ``[G4, D]`` (rows past
    G are padding); out: ``[G, *]``. Rows go four and heads four at a time, so each element feeds 16
    independent accumulators.
    """
    g_n = out.shape[0]
    d = U64(qf.shape[1])
    for r0 in range(0, nt, 4):
        _kdot4(x, base + U64(r0) * rs, rs, nt - r0, qf, out, t + r0, mx, g_n, d)


@njit(fastmath=FASTMATH, **_NOREF)
def _kdot4(x, o, rs, nt, qf, out, t, mx, g_n, d):
    """Rows ``0 .. min(nt, 4) - 1`` at flat offset ``o`` of :func:`_kdot_tile` (rows past ``nt`` read the last
    one: they stay inside the block, their sums are dropped)."""
    o0 = o
    o1 = o + U64(min(1, nt - 1)) * rs
    o2 = o + U64(min(2, nt - 1)) * rs
    o3 = o + U64(min(3, nt - 1)) * rs
    for g0 in range(0, g_n, 4):
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _ZERO
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = _ZERO
        for i in range(d):
            x0 = x[o0 + i]
            x1 = x[o1 + i]
            x2 = x[o2 + i]
            x3 = x[o3 + i]
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
def _vacc8(x, o, rs, nt, w, t, acc, g_n):
    """``acc[g, i] += sum_{r < nt} w[g, t + r] * x[o + r * rs + i]`` for heads ``g < g_n``.

    x: a flat float32 array holding the rows ``rs`` elements apart (see :func:`_kdot_tile`; rows past ``nt``
    read the last one and get weight 0); w: ``[G, B]``; acc: ``[G4, D]`` (G rounded up to 4; the padding
    rows are scratch). Four heads are updated per pass over the rows, eight rows per load/store of the
    accumulator.
    """
    d = U64(acc.shape[1])
    last = nt - 1
    o0 = o
    o1 = o + U64(min(1, last)) * rs
    o2 = o + U64(min(2, last)) * rs
    o3 = o + U64(min(3, last)) * rs
    o4 = o + U64(min(4, last)) * rs
    o5 = o + U64(min(5, last)) * rs
    o6 = o + U64(min(6, last)) * rs
    o7 = o + U64(min(7, last)) * rs
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
            x0 = x[o0 + i]
            x1 = x[o1 + i]
            x2 = x[o2 + i]
            x3 = x[o3 + i]
            x4 = x[o4 + i]
            x5 = x[o5 + i]
            x6 = x[o6 + i]
            x7 = x[o7 + i]
            aa[i] += _dot8(wa, x0, x1, x2, x3, x4, x5, x6, x7)
            ab[i] += _dot8(wb, x0, x1, x2, x3, x4, x5, x6, x7)
            ac[i] += _dot8(wc, x0, x1, x2, x3, x4, x5, x6, x7)
            ad[i] += _dot8(wd, x0, x1, x2, x3, x4, x5, x6, x7)


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _scales(arrs, kind, o, n, out):
    """``out[:n]`` = the stored scales (or zero-points) at flat offset ``o``, as float32 (0 for none)."""
    if kind == SC_F32:
        src32 = arrs[2]
        for i in range(U64(n)):
            out[i] = src32[o + i]
    elif kind == SC_F16:
        src16 = arrs[1]
        if _HW_HALF:  # ~2.5x faster per block (int4: 768 scales and zero-points per block and kv head)
            for i in range(U64(n)):
                out[i] = _half_hw(src16[o + i])
        else:
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


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _scales_t(arrs, kind, o, nt, cs, tmp, out):
    """The ``[nt, cs]`` slab of scales at flat offset ``o``, transposed: ``out[grp * nt + t]`` (float32),
    so loops over the tokens of one group run with unit stride. ``tmp``: scratch of ``nt * cs``."""
    if cs == 1 or kind == SC_NONE:
        _scales(arrs, kind, o, nt * cs, out)
        return
    _scales(arrs, kind, o, nt * cs, tmp)
    ucs, unt = U64(cs), U64(nt)
    if cs == 4:  # int4 values in groups of 32 at head_dim 128: an interleaved load LLVM vectorizes
        for t in range(unt):
            x0, x1, x2, x3 = tmp[4 * t], tmp[4 * t + 1], tmp[4 * t + 2], tmp[4 * t + 3]
            out[t] = x0
            out[unt + t] = x1
            out[2 * unt + t] = x2
            out[3 * unt + t] = x3
        return
    for grp in range(ucs):
        for t in range(unt):
            out[grp * unt + t] = tmp[t * ucs + grp]


# ----------------------------------------------------------------------------------------------------
# Integer dot products (keys and values), written as LLVM IR text
#
# Numba has no vector types, so the two hot loops of the integer path are generated here as LLVM IR
# (explicit <32 x i16> / <16 x i32> vectors) and linked into the caller. Codes are widened to int16 words
# and multiplied with int16 operands (the folded query, or the attention weights) by ``vpdpwssd``
# (AVX-512 VNNI: 32 multiply-adds per instruction, exact int32 sums); without VNNI the same IR uses
# ``vpmaddwd`` + add (AVX-512 BW), without AVX-512 a portable multiply + pairwise add that LLVM lowers for
# the target. The launcher picks the integer path only on AVX-512 BW machines (the float path otherwise).
#
# A packed row is read 32 bytes at a time: bytes -> words (sign- or zero-extended), then plane ``k``
# (``(word >> bits * k) & mask``) holds the codes of channels ``per * j + k`` for the 32 bytes ``j``.

_INT_KINDS = {S8: (1, True), U8: (1, False), U4: (2, False), U2: (4, False), E4M3: (1, True), E5M2: (1, True)}
# ^ kind -> (codes per byte, signed); fp8 codes become signed int16 words through a table (_ir_lut)
# fp8 codes as integers: each code's value in units of the format's largest finite value / _LUT_MAX, so the
# integer path adds at most 0.5 / _LUT_MAX of the block's largest key or value per element (fp8's own
# rounding is 1/16 to 1/8 of the element); 12 bits leave the int16 query 13 bits before int32 sums overflow
_LUT_MAX = 2047
_FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_CODE_MAX = {S8: 128, U8: 255, U4: 15, U2: 3, E4M3: _LUT_MAX, E5M2: _LUT_MAX}  # largest |code|: int32 bound


def _fp8_value(kind: int, code: int) -> float:
    """The value of an fp8 byte (0 for NaN and infinities, which stored caches never hold)."""
    sign = -1.0 if code & 0x80 else 1.0
    em = code & 0x7F
    mbits, bias = (3, 7) if kind == E4M3 else (2, 15)
    e, m = em >> mbits, em & ((1 << mbits) - 1)
    if (kind == E4M3 and em == 0x7F) or (kind == E5M2 and e == 31):
        return 0.0
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1.0 + m / (1 << mbits)) * 2.0 ** (e - bias)


def _lut_table(kind: int) -> list[int]:
    """The int16 word of fp8 magnitudes 0..127: ``round(|value| / max * _LUT_MAX)``."""
    return [round(_fp8_value(kind, c) / _FP8_MAX[kind] * _LUT_MAX) for c in range(128)]


_E4M3_UNIT = _FP8_MAX[E4M3] / _LUT_MAX
_E5M2_UNIT = _FP8_MAX[E5M2] / _LUT_MAX


@njit(**_NOREF)
def _code_unit(kind):
    """What one integer code unit is worth: 1 for integer codes, ``max / _LUT_MAX`` for fp8 (see _lut_table)."""
    if kind == E4M3:
        return np.float32(_E4M3_UNIT)
    if kind == E5M2:
        return np.float32(_E5M2_UNIT)
    return np.float32(1.0)


_I32_MAX = 2**31 - 1


def _ir_vec(ty: str, vals) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in vals) + ">"


def _ir_mask(vals) -> str:
    vals = list(vals)
    return f"<{len(vals)} x i32> " + _ir_vec("i32", vals)


def _ir_lut(lines: list[str], name: str, src: str, kind: int, isa: str) -> str:
    """``%name``: the <32 x i8> fp8 codes ``src`` as signed <32 x i16> words (:func:`_lut_table`). AVX-512 BW
    looks the 128 magnitudes up with two 64-word permutes (``vpermt2w``) chosen by bit 6, then applies the sign
    bit; elsewhere a gather from a table in memory (verified, never run: the integer path needs AVX-512 BW)."""
    t = _lut_table(kind)
    lines.append(f"  %{name}.z = zext <32 x i8> {src} to <32 x i16>")
    if isa == "generic":
        lines += [f"  %{name}.ix = and <32 x i16> %{name}.z, {_ir_vec('i16', [127] * 32)}",
                  f"  %{name}.i64 = zext <32 x i16> %{name}.ix to <32 x i64>",
                  f"  %{name}.pp = getelementptr i16, ptr @kvpack_lut_{kind}, <32 x i64> %{name}.i64",
                  f"  %{name}.mag = call <32 x i16> @llvm.masked.gather.v32i16.v32p0(<32 x ptr> %{name}.pp, i32 2, "
                  f"<32 x i1> {_ir_vec('i1', ['true'] * 32)}, <32 x i16> poison)"]  # fmt: skip
    else:
        for part in range(2):  # magnitudes 64 * part .. 64 * part + 63: two tables of 32 words
            a, b = _ir_vec("i16", t[64 * part : 64 * part + 32]), _ir_vec("i16", t[64 * part + 32 : 64 * part + 64])
            lines.append(f"  %{name}.t{part} = call <32 x i16> @llvm.x86.avx512.vpermi2var.hi.512(<32 x i16> {a}, "
                         f"<32 x i16> %{name}.z, <32 x i16> {b})")  # fmt: skip
        lines += [f"  %{name}.b6w = and <32 x i16> %{name}.z, {_ir_vec('i16', [64] * 32)}",
                  f"  %{name}.b6 = icmp ne <32 x i16> %{name}.b6w, zeroinitializer",
                  f"  %{name}.mag = select <32 x i1> %{name}.b6, <32 x i16> %{name}.t1, <32 x i16> %{name}.t0"]  # fmt: skip
    lines += [f"  %{name}.sw = and <32 x i16> %{name}.z, {_ir_vec('i16', [128] * 32)}",
              f"  %{name}.sg = icmp ne <32 x i16> %{name}.sw, zeroinitializer",
              f"  %{name}.neg = sub <32 x i16> zeroinitializer, %{name}.mag",
              f"  %{name} = select <32 x i1> %{name}.sg, <32 x i16> %{name}.neg, <32 x i16> %{name}.mag"]  # fmt: skip
    return f"%{name}"


def _ir_lut_decl(kind: int, isa: str) -> str:
    """Declarations the fp8 lookup needs (nothing for integer codes)."""
    if kind not in _FP8_MAX:
        return ""
    if isa == "generic":
        return (f"@kvpack_lut_{kind} = private unnamed_addr constant [128 x i16] [{', '.join(f'i16 {v}' for v in _lut_table(kind))}]\n"
                "declare <32 x i16> @llvm.masked.gather.v32i16.v32p0(<32 x ptr>, i32, <32 x i1>, <32 x i16>)\n")  # fmt: skip
    return "declare <32 x i16> @llvm.x86.avx512.vpermi2var.hi.512(<32 x i16>, <32 x i16>, <32 x i16>)\n"


def _ir_words(lines: list[str], src: str, name: str, per: int, signed: bool, off: str = "", kind: int = S8,
              isa: str = "generic") -> list[str]:  # fmt: skip
    """Emit the ``per`` planes of 32 bytes at pointer ``src`` as <32 x i16>, minus the splat ``off`` when
    given (offset-binary codes become signed, centred ones); returns their names."""
    bits = 8 // per
    lines.append(f"  %{name}.b = load <32 x i8>, ptr {src}, align 1")
    if kind in _FP8_MAX:
        return [_ir_lut(lines, f"{name}.w", f"%{name}.b", kind, isa)]
    lines.append(f"  %{name}.w = {'sext' if signed else 'zext'} <32 x i8> %{name}.b to <32 x i16>")
    out = []
    for k in range(per):
        x = f"%{name}.w"
        if k:
            lines.append(f"  %{name}.s{k} = lshr <32 x i16> {x}, {_ir_vec('i16', [bits * k] * 32)}")
            x = f"%{name}.s{k}"
        if per > 1 and k < per - 1:
            lines.append(f"  %{name}.m{k} = and <32 x i16> {x}, {_ir_vec('i16', [(1 << bits) - 1] * 32)}")
            x = f"%{name}.m{k}"
        if off:
            lines.append(f"  %{name}.o{k} = sub <32 x i16> {x}, {off}")
            x = f"%{name}.o{k}"
        out.append(x)
    return out


def _ir_splat16(lines: list[str], name: str, val: str) -> None:
    """``%name`` = the i64 ``val`` truncated to i16, in all 32 lanes."""
    lines += [f"  %{name}.t = trunc i64 {val} to i16", f"  %{name}.i = insertelement <32 x i16> poison, i16 %{name}.t, i64 0",
              f"  %{name} = shufflevector <32 x i16> %{name}.i, <32 x i16> poison, {_ir_mask([0] * 32)}"]  # fmt: skip


def _ir_dot(lines: list[str], out: str, acc: str, x: str, y: str, isa: str) -> None:
    """``out = acc + pairwise sums of x * y`` (<32 x i16> operands, <16 x i32> accumulators)."""
    if isa == "vnni" and _vnni_takes_words():
        lines.append(f"  {out} = call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> {acc}, <32 x i16> {x}, "
                     f"<32 x i16> {y})")  # fmt: skip
    elif isa == "vnni":  # LLVM before 22 declares the word operands as <16 x i32>: same bits, reinterpreted
        lines.append(f"  {out}.xw = bitcast <32 x i16> {x} to <16 x i32>")
        lines.append(f"  {out}.yw = bitcast <32 x i16> {y} to <16 x i32>")
        lines.append(f"  {out} = call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> {acc}, <16 x i32> {out}.xw, "
                     f"<16 x i32> {out}.yw)")  # fmt: skip
    elif isa == "bw":
        lines.append(f"  {out}.p = call <16 x i32> @llvm.x86.avx512.pmaddw.d.512(<32 x i16> {x}, <32 x i16> {y})")
        lines.append(f"  {out} = add <16 x i32> {acc}, {out}.p")
    else:
        lines.append(f"  {out}.x = sext <32 x i16> {x} to <32 x i32>")
        lines.append(f"  {out}.y = sext <32 x i16> {y} to <32 x i32>")
        lines.append(f"  {out}.m = mul <32 x i32> {out}.x, {out}.y")
        lines.append(f"  {out}.e = shufflevector <32 x i32> {out}.m, <32 x i32> poison, {_ir_mask(range(0, 32, 2))}")
        lines.append(f"  {out}.o = shufflevector <32 x i32> {out}.m, <32 x i32> poison, {_ir_mask(range(1, 32, 2))}")
        lines.append(f"  {out}.s = add <16 x i32> {out}.e, {out}.o")
        lines.append(f"  {out} = add <16 x i32> {acc}, {out}.s")


@lru_cache(maxsize=1)
def _vnni_takes_words() -> bool:
    """Whether this LLVM declares ``vpdpwssd``'s multiplicands as <32 x i16> (LLVM 22 and later, numba 0.66+) rather
    than as <16 x i32> (LLVM 20, numba 0.65): the IR must use the signature of the LLVM that compiles it."""
    from llvmlite import binding as llvm

    return llvm.llvm_version_info[0] >= 22


def _ir_decl(isa: str) -> str:
    """The intrinsic declarations the integer-dot IR of ``isa`` calls."""
    if isa == "vnni":
        word = "<32 x i16>" if _vnni_takes_words() else "<16 x i32>"
        return f"declare <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32>, {word}, {word})\n"
    if isa == "bw":
        return "declare <16 x i32> @llvm.x86.avx512.pmaddw.d.512(<32 x i16>, <32 x i16>)\n"
    return ""


_IR_PREFETCH = "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)\n"


def _ir_prefetch(base: str, off: str, n: str, label: str, then: str, loc: int = 2) -> list[str]:
    """Lines that prefetch the ``n`` bytes at ``base + off`` one cache line at a time (``loc``: LLVM's locality,
    2 for L2, 3 for L1), unless ``base`` is null, then branch to ``then``. Spreading the next blocks' prefetches
    over the loops that compute this one keeps a steady number of misses in flight (block ids are random: no
    hardware prefetcher sees them)."""
    return [f"  %{label}.pfz = icmp eq ptr {base}, null",
            f"  br i1 %{label}.pfz, label %{label}.pf.end, label %{label}.pf",
            f"{label}.pf:",
            f"  %{label}.pfo = phi i64 [0, %{label}], [%{label}.pfo.next, %{label}.pf]",
            f"  %{label}.pfa = add i64 {off}, %{label}.pfo",
            f"  %{label}.pfp = getelementptr i8, ptr {base}, i64 %{label}.pfa",
            f"  call void @llvm.prefetch.p0(ptr %{label}.pfp, i32 0, i32 {loc}, i32 1)",
            f"  %{label}.pfo.next = add i64 %{label}.pfo, 64",
            f"  %{label}.pfc = icmp ult i64 %{label}.pfo.next, {n}",
            f"  br i1 %{label}.pfc, label %{label}.pf, label %{label}.pf.end",
            f"{label}.pf.end:",
            f"  br label %{then}"]  # fmt: skip


def _ir_reduce16(lines: list[str], names: list[str]) -> str:
    """Horizontal sums of 16 <16 x i32> vectors at once: lane ``n`` of the result sums ``names[n]``.

    A transposing tree (each step halves the partial sums per vector and doubles the vectors per
    register): 15 adds and 30 shuffles for 16 sums, against ~4 dependent steps each done one by one."""
    cur = [(nm, 1) for nm in names]  # (value, owners it holds; each owner has 16 // owners lanes)
    level = 0
    while len(cur) > 1:
        nxt = []
        for p in range(0, len(cur), 2):
            (x, n), (y, _) = cur[p], cur[p + 1]
            seg, half = 16 // n, 8 // n
            lo = [b + o * seg + i for b in (0, 16) for o in range(n) for i in range(half)]
            hi = [v + half for v in lo]
            c = f"%red{level}_{p}"
            lines.append(f"  {c}.a = shufflevector <16 x i32> {x}, <16 x i32> {y}, {_ir_mask(lo)}")
            lines.append(f"  {c}.b = shufflevector <16 x i32> {x}, <16 x i32> {y}, {_ir_mask(hi)}")
            lines.append(f"  {c} = add <16 x i32> {c}.a, {c}.b")
            nxt.append((c, 2 * n))
        cur = nxt
        level += 1
    return cur[0][0]


def _kdot_ir(name: str, kind: int, isa: str) -> str:
    """IR of ``void name(ptr k, i64 rs, i64 ngrp, ptr q, i64 nm, ptr scl, ptr sc, i64 ld, i64 off, ptr mx, ...)``:
    scores of ``4 * ngrp`` rows (row ``r`` at ``k + r * rs`` bytes) for 4 heads,
    ``sc[g * ld + r] = scl[g] * sum_{k < per, m < nm, i < 32} q[((g * per + k) * nm + m) * 32 + i] * code(r, 32 m + i, k)``
    with int16 ``q`` and exact int32 sums; four rows x four heads = 16 accumulators per pass. ``mx[g]``: head
    ``g``'s largest score over the ``4 * ngrp`` rows (one compare per four rows: no separate max pass)."""
    per, signed = _INT_KINDS[kind]
    lines = [f"define void @{name}(ptr %k, i64 %rs, i64 %ngrp, ptr %q, i64 %nm, ptr %scl, ptr %sc, i64 %ld, "
             "i64 %off, ptr %mx, ptr %pf, ptr %pf1) {",
             "entry:",
             "  %scl4 = load <4 x float>, ptr %scl, align 4",
             f"  %sclv = shufflevector <4 x float> %scl4, <4 x float> poison, {_ir_mask([n // 4 for n in range(16)])}",
             "  %rs4 = mul i64 %rs, 4"]  # fmt: skip
    for k in range(per):
        for g in range(4):  # first vector of head g, plane k
            lines.append(f"  %qk{k}_{g} = mul i64 %nm, {g * per + k}")
    _ir_splat16(lines, "offv", "%off")
    lines += ["  br label %grp",
             "grp:",
             "  %gi = phi i64 [0, %entry], [%gi.next, %grp.end]",
             f"  %mxv = phi <16 x float> [{_ir_vec('float', ['0xFFF0000000000000'] * 16)}, %entry], [%mxn, %grp.end]",
             "  %row0 = mul i64 %gi, %rs4",
             "  %rp0 = getelementptr i8, ptr %k, i64 %row0"]  # fmt: skip
    lines += [f"  %rp{r} = getelementptr i8, ptr %rp{r - 1}, i64 %rs" for r in range(1, 4)]
    # the block after next into L2; for one code per byte also the next block into L1 (int8 measured faster with it;
    # packed codes do not emit it, see _near_rows)
    lines += [*_ir_prefetch("%pf", "%row0", "%rs4", "grp", "grp1"), "grp1:"]
    if per == 1:
        lines += _ir_prefetch("%pf1", "%row0", "%rs4", "grp1", "mloop", 3)
    else:
        lines += ["  br label %grp1.pf.end", "grp1.pf.end:", "  br label %mloop"]
    lines += ["mloop:", "  %mi = phi i64 [0, %grp1.pf.end], [%mi.next, %mloop]"]
    last = {}
    for n in range(16):  # accumulator n: head n // 4, row n % 4
        lines.append(f"  %a{n}.in = phi <16 x i32> [zeroinitializer, %grp1.pf.end], [%a{n}.out, %mloop]")
        last[n] = f"%a{n}.in"
    lines += ["  %boff = mul i64 %mi, 32"]
    for k in range(per):  # q: [4 heads, per, nm, 32] int16, the keys' plane order of each head
        for g in range(4):
            lines += [f"  %qi{k}_{g} = add i64 %qk{k}_{g}, %mi",
                      f"  %qp{k}_{g} = getelementptr <32 x i16>, ptr %q, i64 %qi{k}_{g}",
                      f"  %qv{k}_{g} = load <32 x i16>, ptr %qp{k}_{g}, align 2"]  # fmt: skip
    for r in range(4):
        lines.append(f"  %bp{r} = getelementptr i8, ptr %rp{r}, i64 %boff")
        for k, x in enumerate(_ir_words(lines, f"%bp{r}", f"r{r}", per, signed, "" if signed else "%offv", kind, isa)):
            for g in range(4):
                n = g * 4 + r
                _ir_dot(lines, f"%a{n}.{k}", last[n], x, f"%qv{k}_{g}", isa)
                last[n] = f"%a{n}.{k}"
    lines += [f"  %a{n}.out = or <16 x i32> {last[n]}, zeroinitializer" for n in range(16)]
    lines += ["  %mi.next = add i64 %mi, 1", "  %mc = icmp ult i64 %mi.next, %nm",
              "  br i1 %mc, label %mloop, label %grp.end", "grp.end:"]  # fmt: skip
    tot = _ir_reduce16(lines, [f"%a{n}.out" for n in range(16)])
    lines += [f"  %tf = sitofp <16 x i32> {tot} to <16 x float>", "  %ts = fmul <16 x float> %tf, %sclv",
              "  %mxc = fcmp ogt <16 x float> %ts, %mxv", "  %mxn = select <16 x i1> %mxc, <16 x float> %ts, <16 x float> %mxv",
              "  %col = mul i64 %gi, 4"]  # fmt: skip
    for g in range(4):
        lines += [f"  %o{g} = shufflevector <16 x float> %ts, <16 x float> poison, {_ir_mask(range(4 * g, 4 * g + 4))}",
                  f"  %or{g} = mul i64 %ld, {g}", f"  %oi{g} = add i64 %or{g}, %col",
                  f"  %op{g} = getelementptr float, ptr %sc, i64 %oi{g}",
                  f"  store <4 x float> %o{g}, ptr %op{g}, align 4"]  # fmt: skip
    lines += ["  %gi.next = add i64 %gi, 1", "  %gc = icmp ult i64 %gi.next, %ngrp",
              "  br i1 %gc, label %grp, label %exit", "exit:"]  # fmt: skip
    cur = "%mxn"  # lanes 4g..4g+3 are head g's rows: two swaps within each four leave its max in every lane
    for step, mask in enumerate(([i ^ 1 for i in range(16)], [i ^ 2 for i in range(16)])):
        lines += [f"  %mxs{step} = shufflevector <16 x float> {cur}, <16 x float> poison, {_ir_mask(mask)}",
                  f"  %mxc{step} = fcmp ogt <16 x float> %mxs{step}, {cur}",
                  f"  %mxr{step} = select <16 x i1> %mxc{step}, <16 x float> %mxs{step}, <16 x float> {cur}"]  # fmt: skip
        cur = f"%mxr{step}"
    lines += [f"  %mx4 = shufflevector <16 x float> {cur}, <16 x float> poison, {_ir_mask([0, 4, 8, 12])}",
              "  store <4 x float> %mx4, ptr %mx, align 4", "  ret void", "}"]  # fmt: skip
    return "\n".join(lines) + "\n" + _ir_decl(isa) + _IR_PREFETCH + _ir_lut_decl(kind, isa)


def value_run(per: int) -> int:
    """Bytes a value scale group must span whole multiples of in :func:`_vdot_ir`: each 16-byte half of a row
    takes one group's weights, or for 2-bit codes (``per`` 4 codes per byte) two groups of 8 bytes."""
    return 8 if per == 4 else 16


def _vdot_ir(name: str, kind: int, isa: str) -> str:
    """IR of ``void name(ptr v, i64 rs, i64 npairs, ptr w, i64 wld, ptr acc, i64 ld, i64 dp, ptr winv, i64 span)``:
    ``acc[g * ld + c] += winv[g] * sum_t w[grp, g, t] * code(t, c)`` over ``2 * npairs`` rows (row ``t`` at
    ``v + t * rs`` bytes, ``dp`` bytes each) for 4 heads; ``c = k * dp + j`` is the values' plane order
    (plane ``k`` of byte ``j``), ``grp = j // span`` (``span``: bytes per value group, a multiple of 16, or
    of 8 for 2-bit codes, whose halves then take the weights of two groups).
    ``w``: int16 ``[groups, 4 heads, *]`` with ``wld`` bytes between rows (the dword at row ``t = 2p`` holds the
    weights of rows ``2p`` and ``2p + 1``).

    Two rows at a time: their words are interleaved (row ``2p`` in the even word of each dword, ``2p + 1``
    in the odd one), so one ``vpdpwssd`` multiplies 16 channels of both rows by their two weights. A pass
    covers two units of 32 bytes x one plane (64 channels): 4 heads x 4 half-units = 16 accumulators."""
    per = _INT_KINDS[kind][0]
    bits = 8 // per
    split = value_run(per) == 8  # 2-bit codes: a value group of 32 is 8 bytes, two groups per 16-byte half
    lines = [f"define void @{name}(ptr %v, i64 %rs, i64 %npairs, ptr %w, i64 %wld, ptr %acc, i64 %ld, i64 %dp, "
             "ptr %winv, i64 %span, i64 %off, ptr %pf, ptr %pf1) {",
             "entry:",
             "  %wi4 = load <4 x float>, ptr %winv, align 4",
             "  %rs2 = mul i64 %rs, 2",
             f"  %nu.a = mul i64 %dp, {per}",
             "  %nu = udiv i64 %nu.a, 32",
             "  %wgrp = mul i64 %wld, 4",
             "  %off16 = trunc i64 %off to i16",
             "  %offv.i = insertelement <32 x i16> poison, i16 %off16, i64 0",
             f"  %offv = shufflevector <32 x i16> %offv.i, <32 x i16> poison, {_ir_mask([0] * 32)}",
             "  br label %unit",
             "unit:",
             "  %ui = phi i64 [0, %entry], [%ui.next, %unit.end]",
             "  %u.x = mul i64 %ui, 2"]  # fmt: skip
    for e in range(2):  # unit u = 2 ui + e: 32 bytes at 32 * (u // per), plane u % per
        lines += [f"  %u{e} = add i64 %u.x, {e}", f"  %pc{e} = udiv i64 %u{e}, {per}",
                  f"  %pl{e} = urem i64 %u{e}, {per}", f"  %bo{e} = mul i64 %pc{e}, 32"]  # fmt: skip
        if per > 1:
            lines += [
                f"  %sh{e}.s = mul i64 %pl{e}, {bits}",
                f"  %sh{e}.t = trunc i64 %sh{e}.s to i16",
                f"  %sh{e}.i = insertelement <32 x i16> poison, i16 %sh{e}.t, i64 0",
                f"  %sh{e} = shufflevector <32 x i16> %sh{e}.i, <32 x i16> poison, {_ir_mask([0] * 32)}",
            ]
        for h in range(2):  # the weight group of each 16-byte half (2-bit codes: of each 8-byte quarter)
            lines += [f"  %gb{e}{h} = add i64 %bo{e}, {16 * h}", f"  %gr{e}{h} = udiv i64 %gb{e}{h}, %span",
                      f"  %go{e}{h} = mul i64 %gr{e}{h}, %wgrp"]  # fmt: skip
            if split:
                lines += [f"  %gb{e}{h}b = add i64 %bo{e}, {16 * h + 8}", f"  %gr{e}{h}b = udiv i64 %gb{e}{h}b, %span",
                          f"  %go{e}{h}b = mul i64 %gr{e}{h}b, %wgrp"]  # fmt: skip
    # each pass over the rows prefetches its share of them: the pass's slice of each pair's bytes
    lines += ["  %npass = udiv i64 %nu, 2", "  %slice = udiv i64 %rs2, %npass", "  %soff = mul i64 %ui, %slice"]
    # a pass whose four halves share one weight group (per-token or per-head scales) gets a loop that loads
    # each head's weights once; not for 2-bit codes (never one group) or fp8 (measured 7% slower there)
    one = not split and kind not in _FP8_MAX
    if not one:
        lines.append("  br label %ploopg")
    else:
        lines += ["  %one.a = icmp eq i64 %go00, %go01", "  %one.b = icmp eq i64 %go00, %go10",
                  "  %one.c = icmp eq i64 %go00, %go11", "  %one.d = and i1 %one.a, %one.b", "  %one = and i1 %one.d, %one.c",
                  "  br i1 %one, label %ploopu, label %ploopg"]  # fmt: skip
        _vdot_pass(lines, "u", True, kind, isa)
    _vdot_pass(lines, "g", False, kind, isa)
    lines.append("unit.end:")
    for n in range(16):
        src = [f"[%a{n}.g.out, %ploopg.body]"] + ([f"[%a{n}.u.out, %ploopu.body]"] if one else [])
        lines.append(f"  %a{n}.out = phi <16 x i32> {', '.join(src)}")
    for e in range(2):  # plane-order channel of unit e: plane * dp + 32 * piece
        lines += [f"  %cb{e}.a = mul i64 %pl{e}, %dp", f"  %cb{e} = add i64 %cb{e}.a, %bo{e}"]
    for g in range(4):
        lines += [f"  %wi{g} = extractelement <4 x float> %wi4, i64 {g}",
                  f"  %wiv{g}.i = insertelement <16 x float> poison, float %wi{g}, i64 0",
                  f"  %wiv{g} = shufflevector <16 x float> %wiv{g}.i, <16 x float> poison, {_ir_mask([0] * 16)}",
                  f"  %ab{g} = mul i64 %ld, {g}"]  # fmt: skip
        for e in range(2):
            for h in range(2):
                n = g * 4 + e * 2 + h
                lines += [f"  %f{n} = sitofp <16 x i32> %a{n}.out to <16 x float>",
                          f"  %c{n}.a = add i64 %ab{g}, %cb{e}", f"  %c{n} = add i64 %c{n}.a, {16 * h}",
                          f"  %p{n} = getelementptr float, ptr %acc, i64 %c{n}",
                          f"  %o{n} = load <16 x float>, ptr %p{n}, align 4",
                          f"  %m{n} = fmul <16 x float> %f{n}, %wiv{g}",
                          f"  %s{n} = fadd <16 x float> %o{n}, %m{n}",
                          f"  store <16 x float> %s{n}, ptr %p{n}, align 4"]  # fmt: skip
    lines += ["  %ui.next = add i64 %ui, 1", "  %uc.n = mul i64 %ui.next, 2", "  %uc = icmp ult i64 %uc.n, %nu",
              "  br i1 %uc, label %unit, label %exit", "exit:", "  ret void", "}"]  # fmt: skip
    return "\n".join(lines) + "\n" + _ir_decl(isa) + _IR_PREFETCH + _ir_lut_decl(kind, isa)


def _vdot_pass(lines: list[str], sfx: str, one: bool, kind: int, isa: str) -> None:
    """The row loop of one pass of :func:`_vdot_ir` (labels ``ploop{sfx}``), ending at ``unit.end`` with
    accumulators ``%a{n}.{sfx}.out``. ``one``: the pass's four 16-byte halves share one weight group, so each
    head's weight dword is loaded once per row pair (a quarter of the loads, ~15% faster in L1)."""
    per, signed = _INT_KINDS[kind]
    bits = 8 // per
    split = value_run(per) == 8
    inter = [i // 2 + (32 if i % 2 else 0) for i in range(32)]  # words 0..15 of x and y, interleaved
    lp = f"ploop{sfx}"
    lines += [f"{lp}:", f"  %pi.{sfx} = phi i64 [0, %unit], [%pi.{sfx}.next, %{lp}.body]"]
    last = {}
    for n in range(16):  # accumulator n: head n // 4, unit (n % 4) // 2, half n % 2
        lines.append(f"  %a{n}.{sfx}.in = phi <16 x i32> [zeroinitializer, %unit], [%a{n}.{sfx}.out, %{lp}.body]")
        last[n] = f"%a{n}.{sfx}.in"
    lines += [f"  %pro.a.{sfx} = mul i64 %pi.{sfx}, %rs2", f"  %pro.{sfx} = add i64 %pro.a.{sfx}, %soff"]
    lines += [*_ir_prefetch("%pf", f"%pro.{sfx}", "%slice", lp, f"{lp}1"), f"{lp}1:"]
    if per == 1:  # and the next block into L1 (see _kdot_ir)
        lines += _ir_prefetch("%pf1", f"%pro.{sfx}", "%slice", f"{lp}1", f"{lp}.body", 3)
    else:
        lines += [f"  br label %{lp}.body"]
    v = f".{sfx}"  # suffix of this loop's values
    lines += [f"{lp}.body:"]
    lines += [f"  %ro{v} = mul i64 %pi{v}, %rs2", f"  %r0p{v} = getelementptr i8, ptr %v, i64 %ro{v}",
              f"  %r1p{v} = getelementptr i8, ptr %r0p{v}, i64 %rs", f"  %wo{v} = mul i64 %pi{v}, 4",
              f"  %wp{v} = getelementptr i8, ptr %w, i64 %wo{v}"]  # fmt: skip
    for e in range(2):
        planes = []
        for r in range(2):
            x = f"%x{e}{r}{v}"
            lines += [
                f"  {x}.p = getelementptr i8, ptr %r{r}p{v}, i64 %bo{e}",
                f"  {x}.b = load <32 x i8>, ptr {x}.p, align 1",
            ]
            if kind in _FP8_MAX:
                _ir_lut(lines, f"x{e}{r}{v}.w", f"{x}.b", kind, isa)
            else:
                lines.append(f"  {x}.w = {'sext' if signed else 'zext'} <32 x i8> {x}.b to <32 x i16>")
            if per > 1:
                lines += [
                    f"  {x}.s = lshr <32 x i16> {x}.w, %sh{e}",
                    f"  {x}.m = and <32 x i16> {x}.s, {_ir_vec('i16', [(1 << bits) - 1] * 32)}",
                ]
            else:
                lines.append(f"  {x}.m = or <32 x i16> {x}.w, zeroinitializer")
            if signed:
                planes.append(f"{x}.m")
            else:  # offset-binary codes minus their offset: signed and centred
                lines.append(f"  {x} = sub <32 x i16> {x}.m, %offv")
                planes.append(x)
        for h in range(2):
            xy = f"%xy{e}{h}{v}"
            msk = [i + 16 * h for i in inter]
            lines.append(f"  {xy} = shufflevector <32 x i16> {planes[0]}, <32 x i16> {planes[1]}, {_ir_mask(msk)}")
            for g in range(4):
                wg = f"%wg{e}{h}{g}{v}"
                if one and (e or h):
                    wg = f"%wg00{g}{v}"
                else:
                    lines += [f"  {wg}.r = mul i64 %wld, {g}", f"  {wg}.o = add i64 %go{e}{h}, {wg}.r",
                              f"  {wg}.p = getelementptr i8, ptr %wp{v}, i64 {wg}.o", f"  {wg}.s = load i32, ptr {wg}.p, align 2",
                              f"  {wg}.i = insertelement <16 x i32> poison, i32 {wg}.s, i64 0"]  # fmt: skip
                    if split:  # lanes 0-7 (bytes 0-7 of the half) in one group, lanes 8-15 in the next
                        lines += [f"  {wg}.ob = add i64 %go{e}{h}b, {wg}.r", f"  {wg}.pb = getelementptr i8, ptr %wp{v}, i64 {wg}.ob",
                                  f"  {wg}.sb = load i32, ptr {wg}.pb, align 2",
                                  f"  {wg}.ib = insertelement <16 x i32> {wg}.i, i32 {wg}.sb, i64 1",
                                  f"  {wg}.v = shufflevector <16 x i32> {wg}.ib, <16 x i32> poison, {_ir_mask([0] * 8 + [1] * 8)}"]  # fmt: skip
                    else:
                        lines.append(
                            f"  {wg}.v = shufflevector <16 x i32> {wg}.i, <16 x i32> poison, {_ir_mask([0] * 16)}"
                        )
                    lines.append(f"  {wg} = bitcast <16 x i32> {wg}.v to <32 x i16>")
                n = g * 4 + e * 2 + h
                _ir_dot(lines, f"%a{n}{v}.d", last[n], xy, wg, isa)
                last[n] = f"%a{n}{v}.d"
    lines += [f"  %a{n}{v}.out = or <16 x i32> {last[n]}, zeroinitializer" for n in range(16)]
    lines += [f"  %pi{v}.next = add i64 %pi{v}, 1", f"  %pc{v} = icmp ult i64 %pi{v}.next, %npairs",
              f"  br i1 %pc{v}, label %{lp}, label %unit.end"]  # fmt: skip


_SIMD_LIBS: dict = {}


def _simd_isa(context) -> str:
    """The instruction set the target machine of ``context`` offers for int16 dot products."""
    feats = set(getattr(context.codegen(), "_tm_features", "").split(","))
    if "+avx512bw" in feats:
        return "vnni" if "+avx512vnni" in feats else "bw"
    return "generic"


def _simd_function(context, role: str, kind: int) -> str:
    """Name of the generated LLVM function (``role`` "k" or "v"), its library linked into the caller."""
    from llvmlite import binding as llvm

    isa = _simd_isa(context)
    name = f"kvpack_{role}dot_{kind}_{isa}"
    cg = context.codegen()
    lib = _SIMD_LIBS.get((id(cg), name))
    if lib is None:
        lib = cg.create_library(name)
        mod = llvm.parse_assembly((_kdot_ir if role == "k" else _vdot_ir)(name, kind, isa))
        mod.triple = llvm.get_process_triple()
        lib.add_llvm_module(mod)
        _SIMD_LIBS[(id(cg), name)] = lib
    context.add_linking_libs([lib])
    return name


def _simd_codegen(role: str, kind: int):
    """Codegen calling the generated function: every array argument is followed by an element offset (the
    two become one pointer), every other argument is an integer (passed as i64). The last two pairs are rows to
    prefetch (the block after next into L2, the next block into L1); offset 0 (the null block) passes a null
    pointer: nothing to prefetch."""

    def codegen(context, builder, signature, vals):
        name = _simd_function(context, role, kind)
        out, i = [], 0
        while i < len(vals):
            ty = signature.args[i]
            if isinstance(ty, types.Array):
                ary = context.make_array(ty)(context, builder, vals[i])
                off = context.cast(builder, vals[i + 1], signature.args[i + 1], types.int64)
                nbytes = builder.mul(off, ir.Constant(ir.IntType(64), ty.dtype.bitwidth // 8))
                ptr = cgutils.pointer_add(builder, ary.data, nbytes, ir.IntType(8).as_pointer())
                if i >= len(vals) - 4:  # the last pairs: the next block to prefetch, offset 0 for none
                    ptr = builder.select(builder.icmp_unsigned("==", off, off.type(0)), ptr.type(None), ptr)
                out.append(ptr)
                i += 2
            else:
                out.append(context.cast(builder, vals[i], ty, types.int64))
                i += 1
        fnty = ir.FunctionType(ir.VoidType(), [v.type for v in out])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), out)
        return context.get_dummy_value()

    return codegen


def _kdot_intrinsic(kind: int):
    @intrinsic
    def kdot(typingctx, pay, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, pf, pfo, pf1, pfo1):
        sig = types.void(pay, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, pf, pfo, pf1, pfo1)
        return sig, _simd_codegen("k", kind)

    return kdot


def _vdot_intrinsic(kind: int):
    @intrinsic
    def vdot(typingctx, pay, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, pf, pfo, pf1, pfo1):
        sig = types.void(pay, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, pf, pfo, pf1, pfo1)
        return sig, _simd_codegen("v", kind)

    return vdot


_kdot_s8, _kdot_u8, _kdot_u4, _kdot_u2, _kdot_e4, _kdot_e5 = (_kdot_intrinsic(k) for k in (S8, U8, U4, U2, E4M3, E5M2))
_vdot_s8, _vdot_u8, _vdot_u4, _vdot_u2, _vdot_e4, _vdot_e5 = (_vdot_intrinsic(k) for k in (S8, U8, U4, U2, E4M3, E5M2))


@njit(**_NOREF)
def _kdot_int(kind, p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, pfo, pfo1):
    """Scores of ``4 * ngrp`` rows for 4 heads with int16 queries, their largest per head at ``mx[mxo:]`` (see
    :func:`_kdot_ir`)."""
    if kind == S8:
        _kdot_s8(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)
    elif kind == U8:
        _kdot_u8(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)
    elif kind == U4:
        _kdot_u4(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)
    elif kind == E4M3:
        _kdot_e4(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)
    elif kind == E5M2:
        _kdot_e5(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)
    else:
        _kdot_u2(p8, off, rs, ngrp, q16, qo, nm, qinv, qio, sc, sco, ld, coff, mx, mxo, p8, pfo, p8, pfo1)


@njit(**_NOREF)
def _vdot_int(kind, p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, pfo, pfo1):
    """Weighted sums of ``2 * npairs`` value rows for 4 heads with int16 weights (see :func:`_vdot_ir`)."""
    if kind == S8:
        _vdot_s8(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)
    elif kind == U8:
        _vdot_u8(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)
    elif kind == U4:
        _vdot_u4(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)
    elif kind == E4M3:
        _vdot_e4(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)
    elif kind == E5M2:
        _vdot_e5(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)
    else:
        _vdot_u2(p8, off, rs, npairs, w16, wo, wld, acc, ao, ld, dp, winv, wio, span, coff, p8, pfo, p8, pfo1)


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _q16_keys(qf, lim, cbar, q16, qinv, kc):
    """The folded query ``qf`` ``[G4, D]`` (keys' plane order) as int16 ``q16`` ``[G4 * D]`` (the same order,
    which :func:`_kdot_ir` reads), scaled per head to ``lim`` at its largest magnitude; ``qinv[g]`` ``[G4]``
    undoes the scaling. Rounding moves channel ``c`` by ``r_c`` (``|r_c| <= 0.5 max|qf[g]| / lim``), the
    score by ``sum_c r_c * code_c``; its part common to every token, ``cbar * sum_c r_c`` (``cbar``: the
    codes' midpoint, 0 for signed or centred ones), is taken out of ``kc[g]``, leaving
    ``sum_c r_c (code_c - cbar)``."""
    g_n = kc.shape[0]
    g4, d = qf.shape
    flim = np.float32(lim)
    ud = U64(d)
    for g in range(g4):
        row = qf[g]
        mb = np.int32(0)
        for i in range(ud):
            mb = _max_i32(mb, _abs_bits(row[i]))
        mx = _as_f32(mb)
        s = flim / mx if mx > 0 else _ZERO
        inv = mx / flim
        qinv[g] = inv
        o = U64(g * d)
        for i in range(ud):
            q16[o + i] = np.int16(np.rint(row[i] * s))
        if g < g_n and cbar != 0:
            rsum = _ZERO
            for i in range(ud):
                rsum += np.rint(row[i] * s) * inv - row[i]
            kc[g] -= cbar * rsum


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _w16_values(p, g_n, u0, u1, ta, tb, sv, vts, ngv, lim, pmax, w16, winv):
    """Attention weights ``p[g, t] * sv[grp * vts + t]`` (``t`` dropped when ``vts`` is 1: a scale per block)
    of rows ``[ta, tb)`` as int16 ``w16`` ``[G4 // 4, ngv, 4, B]`` (row ``t`` at ``t - ta``), zero outside
    ``[u0, u1)`` and for padding heads. ``p <= pmax[g]`` (head ``g``'s largest in the block), so ``pmax[g]``
    times the block's largest scale bounds head ``g``'s weights: that bound is scaled to ``lim``, ``winv[g]``
    undoes it (no pass over the weights to find their max)."""
    g4 = winv.shape[0]
    bs = w16.shape[0] // (g4 * ngv)
    mb = np.int32(0)
    s0, s1 = (U64(u0), U64(u1)) if vts > 1 else (U64(0), U64(1))
    for grp in range(ngv):
        so = U64(grp * vts)
        for t in range(s0, s1):
            mb = _max_i32(mb, _abs_bits(sv[so + t]))
    mx = _as_f32(mb)
    flim = np.float32(lim)
    for g in range(g4):
        bound = mx * min(pmax[g], np.float32(1.0)) if g < g_n else _ZERO
        s = flim / bound if bound > 0 else _ZERO
        winv[g] = bound / flim
        for grp in range(ngv):
            o = U64((((g // 4) * ngv + grp) * 4 + g % 4) * bs - ta)
            for t in range(U64(ta), U64(tb)):
                w16[o + t] = 0
            if g >= g_n:
                continue
            row = p[g]
            so = U64(grp * vts)
            if vts > 1:
                for t in range(U64(u0), U64(u1)):
                    w16[o + t] = np.int16(np.rint(row[t] * sv[so + t] * s))
            else:
                sg = sv[so] * s
                for t in range(U64(u0), U64(u1)):
                    w16[o + t] = np.int16(np.rint(row[t] * sg))


@njit(fastmath=FASTMATH, **_NOREF)
def _outlier_scores(kout, kidx, idx16, bh, nout, qp, kper, kdp, g_n, u0, u1, sc, qo):
    """``sc[g, t] += sum_j qp[g, idx_j] * r[t, j]`` for ``t`` in ``[u0, u1)``: the residuals ``r`` (fp16) of the
    ``nout`` outlier channels ``idx_j`` of block-and-head ``bh``. ``qp``: the query in the keys' plane order,
    pre-scaled but not folded (the residual is in key units); ``qo``: scratch of ``G * nout``."""
    no = U64(nout)
    gn = U64(g_n)
    for j in range(no):
        c = np.int64(kidx[1][bh * no + j]) if idx16 else np.int64(kidx[0][bh * no + j])
        pc = (c % kper) * kdp + c // kper  # natural channel -> the keys' plane order
        for g in range(gn):
            qo[g * no + j] = qp[g, pc]
    rb = bh * U64(sc.shape[1]) * no
    for t in range(U64(u0), U64(u1)):
        for j in range(no):
            r = _half(kout[1][rb + t * no + j])
            for g in range(gn):
                sc[g, t] += qo[g * no + j] * r


@njit(inline="always", **_NOREF)
def _spread_ok(x, n, lim_bits):
    """Whether the magnitudes ``x[:n]`` (float32) lie within ``lim_bits`` binary orders of their largest on
    average (a geometric mean from the exponent bits; zeros count as 24 orders down), i.e. whether int16
    operands scaled to their largest keep enough bits for the typical element. One outlier does not move a
    geometric mean, so it is what a single huge key or value scale is measured against."""
    return _spread(x, n) <= lim_bits * n


@njit(inline="always", **_NOREF)
def _spread(x, n):
    """``n`` times the mean binary orders of ``|x[:n]|`` below their largest (see :func:`_spread_ok`), int64."""
    un = U64(n)
    emax = np.int32(0)
    for i in range(un):
        emax = _max_i32(emax, np.int32(_abs_bits(x[i]) >> 23))
    floor = np.int32(emax - 24)
    tot = np.int64(0)  # the sum of the floored exponents: one max and one add per element (vectorizes)
    for i in range(un):
        tot += _max_i32(np.int32(_abs_bits(x[i]) >> 23), floor)
    return np.int64(emax) * np.int64(n) - tot


@njit(inline="always", **_NOREF)
def _orders(x, n):
    """Binary orders between the largest and the smallest magnitude of ``x[:n]`` (float32; from the exponent
    bits, one pass of int32 max and min that vectorizes): no element lies further below the largest, so ``n``
    times it bounds :func:`_spread` from above, a cheap test before it."""
    hi = np.int32(0)
    lo = np.int32(0x7FFFFFFF)
    for i in range(U64(n)):
        a = _abs_bits(x[i])
        hi = _max_i32(hi, a)
        lo = _min_i32(lo, a)
    return np.int64(hi >> np.int32(23)) - np.int64(lo >> np.int32(23))


@njit(inline="always", **_NOREF)
def _codes_reach(p8, base, n, cmin):
    """Whether some fp8 byte of ``p8[base:base + n]`` has a magnitude byte ``>= cmin``: codes that all stay
    below it would round to a few words of the integer path's table (:func:`_lut_table`)."""
    mb = np.int32(0)
    for i in range(U64(n)):
        mb = _max_i32(mb, np.int32(np.int32(p8[base + i]) & np.int32(0x7F)))
    return mb >= cmin


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _keys_fit(kpay, kp, qf, g_n, base, n):
    """Whether a block's keys keep the integer path's accuracy: the folded query ``qf`` ``[G4, D]`` of every head
    within ``kp[P_SPREAD]`` orders of its largest element (:func:`_spread_ok`) and, for fp8, codes reaching
    ``kp[P_CMIN]`` in the block's ``n`` payload bytes from ``base``."""
    if kp[P_CMIN] > 0 and not _codes_reach(kpay[0], base, n, kp[P_CMIN]):
        return False
    if kp[P_SPREAD] > 0:
        for g in range(g_n):
            if not _spread_ok(qf[g], qf.shape[1], kp[P_SPREAD]):
                return False
    return True


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _values_fit(vpay, vp, sv, nsv, base, n):
    """:func:`_keys_fit` for a block's values: its ``nsv`` scales ``sv`` (which set the int16 weights' unit) within
    ``vp[P_SPREAD]`` orders of their largest, and fp8 codes reaching ``vp[P_CMIN]``."""
    if vp[P_CMIN] > 0 and not _codes_reach(vpay[0], base, n, vp[P_CMIN]):
        return False
    lim = vp[P_SPREAD]
    return lim <= 0 or nsv <= 1 or _orders(sv, nsv) <= lim or _spread_ok(sv, nsv, lim)


@njit(inline="always", **_NOREF)
def _near_rows(tables, b, j, jp, tail, p, h, bs, t):
    """Flat offset of row ``t`` of the next block (``j + 1``) of row ``b``, head ``h``, for the integer loops to
    prefetch into L1 while they compute block ``j`` (0: none, i.e. no next block, or rows under 128 bytes, where
    it measured slower: int4 and int2 at head_dim 128, int8 at 64). ``p``: the payload's spec parameters."""
    rs = U64(p[P_ROW])
    if tail or j + 1 >= jp or rs < 128:
        return U64(0)
    nxt = np.int64(tables[b, j + 1])
    return _row0(p, nxt, h, bs) + U64(t) * rs if nxt else U64(0)


@njit(inline="always", **_NOREF)
def _row0(p, blk, h, bs):
    """Flat offset of head ``h``'s first row in block ``blk`` of a payload pool ``[num_blocks, H, B, P[P_ROW]]``
    (or of sequence ``blk`` in a tail): the block stride ``p[P_BST]`` need not be ``H * B * P[P_ROW]``."""
    return U64(blk) * U64(p[P_BST]) + U64(h) * U64(bs) * U64(p[P_ROW])


@njit(inline="always", **_NOREF)
def _scale0(p, blk, hs, zero):
    """Flat offset of head slot ``hs``'s ``P_TS * P_CS`` scales (``zero``: zero-points) in block ``blk`` of a scale
    pool ``[num_blocks, Hs, Ts, Cs]``, whose block stride ``p[P_SBST]`` (``p[P_ZBST]``) need not be ``Hs * Ts * Cs``."""
    return U64(blk) * U64(p[P_ZBST] if zero else p[P_SBST]) + U64(hs) * U64(p[P_TS] * p[P_CS])


@njit(inline="always", **_NOREF)
def _key_midpoint(kp):
    """The midpoint of a key spec's codes on the integer path, against which :func:`_q16_keys` takes out the
    query's rounding: 0 for signed and fp8 codes and for offset-binary ones (centred in the loop), else
    ``(2**bits - 1) / 2`` (codes with a zero-point)."""
    if kp[P_KIND] == S8 or kp[P_KIND] == E4M3 or kp[P_KIND] == E5M2 or kp[P_OFF] != 0:
        return _ZERO
    return np.float32(((1 << (8 // kp[P_PER])) - 1) / 2)


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _fold_keys(kscl, kzero, kp, idx, khs, kfoff, kcbar, kunit, kint, g_n, qp, qf, kc, sk, zk, pk, zp, q16, qinv):
    """Fold block ``idx``'s key scales (constant over its tokens) into the query: ``qf[g, c] = qp[g, c] * s[c]``
    in the keys' plane order, and the block's constant ``kc[g] = sum_c qp[g, c] * (z[c] - kfoff * s[c])``
    (zero-points, offsets); on the integer path (``kint``) also ``q16`` / ``qinv`` (:func:`_q16_keys`), with
    ``qinv`` in value units (``kunit``: fp8 table words). The arrays are :func:`_attend`'s scratch of those names."""
    d = qp.shape[1]
    kper, kskind, kcs = kp[P_PER], kp[P_SKIND], kp[P_CS]
    kdp = d // kper
    kzt = kp[P_ZKIND] != SC_NONE or kfoff != 0  # a per-block constant kc to compute
    _scales(kscl, kskind, _scale0(kp, idx, khs, False), kcs, sk)
    if kzt:
        _scales(kzero, kp[P_ZKIND], _scale0(kp, idx, khs, True), kcs, zk)
    pks = sk if (kcs > 1 and kper == 1) else pk  # the scales in the keys' plane order
    if kcs == 1:
        for i in range(d):
            pk[i] = sk[0]
            zp[i] = zk[0] - kfoff * sk[0] if kzt else _ZERO
    elif kper == 1:
        if kzt:
            for i in range(U64(d)):
                zp[i] = zk[i] - kfoff * sk[i]
    else:
        for k in range(kper):  # natural channel kper * j + k -> plane index k * kdp + j
            kb = U64(k * kdp)
            for jj in range(U64(kdp)):
                c = U64(kper) * jj + U64(k)
                pk[kb + jj] = sk[c]
                zp[kb + jj] = zk[c] - kfoff * sk[c] if kzt else _ZERO
    for g in range(g_n):
        for i in range(U64(d)):
            qf[g, i] = qp[g, i] * pks[i]
        c0 = _ZERO
        if kzt:
            for i in range(U64(d)):
                c0 += qp[g, i] * zp[i]
        kc[g] = c0
    if kint:
        _q16_keys(qf, kp[P_DOT], kcbar, q16, qinv, kc)
        if kunit != 1.0:
            for g in range(qinv.shape[0]):
                qinv[g] *= kunit


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _softmax_update(g, mnew, alpha, ls, m, lsum, acc, zacc):
    """Head ``g``'s online-softmax state after a step whose weights (relative to the new max ``mnew``) sum to
    ``ls``: the running sum and the accumulators ``acc`` ``[G4, D]``, ``zacc`` ``[G, nvg]`` scaled by
    ``alpha = exp2(m_old - mnew)`` (skipped when the max did not move)."""
    lsum[g] = lsum[g] * alpha + ls
    m[g] = mnew
    if alpha != 1.0:
        for i in range(acc.shape[1]):
            acc[g, i] *= alpha
        for grp in range(zacc.shape[1]):
            zacc[g, grp] *= alpha


@njit(inline="always", **_NOREF)
def _prefetch_block_scales(scl, zero, p, blk, hs):
    """Prefetch the scales and zero-points of block ``blk`` (0: none), head slot ``hs``: a few scattered lines."""
    if blk:
        n = p[P_TS] * p[P_CS]
        _prefetch_scales(scl, p[P_SKIND], _scale0(p, blk, hs, False), n)
        _prefetch_scales(zero, p[P_ZKIND], _scale0(p, blk, hs, True), n)


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _attend_multi(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j, nb, jp, h, kv_heads, bs, st, mt,
                  qspread, skip):  # fmt: skip
    """Blocks ``[j, j + nb)`` of row ``b`` (sealed, every position inside the window but the first ``skip`` rows of
    block ``j``) with one softmax step, on the integer path with key scales constant over a block's tokens (see
    :func:`_multi_eligible`). ``skip``: the positions before the window or the first attended one (a sink row kept
    in full precision, left padding), masked after the key loop; the block's largest score is then taken over
    the rows it keeps (an attention sink's score is far above the others').

    Per block, as in :func:`_attend`: the key scales folded into the int16 query, the key loop (scores into
    ``msc[:, i * B:]``, the block's constant ``kc`` added), the value scales, zero-point sums and int16 weights,
    the value loop; each block keeps its own weight bound (its largest ``p`` times its largest scale), so the
    results equal the one-block path's up to rounding (float rounding, plus for asymmetric int4 keys with int4
    group values a few int16 weight roundings flipped by float32 association: 7.7e-5 at most measured). Once per run: the max, the exponentials and
    their sum, the rescale of the accumulator (fixed costs that made up ~10% of an int8 block's time).
    ``st``: :func:`_attend`'s scratch; ``mt`` = (msc ``[G4, M * B]`` float32 scores, then weights p; mw
    ``[G4 // 4, ngv, 4, M * B]`` int16 weights; msv, mzv ``[M, nscr]`` float32 value scales and zero-points
    per block; mpk ``[M * G4]`` each block's largest score, then its largest p; mwinv ``[M, G4]`` each block's weight unit), with
    ``M = kp[P_MULTI] >= nb``.

    Each block is checked before its key loop, from the scales just read for it (:func:`_multi_fits`): the
    first that would lose the format's accuracy on the integer path ends the run (nothing of it computed but
    the fold). Returns the number of blocks done (``< nb``: block ``j + that`` is left to the float path);
    ``qspread``: ``D`` times the query's largest spread over its heads (:func:`_spread`)."""
    qp, m, lsum, acc, zacc, w, qf, kc, sk, zk, pk, zp, q16, qinv = (st[0], st[2], st[3], st[4], st[5], st[7], st[9],
        st[10], st[11], st[12], st[15], st[16], st[19], st[21])  # fmt: skip
    msc, mw, msv, mzv, mpk, mwinv = mt
    g_n, d = w.shape[0], qp.shape[1]
    lw = msc.shape[1]  # row stride of the scores and of the int16 weights
    kdp = d // kp[P_PER]
    vdp = d // vp[P_PER]
    khs = h // (kv_heads // kp[P_HS])
    vhs = h // (kv_heads // vp[P_HS])
    krs = U64(kp[P_ROW])
    vrs = U64(vp[P_ROW])
    vts, vcs = vp[P_TS], vp[P_CS]
    ngv = vcs if vcs > 1 else 1
    kcbar = _key_midpoint(kp)
    kunit = _code_unit(kp[P_KIND])
    vunit = _code_unit(vp[P_KIND])
    vspan = vdp // vcs if vcs > 1 else vdp
    kfar, vfar = kp[P_FAR], vp[P_FAR]
    ubs = U64(bs)
    g4 = mwinv.shape[1]
    nsv = vts * vcs
    guards = kp[P_SPREAD] > 0 or kp[P_CMIN] > 0 or vp[P_SPREAD] > 0 or vp[P_CMIN] > 0
    # ---- keys -> base-2 logits msc[g, i * B + t], the block's constant kc included; the value scales msv[i]
    nrun = nb
    for i in range(nrun):
        jj = j + i
        idx = np.int64(tables[b, jj])
        nxt = np.int64(tables[b, jj + kfar]) if (kfar and jj + kfar < jp) else np.int64(0)
        _prefetch_block_scales(kscl, kzero, kp, nxt, khs)
        vnx = np.int64(tables[b, jj + vfar]) if (vfar and jj + vfar < jp) else np.int64(0)
        _prefetch_block_scales(vscl, vzero, vp, vnx, vhs)
        _fold_keys(kscl, kzero, kp, idx, khs, _ZERO, kcbar, kunit, True, g_n, qp, qf, kc, sk, zk, pk, zp, q16, qinv)
        kbase = _row0(kp, idx, h, bs)
        svi = msv[i]
        _scales_t(vscl, vp[P_SKIND], _scale0(vp, idx, vhs, False), vts, vcs, pk, svi)  # after the fold: pk is scratch
        if guards and not _multi_fits(kpay, kp, vpay, vp, qf, sk, svi, nsv, g_n, kbase, U64(bs) * krs,
                                      _row0(vp, idx, h, bs), U64(bs) * vrs, qspread):  # fmt: skip
            nb = i
            break
        knext = _row0(kp, nxt, h, bs) if nxt else U64(0)
        for g0 in range(0, g_n, 4):  # the first pass prefetches the next blocks
            kpf = knext if g0 == 0 else U64(0)
            kpf1 = _near_rows(tables, b, jj, jp, False, kp, h, bs, 0) if g0 == 0 else U64(0)
            _kdot_int(kp[P_KIND], kpay[0], kbase, krs, bs // 4, q16, g0 * d, kdp // 32, qinv, g0, msc,
                      g0 * lw + i * bs, lw, kp[P_OFF], mpk, i * g4 + g0, kpf, kpf1)  # fmt: skip
        col = U64(i * bs)
        for g in range(g_n):
            c = kc[g]
            if c != 0:
                mpk[i * g4 + g] += c
                row = msc[g]
                for t in range(ubs):
                    row[col + t] += c
        if i == 0 and skip > 0:  # col is 0
            for g in range(g_n):
                row = msc[g]
                top = row[skip]
                for t in range(U64(skip + 1), ubs):
                    top = max(top, row[t])
                mpk[g] = top
                for t in range(U64(skip)):
                    row[t] = -np.inf
    # ---- online softmax (base 2), once for the nb blocks. mpk[i * G4 + g]: block i's largest score (from the key
    # loop), then its largest weight p, which with its largest scale bounds its int16 weights (per block, as on
    # the one-block path: a bound shared by the run costs the blocks far from the attention's peak precision)
    if nb == 0:
        return nb
    n = U64(nb * bs)
    for g in range(g_n):
        row = msc[g]
        mb = mpk[g]
        for i in range(1, nb):
            x = mpk[i * g4 + g]
            mb = x if x > mb else mb
        mnew = mb if mb > m[g] else m[g]
        alpha = _exp2(m[g] - mnew)
        ls = _ZERO
        for t in range(n):
            p = _exp2(row[t] - mnew)
            row[t] = p
            ls += p
        for i in range(nb):
            mpk[i * g4 + g] = _exp2(mpk[i * g4 + g] - mnew)
        _softmax_update(g, mnew, alpha, ls, m, lsum, acc, zacc)
    # ---- values: scales and zero-point sums per block, then int16 weights per block (as _w16_values)
    vz = vp[P_ZKIND] != SC_NONE
    flim = np.float32(vp[P_DOT])
    for i in range(nb):
        idx = np.int64(tables[b, j + i])
        svi = msv[i]  # read with the block's keys
        mbits = np.int32(0)
        if i == 0 and skip > 0 and vts > 1:  # per-token scales: the masked rows' do not bound the weights
            for grp in range(vcs):
                for t in range(U64(grp * vts + skip), U64(grp * vts + vts)):
                    mbits = _max_i32(mbits, _abs_bits(svi[t]))
        else:
            for e in range(U64(nsv)):
                mbits = _max_i32(mbits, _abs_bits(svi[e]))
        mx = _as_f32(mbits)
        col = U64(i * bs)
        if vz:
            zvi = mzv[i]
            _scales_t(vzero, vp[P_ZKIND], _scale0(vp, idx, vhs, True), vts, vcs, pk, zvi)
            for grp in range(vcs):
                gb = U64(grp * vts)
                for g in range(g_n):
                    row = msc[g]
                    zsum = _ZERO
                    if vts > 1:
                        for t in range(ubs):
                            zsum += row[col + t] * zvi[gb + t]
                    else:
                        zz = zvi[grp]
                        for t in range(ubs):
                            zsum += row[col + t] * zz
                    zacc[g, grp] += zsum
        for g in range(g_n, g4):  # padding heads: their weight rows stay zero
            mwinv[i, g] = _ZERO
        for g in range(g_n):
            bound = mx * min(mpk[i * g4 + g], np.float32(1.0))
            sg = flim / bound if bound > 0 else _ZERO
            mwinv[i, g] = bound / flim * vunit
            row = msc[g]
            for grp in range(ngv):
                o = U64((((g // 4) * ngv + grp) * 4 + g % 4) * lw) + col
                so = U64(grp * vts)
                if vts > 1:
                    for t in range(ubs):
                        mw[o + t] = np.int16(np.rint(row[col + t] * svi[so + t] * sg))
                else:
                    s0 = svi[so] * sg
                    for t in range(ubs):
                        mw[o + t] = np.int16(np.rint(row[col + t] * s0))
    for i in range(nb):
        jj = j + i
        idx = np.int64(tables[b, jj])
        vbase = _row0(vp, idx, h, bs)
        vnx = np.int64(tables[b, jj + vfar]) if (vfar and jj + vfar < jp) else np.int64(0)
        vnext = _row0(vp, vnx, h, bs) if vnx else U64(0)
        for g0 in range(0, g_n, 4):
            vpf = vnext if g0 == 0 else U64(0)
            vpf1 = _near_rows(tables, b, jj, jp, False, vp, h, bs, 0) if g0 == 0 else U64(0)
            _vdot_int(vp[P_KIND], vpay[0], vbase, vrs, bs // 2, mw, g0 * ngv * lw + i * bs, 2 * lw, acc, g0 * d, d,
                      vdp, mwinv[i], g0, vspan, vp[P_OFF], vpf, vpf1)  # fmt: skip
    return nb


@njit(fastmath=FASTMATH, **_NOREF)
def _attend(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j0, j1, jp, n, lo, tail, h, kv_heads, bs, st,
            kout, kidx):  # fmt: skip
    """Attend row ``b``'s sealed blocks ``[j0, j1)`` (or, when ``tail``, its tail), positions ``>= lo`` only;
    blocks before ``jp`` (``>= j1``) may be prefetched: the thread's next work item may go on from ``j1``.

    The block loop lives here so the many array arguments are passed once per chunk, not once per block.
    tables: ``[batch, max_blocks]`` int32; n: the row's seq_len; for the tail, kpay/vpay are the tails'
    views and kp/vp their passthrough specs, and the "block" is indexed by ``b``. kp/vp: spec parameters;
    ``st`` = (qp, qsum, m, lsum, acc, zacc, sc, w, mxb, qf, kc, sk, zk, sv, zv, pk, zp, buf, sx, q16, w16, qinv, winv, kmx):
    qp ``[G4, D]`` the query in the keys' plane order, pre-scaled by ``sm_scale * log2(e)`` (G rounded up to
    a multiple of 4, padding rows zero); qsum
    ``[G, nkg]`` its sums per key scale group; m, lsum ``[G]`` running max (base 2) and sum; acc ``[G, D]``
    in the values' plane order; zacc ``[G, nvg]`` zero-point / offset terms per value group; buf
    ``[TILE, D]`` the decoded rows; mxb ``[G]`` the block's max logit per head; kmx ``[G4]`` the key loop's
    maxima (unused here: its rows may start before ``t0``); the rest is scratch.
    kout, kidx: flat (uint8, uint16, float32) views of the outlier residuals ``[num_blocks, H, B, nout]``
    (fp16) and their channels ``[num_blocks, H, nout]`` (uint8, or int16 when ``kp[P_IDX16]``); ``nout`` is
    ``kp[P_NOUT]`` (0: the format keeps none; the tails' specs have 0).
    """
    qp, qsum, m, lsum, acc, zacc, sc, w, mxb, qf, kc, sk, zk, sv, zv, pk, zp, buf, sx, q16, w16, qinv, winv, kmx = st
    g_n, d = w.shape[0], qp.shape[1]
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
    nout = kp[P_NOUT]
    # integer dot products (see _kdot_ir) where the launcher found the layout allows them, per block where its
    # operands keep the format's accuracy (_keys_fit, _values_fit: else the block takes the float path)
    kint_spec = kp[P_DOT] > 0
    vint_spec = vp[P_DOT] > 0
    ngv = vcs if vcs > 1 else 1
    # the integer path subtracts the offset of offset-binary codes in the loop (signed, centred codes): the
    # per-block constants then leave it out; codes with a zero-point keep their midpoint (see _q16_keys)
    kcbar = _key_midpoint(kp)
    kunit = _code_unit(kp[P_KIND])  # fp8 codes: table words -> values
    vunit = _code_unit(vp[P_KIND])
    vspan = vdp // vcs if vcs > 1 else vdp
    kfar, vfar = kp[P_FAR], vp[P_FAR]  # blocks ahead to prefetch (0: none)
    # float32 rows in natural order are read in place; the others are decoded into buf, read as flat rows
    kflat = kp[P_KIND] == FLT and kp[P_FK] == FK_F32 and kper == 1
    vflat = vp[P_KIND] == FLT and vp[P_FK] == FK_F32 and vper == 1
    bflat = buf.reshape(buf.size)
    ud = U64(d)
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
        # the block P_FAR ahead (2: the block after next) is fetched while this one is computed (random block
        # ids: no hardware prefetch); 0 for none
        nxt = np.int64(tables[b, j + kfar]) if (kfar and not tail and j + kfar < jp) else np.int64(0)
        vnx = np.int64(tables[b, j + vfar]) if (vfar and not tail and j + vfar < jp) else np.int64(0)
        knext = _row0(kp, nxt, h, bs) if nxt else U64(0)
        vnext = _row0(vp, vnx, h, bs) if vnx else U64(0)
        _prefetch_block_scales(kscl, kzero, kp, nxt, khs)  # its scales and zero-points too
        _prefetch_block_scales(vscl, vzero, vp, vnx, vhs)
        # ---- keys -> base-2 logits sc[g, t] + kc[g]
        kbase = _row0(kp, idx, h, bs)
        qsrc = qp
        for g in range(g_n):
            kc[g] = _ZERO
        kint = False
        if kskind != SC_NONE and not grouped:
            # scale constant over the block's tokens: fold it into the query once per block (the offset left out
            # while the integer path may take the block, put back below if it does not)
            kfoff = _ZERO if kint_spec else koff
            _fold_keys(
                kscl, kzero, kp, idx, khs, kfoff, kcbar, kunit, False, g_n, qp, qf, kc, sk, zk, pk, zp, q16, qinv
            )
            qsrc = qf
            if kint_spec:
                kint = _keys_fit(kpay, kp, qf, g_n, kbase, U64(bs) * krs)
                if kint:
                    _q16_keys(qf, kp[P_DOT], kcbar, q16, qinv, kc)
                    for g in range(qinv.shape[0]):
                        qinv[g] *= kunit
                elif koff != 0:
                    for g in range(g_n):
                        c0 = _ZERO
                        for i in range(U64(d)):
                            c0 += qf[g, i]
                        kc[g] -= koff * c0
        elif grouped:
            # per-token scales (token or group granularity); groups are applied to the decoded tile
            _scales_t(kscl, kskind, _scale0(kp, idx, khs, False), bs, kcs, pk, sk)  # sk[grp * bs + t]
            _scales_t(kzero, kp[P_ZKIND], _scale0(kp, idx, khs, True), bs, kcs, pk, zk)
        for g in range(g_n):
            mxb[g] = -np.inf
        if kint:  # rows from t0 rounded down to 4 (they exist: block_size is a multiple of 4), max over [t0, t1)
            ta = t0 - t0 % 4
            for g0 in range(0, g_n, 4):  # the first pass prefetches the next blocks
                kpf = knext + U64(ta) * krs if (knext and g0 == 0) else U64(0)
                kpf1 = _near_rows(tables, b, j, jp, tail, kp, h, bs, ta) if g0 == 0 else U64(0)
                _kdot_int(kp[P_KIND], kpay[0], kbase + U64(ta) * krs, krs, (t1 - ta + 3) // 4, q16, g0 * d, kdp // 32,
                          qinv, g0, sc, g0 * bs + ta, bs, kp[P_OFF], kmx, g0, kpf, kpf1)  # fmt: skip
        for t in range(t0, t1 if not kint else t0, TILE):
            nt = min(TILE, t1 - t)
            if kflat:
                if knext:
                    _prefetch_rows(kpay, FLT, FK_F32, knext, krs, t, nt)
                _kdot_tile(kpay[2], kbase + U64(t) * krs, krs, nt, qsrc, sc, t, mxb)
            else:
                _decode_tile(kp[P_KIND], kpay, kbase, krs, t, nt, kper, kdp, kp[P_FK], sk, bs,
                             kcs if (grouped and kcs > 1) else 0, sx, buf, knext)  # fmt: skip
                _kdot_tile(bflat, U64(0), ud, nt, qsrc, sc, t, mxb)
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
        if nout:  # outlier key channels: + q[idx_j] * residual[t, j] (query not folded)
            _outlier_scores(kout, kidx, kp[P_IDX16], U64(idx * kv_heads + h), nout, qp, kper, kdp, g_n, u0, u1, sc, zp)
        if kint or nout:
            for g in range(g_n):
                row = sc[g]
                ib = _order_key(row[t0])
                for t in range(u0, u1):
                    x = _order_key(row[t])
                    ib = x if x > ib else ib
                mxb[g] = _from_order_key(ib)
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
            mxb[g] = _exp2(mb - mnew)  # the block's largest weight p (bounds the int16 weights)
            alpha = _exp2(m[g] - mnew)
            shift = kc[g] - mnew
            ls = _ZERO
            for t in range(u0, u1):
                p = _exp2(sc[g, t] + shift)
                sc[g, t] = p
                ls += p
            _softmax_update(g, mnew, alpha, ls, m, lsum, acc, zacc)
        # ---- values: the per-token (group) scale folded into the weight, zero-points summed per group
        vbase = _row0(vp, idx, h, bs)
        vint = False
        if vskind != SC_NONE:
            _scales_t(vscl, vskind, _scale0(vp, idx, vhs, False), vts, vcs, pk, sv)  # sv[grp * vts + t]
            _scales_t(vzero, vp[P_ZKIND], _scale0(vp, idx, vhs, True), vts, vcs, pk, zv)
            vint = vint_spec and _values_fit(vpay, vp, sv, vts * vcs, vbase, U64(bs) * vrs)
            vzoff = _ZERO if vint else voff
            for grp in range(vcs if (vp[P_ZKIND] != SC_NONE or vzoff != 0) else 0):
                # zero-point / offset terms: sum_t p * (z - off * s), per group
                gb = U64(grp * vts)
                for g in range(g_n):
                    zsum = _ZERO
                    if vts > 1:
                        for t in range(u0, u1):
                            zsum += sc[g, t] * (zv[gb + t] - vzoff * sv[gb + t])
                    else:
                        zz = zv[grp] - vzoff * sv[grp]
                        for t in range(u0, u1):
                            zsum += sc[g, t] * zz
                    zacc[g, grp] += zsum
            for g in range(g_n if not vint else 0):  # weights: p, times the scale when one per token (or block)
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
        if vint:  # rows from t0 rounded down to 2 (block_size is even), weights 0 outside [t0, t1)
            ta = t0 - t0 % 2
            tb = min(t1 + t1 % 2, bs)
            _w16_values(sc, g_n, t0, t1, ta, tb, sv, vts, ngv, vp[P_DOT], mxb, w16, winv)
            if vunit != 1.0:
                for g in range(winv.shape[0]):
                    winv[g] *= vunit
            for g0 in range(0, g_n, 4):
                vpf = vnext + U64(ta) * vrs if (vnext and g0 == 0) else U64(0)
                vpf1 = _near_rows(tables, b, j, jp, tail, vp, h, bs, ta) if g0 == 0 else U64(0)
                _vdot_int(vp[P_KIND], vpay[0], vbase + U64(ta) * vrs, vrs, (tb - ta) // 2, w16, g0 * ngv * bs,
                          2 * bs, acc, g0 * d, d, vdp, winv, g0, vspan, vp[P_OFF], vpf, vpf1)  # fmt: skip
        for t in range(t0, t1 if not vint else t0, TILE):
            nt = min(TILE, t1 - t)
            # scales along the row (groups, channels) are applied to the decoded rows
            if vflat:
                if vnext:
                    _prefetch_rows(vpay, FLT, FK_F32, vnext, vrs, t, nt)
                _vacc8(vpay[2], vbase + U64(t) * vrs, vrs, nt, w, t, acc, g_n)
            else:
                _decode_tile(vp[P_KIND], vpay, vbase, vrs, t, nt, vper, vdp, vp[P_FK], sv, vts,
                             vcs if (vskind != SC_NONE and vcs > 1) else 0, sx, buf, vnext)  # fmt: skip
                _vacc8(bflat, U64(0), ud, nt, w, t, acc, g_n)


@njit(inline="always", **_NOREF)
def _multi_eligible(kp, vp):
    """Whether :func:`_attend_runs` takes a history with these specs: integer dot products for keys and values,
    key scales constant over a block's tokens, scaled values, no outlier key channels, ``kp[P_MULTI]`` > 1."""
    return (kp[P_DOT] > 0 and vp[P_DOT] > 0 and kp[P_MULTI] > 1 and kp[P_NOUT] == 0 and kp[P_SKIND] != SC_NONE
            and kp[P_TS] == 1 and vp[P_SKIND] != SC_NONE)  # fmt: skip


@njit(inline="always", fastmath=FASTMATH, **_NOREF)
def _multi_fits(kpay, kp, vpay, vp, qf, sk, sv, nsv, g_n, kbase, kn, vbase, vn, qspread):
    """Whether a block of :func:`_attend_multi` keeps the integer path's accuracy for keys and values
    (:func:`_keys_fit`, :func:`_values_fit`), from what it has read for the block: the key scales ``sk``
    (``kp[P_CS]``, natural order), the folded query ``qf``, the value scales ``sv`` (``nsv``); ``kbase``,
    ``kn``, ``vbase``, ``vn``: the payload bytes (fp8 code checks). ``qspread``: ``D`` times the largest spread of
    the query's heads (:func:`_spread`). A product's exponent is the sum of its factors' (+1 at most), so the
    folded query spreads by at most the query's spread plus the scales' plus one order: only where that bound
    is over the limit is the folded query itself measured (``D`` steps per block instead of ``G * D``); before
    the scales' spread, their orders from largest to smallest (:func:`_orders`) bound it in one pass."""
    d = qf.shape[1]
    if kp[P_CMIN] > 0 and not _codes_reach(kpay[0], kbase, kn, kp[P_CMIN]):
        return False
    lim = kp[P_SPREAD]
    kcs = kp[P_CS]
    # the bound first from the scales' orders from largest to smallest (one pass), then from their spread
    if lim > 0 and qspread + (_orders(sk, kcs) + 1) * d > lim * d:
        bound = qspread + (_spread(sk, kcs) * d) // kcs + d
        if bound > lim * d:
            for g in range(g_n):
                if not _spread_ok(qf[g], d, lim):
                    return False
    return _values_fit(vpay, vp, sv, nsv, vbase, vn)


@njit(fastmath=FASTMATH, **_NOREF)
def _attend_runs(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j0, j1, jp, n, lo, h, kv_heads, bs, st,
                 kout, kidx, mt):  # fmt: skip
    """:func:`_attend` over sealed blocks ``[j0, j1)`` of row ``b`` for specs :func:`_multi_eligible` takes: runs of
    up to ``kp[P_MULTI]`` consecutive blocks inside the window go through :func:`_attend_multi` (one softmax
    step each; a block the window or the first attended position starts inside begins a run, its earlier rows
    masked); released blocks are skipped; so is a block whose integer operands would lose accuracy (:func:`_multi_fits`: it ends the run and takes
    the float path). A separate function so that :func:`_attend`, which every other case runs, compiles as before."""
    mlen = kp[P_MULTI]
    qspread = np.int64(0)  # the query's largest spread over its heads (see _multi_fits)
    for g in range(st[7].shape[0]):
        qspread = max(qspread, _spread(st[0][g], st[0].shape[1]))
    j = j0
    while j < j1:
        nb = 0
        # a run starts at the block the window (or the first attended position) starts inside: its rows before
        # lo are masked (skip); every later block of the run lies inside
        skip = max(lo - j * bs, 0)
        if skip < bs:
            while nb < mlen and j + nb < j1 and tables[b, j + nb] != 0 and (nb == 0 or (j + nb) * bs >= lo):
                nb += 1
        if nb > 0:
            done = _attend_multi(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j, nb, jp, h, kv_heads, bs, st,
                                 mt, qspread, skip)  # fmt: skip
            j += done
            if done == nb:
                continue
        # released (skipped inside), the window starts in it, or its operands do not fit the integer path
        _attend(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, j, j + 1, jp, n, lo, False, h, kv_heads, bs, st,
                kout, kidx)  # fmt: skip
        j += 1


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


@njit(**_NOREF)
def _item_cost(items, it):
    """What work item ``it`` costs, in blocks (its sealed blocks, the tail, and one for its setup)."""
    return items[it, 3] - items[it, 2] + items[it, 4] + 1


@njit(cache=True)
def run_count(items, threads, serial_blocks):
    """How many threads the items get: ``threads``, at most one per item, one for under ``serial_blocks``
    blocks of work (a hand-off costs more than it saves)."""
    blocks = 0
    for it in range(items.shape[0]):
        blocks += _item_cost(items, it)
    nt = threads if (items.shape[0] > 1 and blocks >= serial_blocks) else 1
    return max(1, min(nt, items.shape[0]))


@njit(cache=True)
def split_runs(items, nt):
    """``nt`` contiguous runs of the items of about equal cost, as :func:`take_item`'s ``[nt]`` int64 words
    (:func:`pack_run`); the last run takes whatever is left."""
    n_items = items.shape[0]
    blocks = 0
    for it in range(n_items):
        blocks += _item_cost(items, it)
    runs = np.empty(nt, np.int64)
    acc = 0
    it = 0
    start_it = 0
    for t in range(nt):
        goal = blocks * (t + 1) // nt
        while it < n_items and (acc + _item_cost(items, it) <= goal or t == nt - 1):
            acc += _item_cost(items, it)
            it += 1
        runs[t] = start_it | (it << 32)
        start_it = it
    return runs


@njit(cache=True)
def launch_plan(seq_lens, tables, start_pos, window, block_size, kv_heads, num_blocks, sink, target_items, min_chunk,
                threads, serial_blocks, g_n, d):  # fmt: skip
    """Everything a call needs between its arguments and its threads, in one compiled call (each numpy call
    or numba dispatch costs tens of microseconds with the caches cold after a kernel pass).

    seq_lens, start_pos: ``[batch]`` int32; tables: ``[batch, max_blocks]`` int32; window: -1 for none; sink:
    leading positions read from the sink rows (0: none). Returns ``(err, items, first, runs, kernel_start,
    sink_len, lo, pm, pl, pacc)``: ``err`` 0, or 1 (a sequence without tokens), 2 (too few table columns),
    3 (a block id outside the pools), and then the rest empty; the work items and the threads' runs
    (:func:`plan`, :func:`run_count`, :func:`split_runs`); the first position the
    kernel reads per row (past the sink rows), the sink positions each row reads and the first attended
    position; the partial results ``[n, G]``, ``[n, G]``, ``[n, G, D]`` float32.
    """
    batch = seq_lens.shape[0]
    err = 0
    for b in range(batch):
        if seq_lens[b] < 1:
            err = 1
            break
    if err == 0:
        for b in range(batch):
            if seq_lens[b] // block_size > tables.shape[1]:
                err = 2
                break
    if err == 0:
        for b in range(batch):
            for j in range(tables.shape[1]):
                if tables[b, j] < 0 or tables[b, j] >= num_blocks:
                    err = 3
    kernel_start = np.empty(batch, np.int32)
    sink_len = np.zeros(batch, np.int64)
    lo = np.empty(batch, np.int64)
    for b in range(batch):
        n = np.int64(seq_lens[b])
        s0 = np.int64(start_pos[b]) if start_pos.shape[0] else np.int64(0)
        sink_len[b] = min(n // block_size * block_size, sink)
        kernel_start[b] = max(s0, sink_len[b])
        lo[b] = s0 if window < 0 else max(s0, n - window)
    if err:
        items = np.empty((0, 5), np.int64)
        first = np.zeros(1, np.int64)
    else:
        items, first = plan(seq_lens, kernel_start, window, block_size, kv_heads, target_items, min_chunk)
    runs = split_runs(items, run_count(items, threads, serial_blocks))
    n_items = items.shape[0]
    pm = np.empty((n_items, g_n), np.float32)
    pl = np.empty((n_items, g_n), np.float32)
    pacc = np.empty((n_items, g_n, d), np.float32)
    return err, items, first, runs, kernel_start, sink_len, lo, pm, pl, pacc


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def work(t, runs, items, q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tailk, tailv, tpk, tpv, tables, seq_lens,
         start_pos, window, qscale, kv_heads, block_size, pm, pl, pacc, kout, kidx):  # fmt: skip
    """Thread ``t``'s share of the work items: it takes them from ``runs`` (:func:`take_item`) until none is
    left. Releases the GIL: the launcher calls it once on each of its threads.

    When the item a thread takes next continues the one it just did (same row and head, the next blocks),
    the online softmax state carries on and the finished item's partial is left empty (``pm`` -inf, which
    the merge skips), so cutting a history into many items costs neither a cold start (the first blocks of
    an item are not prefetched) nor merge work; only items taken by another thread become partials.

    q: ``[batch, Hq, D]`` float32. kpay/vpay: flat (uint8, uint16, float32) views of the payload pools
    ``[num_blocks, H, B, P]``; kscl/vscl, kzero/vzero: flat views of ``[num_blocks, Hs, Ts, Cs]``; kp/vp:
    int64 spec parameters (``P_*``; a pool is contiguous within a block, its blocks ``P_BST`` / ``P_SBST`` /
    ``P_ZBST`` elements apart); tailk/tailv: flat views of the tails ``[batch, H, B, D]``, read with
    the passthrough specs tpk/tpv (natural channel order, ``P_PER`` 1; ``P_BST``: elements between sequences);
    tables: ``[batch, max_blocks]`` int32;
    seq_lens, start_pos: ``[batch]`` int32; window: -1 for none; qscale: ``sm_scale * log2(e)``;
    items: from :func:`plan`; kout, kidx: outlier key channels (see :func:`_attend`).
    Writes the partial results pm, pl ``[n_items, G]`` (base-2 max, sum) and
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
    nscr = max(d, kp[P_TS] * kp[P_CS], vp[P_TS] * vp[P_CS], g_n * kp[P_NOUT])
    g4 = (g_n + 3) // 4 * 4  # heads are processed four at a time; rows past g_n are zero padding
    qp = np.zeros((g4, d), np.float32)
    qsum = np.zeros((g_n, nkg), np.float32)
    m = np.empty(g_n, np.float32)
    lsum = np.empty(g_n, np.float32)
    acc = np.empty((g4, d), np.float32)
    zacc = np.empty((g_n, nvg), np.float32)
    ngv = vp[P_CS] if (vp[P_CS] > 1 and vp[P_SKIND] != SC_NONE) else 1
    st = (qp, qsum, m, lsum, acc, zacc, np.zeros((g4, bs), np.float32), np.empty((g_n, bs), np.float32),
          np.empty(g_n, np.float32), np.zeros((g4, d), np.float32), np.empty(g_n, np.float32),
          np.empty(nscr, np.float32), np.empty(nscr, np.float32), np.empty(nscr, np.float32),
          np.empty(nscr, np.float32), np.empty(nscr, np.float32), np.empty(nscr, np.float32),
          np.empty((TILE, d), np.float32), np.empty(d, np.float32), np.zeros(g4 * d, np.int16),
          np.zeros(g4 * ngv * bs, np.int16), np.zeros(g4, np.float32), np.zeros(g4, np.float32),
          np.zeros(g4, np.float32))  # fmt: skip
    multi = _multi_eligible(kp, vp)
    nm = kp[P_MULTI] if multi else 1
    mt = (np.zeros((g4, nm * bs), np.float32), np.zeros(g4 * ngv * nm * bs, np.int16), np.zeros((nm, nscr), np.float32),
          np.zeros((nm, nscr), np.float32), np.zeros(nm * g4, np.float32), np.zeros((nm, g4), np.float32))  # fmt: skip
    # the tails' rows are in natural channel order: their own query (natural order) and, when the values are
    # packed in planes, the accumulator put into natural order before the tail
    qn = np.zeros((g4, d), np.float32)
    stn = (qn, *st[1:])
    tmp = np.empty(d, np.float32)
    it = take_item(runs, t)
    while it >= 0:
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
        natural = vper == 1  # acc in natural channel order
        tailed = False  # the tail was attended: the item is the row's last
        while True:
            if multi:
                _attend_runs(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, items[it, 2], items[it, 3], n // bs,
                             n, lo, h, kv_heads, bs, st, kout, kidx, mt)  # fmt: skip
            else:
                _attend(kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tables, b, items[it, 2], items[it, 3], n // bs, n,
                        lo, False, h, kv_heads, bs, st, kout, kidx)  # fmt: skip
            if items[it, 4]:  # the tail: one more block, passthrough, indexed by the sequence's row
                for g in range(g_n):
                    for c in range(d):
                        qn[g, c] = q[b, h * g_n + g, c] * qscale
                if not natural:
                    for g in range(g_n):
                        for i in range(d):
                            tmp[i] = acc[g, i]
                        for k in range(vper):
                            for j in range(vdp):
                                acc[g, vper * j + k] = tmp[k * vdp + j]
                    natural = True
                tailed = True
                _attend(tailk, kscl, kzero, tpk, tailv, vscl, vzero, tpv, tables, b, 0, 1, 1, n, lo, True, h, kv_heads,
                        bs, stn, kout, kidx)  # fmt: skip
            nx = take_item(runs, t)
            if nx != it + 1 or items[nx, 0] != b or items[nx, 1] != h or items[nx, 2] != items[it, 3] or tailed:
                break
            for g in range(g_n):  # the next item goes on from here: this one's partial is empty
                pm[it, g] = -np.inf
                pl[it, g] = _ZERO
            it = nx
        for g in range(g_n):
            pm[it, g] = m[g]
            pl[it, g] = lsum[g]
            if natural:
                for c in range(d):
                    pacc[it, g, c] = acc[g, c] + zacc[g, c // vgs]
                continue
            for k in range(vper):
                for j in range(vdp):
                    c = vper * j + k
                    pacc[it, g, c] = acc[g, k * vdp + j] + zacc[g, c // vgs]
        it = nx


@njit(parallel=True, nogil=True, cache=True)
def launch(n, runs, items, q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tailk, tailv, tpk, tpv, tables, seq_lens,
           start_pos, window, qscale, kv_heads, block_size, pm, pl, pacc, kout, kidx):  # fmt: skip
    """:func:`work` on ``n`` threads of numba's pool, thread ``t`` from ``0`` to ``n - 1`` (one iteration each;
    a thread that gets two runs them one after the other, and :func:`take_item` balances the items either way).

    One compiled call starts every thread, where a Python thread pool pays a dispatcher call per thread under
    the GIL and wakes threads that then wait for cores torch's own OpenMP workers still hold: on the 2-core
    development VM, int4 decode of 32 requests x ~450 tokens (3 kv heads, head_dim 64) right after a matrix
    product took 2.1 ms on a Python thread pool and 0.7 ms here (1.0 and 0.6 ms called on their own)."""
    for t in prange(n):
        work(t, runs, items, q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, tailk, tailv, tpk, tpv, tables,
             seq_lens, start_pos, window, qscale, kv_heads, block_size, pm, pl, pacc, kout, kidx)  # fmt: skip


@njit(fastmath=FASTMATH, cache=True)
def merge(first, kv_heads, pm, pl, pacc, q, sink_k, sink_v, sink_len, lo, scale_log2, out):
    """Combine the chunks of each ``(row, head)`` with log-sum-exp into ``out`` ``[batch, Hq, D]`` float32, with
    the row's sink positions ``[lo, sink_len)`` as one more partial, attended here.

    first: ``[batch * kv_heads + 1]`` from :func:`plan`; pm, pl, pacc: the partials from :func:`work`;
    q: ``[batch, Hq, D]`` float32; sink_k, sink_v: ``[batch, H, S, D]`` float32 sink rows, or arrays with no
    rows when there are none; sink_len, lo: ``[batch]`` int64 (:func:`launch_plan`); scale_log2:
    ``sm_scale * log2(e)``. A row with nothing to attend gets zeros. (The sink rows were a separate call with
    its own ``[batch * H, G, D]`` partials: ~0.7 us per row and head at batch 32, more than the merge itself.)
    """
    g_n = out.shape[1] // kv_heads
    d = out.shape[2]
    sinks = sink_k.shape[0] > 0
    s_n = sink_k.shape[2]
    x = np.empty(max(s_n, 1), np.float32)
    for bh in range(first.shape[0] - 1):
        b = bh // kv_heads
        h = bh % kv_heads
        i0 = first[bh]
        i1 = first[bh + 1]
        p0 = lo[b] if sinks else 0
        p1 = sink_len[b] if sinks else 0
        for g in range(g_n):
            o = out[b, h * g_n + g]
            o[:] = 0.0
            mx = np.float32(-np.inf)
            for it in range(i0, i1):
                mx = max(mx, pm[it, g])
            for p in range(p0, p1):  # the sink rows' base-2 logits
                s = _ZERO
                for i in range(d):
                    s += q[b, h * g_n + g, i] * sink_k[b, h, p, i]
                x[p] = s * scale_log2
                mx = max(mx, x[p])
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
            for p in range(p0, p1):
                f = _exp2(x[p] - mx)
                den += f
                for i in range(d):
                    o[i] += f * sink_v[b, h, p, i]
            inv = np.float32(1.0) / den
            for i in range(d):
                o[i] *= inv
