"""The compiled seal of integer formats: a full block's keys or values quantized and packed in one call.

:func:`kvpack.quant.quantize` does the same in ~40 small torch operations per spec, which on the CPU costs
~0.4 ms per call whatever the block's size: paid per layer and step in the vLLM backend, where a block seals
at whichever step fills it. :func:`seal_int` gives the very same bytes (scales and zero-points rounded to
float16 as :func:`kvpack.quant.encode_scale` rounds them, codes rounded half to even, the same packing), and
writes them straight into the rows of the destination blocks. In the vLLM backend, :func:`seal_step` gathers a
step's filled blocks from the tails (float32, bfloat16 or float16) and seals keys and values in one call, and
:func:`write_rows` writes the other rows to their tails. Imported only through :mod:`kvpack.kernels.cpu_seal`;
numba's disk cache tracks this file alone, not the float conversions it takes from
:mod:`kvpack.kernels.cpu_decode_numba` (clear the cache after changing those).

What keeps it fast (an int4 block of 3 kv heads x 64 tokens x 64 channels, :func:`seal_int` called alone on
the 2-core development VM: keys 6.3 -> 5.1 us, values 18.1 -> 7.2 us): numba's numpy error model (its default
checks every float division for zero, and that branch kept the loops scalar: the quantization loop of one
block alone took 9.8 us with it, 1.3 without), unsigned indices, loops without branches (a scale group's scale
and zero-point read once per group, the float16 rounding of scales as integer steps and clamps), the float16
-> float32 conversions in hardware where there is one (a 256 KiB table read at random misses the caches inside
a serving engine), no allocation per scale group, the finiteness check an integer max over the bits, and int4
bytes packed two codes at a time.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from kvpack.kernels.cpu_decode_numba import _HW_HALF, _as_f32, _half_hw

U64 = np.uint64

_F16_MAX_BITS = 0x7BFF  # 65504
_F16_TINY_BITS = 0x0400  # 2**-14, the smallest normal float16


@njit(cache=True, error_model="numpy")
def _f32_to_f16_bits(bits):
    """float32 bit pattern (uint32, as int64) -> float16 bit pattern, rounded to nearest, ties to even."""
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    if exp == 0xFF:
        return sign | 0x7C00 | (0x200 if man else 0)
    e = exp - 127 + 15
    if e >= 0x1F:
        return sign | 0x7C00
    if e <= 0:
        if e < -10:
            return sign
        man = man | 0x800000
        shift = 14 - e
        half = man >> shift
        rem = man & ((1 << shift) - 1)
        mid = 1 << (shift - 1)
        if rem > mid or (rem == mid and (half & 1)):
            half += 1
        return sign | half
    half = (e << 10) | (man >> 13)
    rem = man & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (half & 1)):
        half += 1  # a carry into the exponent is the right result (up to inf)
    return sign | half


@intrinsic
def _f16_bits_hw(typingctx, x):
    """float32 -> float16 bits rounded to nearest, ties to even, by the hardware conversion (``fptrunc``:
    ``vcvtps2ph`` on x86); what :func:`_f32_to_f16_bits` computes for every non-NaN value. Only used where
    :data:`~kvpack.kernels.cpu_decode_numba._HW_HALF` (elsewhere LLVM would call a helper numba may not link)."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        h = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return builder.zext(h, ir.IntType(64))

    return types.int64(x), codegen


@njit(cache=True, error_model="numpy", inline="always")
def _rne_f16(v, bits):
    """float32 ``v`` (``bits``: its bit pattern) -> float16 bits, rounded to nearest, ties to even."""
    return _f16_bits_hw(v) if _HW_HALF else _f32_to_f16_bits(np.int64(bits))


@njit(cache=True, error_model="numpy", inline="always")
def _f16_value(h, f16):
    """float16 bits -> float32: the hardware conversion where there is one (the 256 KiB table, read at random,
    missed the caches inside a serving engine), else the table."""
    return _half_hw(h) if _HW_HALF else f16[h]


@njit(cache=True, error_model="numpy", inline="always")
def _scale_f16(v, bits, f16):
    """:func:`kvpack.quant.encode_scale` to float16, rounding up, for a scale ``v > 0``: rounded to nearest,
    then one step up if that fell below ``v``, at least the smallest normal, saturated to 65504. Without
    branches (so the loop over a block's groups vectorizes): the next pattern up is ``h + 1`` for a positive
    value, and positive patterns are ordered like their values, so the clamps to ``[2**-14, 65504]`` are
    integer clamps."""
    h = _rne_f16(v, bits)
    h += np.int64(_f16_value(h, f16) < v)
    h = max(h, np.int64(_F16_TINY_BITS))
    return min(h, np.int64(_F16_MAX_BITS))


@njit(cache=True, error_model="numpy", inline="always")
def _zero_f16(v, bits, f16):
    """:func:`kvpack.quant.encode_scale` to float16, rounding down, for a finite zero-point ``v``, without
    branches: rounded to nearest, then one pattern down (``h - 1`` above zero, ``h + 1`` below it, the smallest
    negative denormal from +-0) if rounding passed ``v``, then saturated to +-65504."""
    h = _rne_f16(v, bits)
    mag = h & 0x7FFF
    down = np.int64(0x8001) if mag == 0 else (h - 1 if h < 0x8000 else h + 1)
    h = down if _f16_value(h, f16) > v else h
    mag = h & 0x7FFF
    return (h & 0x8000) | _F16_MAX_BITS if (mag > _F16_MAX_BITS and mag <= 0x7C00) else h


@njit(cache=True, error_model="numpy")
def _finite(x):
    """Whether every element of the contiguous float32 array ``x`` is finite (exponent bits not all ones; an
    integer max over the bits, which vectorizes)."""
    bits = x.reshape(-1).view(np.uint32)
    top = np.uint32(0)
    for i in range(bits.size):
        e = bits[i] & np.uint32(0x7F800000)
        top = e if e > top else top
    return top < np.uint32(0x7F800000)


@njit(cache=True, error_model="numpy")
def _ranges(x, i, hs, ts, cs, asym, lo, hi):
    """Each scale group's range over block ``i`` of ``x`` ``[K, H, T, D]``: ``lo``/``hi`` ``[Hs * Ts * Cs]``
    (symmetric: ``hi`` the largest magnitude). Rows are read in order; groups one channel wide
    (per-channel scales) are updated element-wise along the row, wider groups reduced over their span.
    Indices are unsigned and the loops branch-free so that they vectorize."""
    _, h, t, d = x.shape
    gh, gt, gc = h // hs, t // ts, d // cs
    xf = x[i].reshape(h * t * d)
    ud, ugc = U64(d), U64(gc)
    lo[:] = np.inf
    hi[:] = -np.inf
    for a in range(h):
        for b in range(t):
            base = U64((a * t + b) * d)
            gb = U64(((a // gh) * ts + b // gt) * cs)
            if gc == 1:
                if asym:
                    for c in range(ud):
                        v = xf[base + c]
                        lo[gb + c] = min(lo[gb + c], v)
                        hi[gb + c] = max(hi[gb + c], v)
                else:
                    for c in range(ud):
                        hi[gb + c] = max(hi[gb + c], abs(xf[base + c]))
                continue
            for cc in range(U64(cs)):
                lv, hv = lo[gb + cc], hi[gb + cc]
                o = base + cc * ugc
                if asym:
                    for c in range(ugc):
                        v = xf[o + c]
                        lv = min(lv, v)
                        hv = max(hv, v)
                else:
                    for c in range(ugc):
                        hv = max(hv, abs(xf[o + c]))
                lo[gb + cc], hi[gb + cc] = lv, hv


@njit(cache=True, nogil=True, error_model="numpy")
def seal_int(x, hs, ts, cs, bits, asym, qmin, qmax, f16, ids, data_out, scale_out, zero_out):
    """Quantize and pack ``K`` blocks into their pages (:func:`_seal_into`); returns 1 (nothing written) if ``x``
    holds a NaN/inf."""
    if not _finite(x):
        return 1
    _seal_into(x, hs, ts, cs, bits, asym, qmin, qmax, f16, ids, data_out, scale_out, zero_out)
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def _seal_into(x, hs, ts, cs, bits, asym, qmin, qmax, f16, ids, data_out, scale_out, zero_out):
    """Quantize and pack ``K`` finite blocks into their pages.

    Args:
        x: ``[K, H, T, D]`` float32, contiguous: the blocks' keys or values.
        hs, ts, cs: the scale shape ``[Hs, Ts, Cs]`` per block (groups of ``H/Hs x T/Ts x D/Cs`` elements).
        bits: 8, 4 or 2; asym: zero-points (codes ``[0, qmax]``) or symmetric (``[qmin, qmax]``).
        f16: ``[65536]`` float32, float16 bit pattern -> value.
        ids: ``[K]`` int64 destination rows.
        data_out: ``[NB, H * T * packed]`` uint8 rows (payload bytes, ``[H, T, packed]`` per row).
        scale_out, zero_out: ``[NB, 2 * Hs * Ts * Cs]`` uint8 rows (float16 scales and zero-points; zero_out
            unused when symmetric).
    """
    nk, h, t, d = x.shape
    gh, gt, gc = h // hs, t // ts, d // cs
    per = 8 // bits
    packed = (d + per - 1) // per
    ng = hs * ts * cs
    sc = np.empty(ng, np.uint16)
    zc = np.empty(ng, np.uint16)
    sf = np.empty(ng, np.float32)
    zf = np.zeros(ng, np.float32)
    lo = np.empty(ng, np.float32)
    hi = np.empty(ng, np.float32)
    codes = np.zeros(packed * per, np.int32)
    sv = np.empty(ng, np.float32)  # each group's scale before float16 rounding
    one = np.float32(1.0)
    fmin, fmax = np.float32(qmin), np.float32(qmax)
    off = 0 if (asym or bits == 8) else 1 << (bits - 1)
    mask = (1 << bits) - 1
    for c in range(d, packed * per):
        codes[c] = -off  # padding of a ragged last byte packs as zero
    for i in range(nk):
        _ranges(x, i, hs, ts, cs, asym, lo, hi)
        lo_bits, s_bits = lo.view(np.uint32), sv.view(np.uint32)  # the values' bit patterns, for _rne_f16
        for g in range(ng):
            if asym:
                zh = _zero_f16(lo[g], lo_bits[g], f16)
                z = _f16_value(zh, f16)
                sv[g] = np.float32(np.float32(hi[g] - z) / fmax)
                zc[g] = zh
                zf[g] = z
            else:
                sv[g] = np.float32(hi[g] / fmax)
            if not sv[g] > 0:
                sv[g] = one
        for g in range(ng):
            shh = _scale_f16(sv[g], s_bits[g], f16)
            sc[g] = shh
            sf[g] = _f16_value(shh, f16)
        row = ids[i]
        xf = x[i].reshape(h * t * d)
        drow = data_out[row]
        ud, ugc = U64(d), U64(gc)
        for a in range(h):
            for b in range(t):
                gb = U64(((a // gh) * ts + b // gt) * cs)
                xb = U64((a * t + b) * d)
                # unsigned, branch-free loops: they vectorize (zero-points are 0 when symmetric)
                if gc == 1:  # a scale per channel: the row's scales are sf[gb : gb + d]
                    for c in range(ud):
                        q = np.rint(np.float32(np.float32(xf[xb + c] - zf[gb + c]) / sf[gb + c]))
                        codes[c] = np.int32(min(max(q, fmin), fmax))
                else:
                    for cc in range(U64(cs)):
                        s1, z1, o = sf[gb + cc], zf[gb + cc], cc * ugc
                        for c in range(ugc):
                            q = np.rint(np.float32(np.float32(xf[xb + o + c] - z1) / s1))
                            codes[o + c] = np.int32(min(max(q, fmin), fmax))
                base = U64((a * t + b) * packed)
                if bits == 8:
                    for c in range(ud):
                        drow[base + c] = np.uint8(codes[c] & 0xFF)
                elif bits == 4:
                    for j in range(U64(packed)):
                        lo4 = (codes[2 * j] + off) & mask
                        hi4 = (codes[2 * j + 1] + off) & mask
                        drow[base + j] = np.uint8(lo4 | (hi4 << 4))
                else:
                    for j in range(U64(packed)):
                        byte = 0
                        for e in range(per):
                            byte |= ((codes[j * per + e] + off) & mask) << (e * bits)
                        drow[base + j] = np.uint8(byte)
        for g in range(ng):
            scale_out[row, 2 * g] = np.uint8(sc[g] & 0xFF)
            scale_out[row, 2 * g + 1] = np.uint8(sc[g] >> 8)
            if asym:
                zero_out[row, 2 * g] = np.uint8(zc[g] & 0xFF)
                zero_out[row, 2 * g + 1] = np.uint8(zc[g] >> 8)


# -- a step's writes in the vLLM backend: tails in the model's dtype (float32, or bfloat16 / float16 as uint16 bits)

F32, BF16, F16 = range(3)  # the tails' and the step's rows' element kind


def _value(v, kind, f16):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_value, jit_options={"error_model": "numpy"})
def _value_impl(v, kind, f16):
    """One element as float32: float32 as is; uint16 bits as bfloat16 (``kind`` BF16: the high half of a
    float32) or float16 (:func:`_f16_value`)."""
    if isinstance(v, types.Float):
        return lambda v, kind, f16: np.float32(v)

    def impl(v, kind, f16):
        if kind == BF16:
            return _as_f32(np.uint32(v) << np.uint32(16))
        return _f16_value(v, f16)

    return impl


@njit(cache=True, nogil=True, error_model="numpy")
def gather_into(tail, new, kind, f16, slots, froms, toks, out):
    """Assemble the blocks a step fills: block ``i`` is slot ``slots[i]``'s first ``froms[i]`` tail rows, then
    new rows ``toks[i], toks[i] + 1, ...`` up to the block's end. Returns whether every value is finite.

    Args:
        tail: ``[capacity, H, T, D]`` tail rows; new: ``[N, H, D]`` the step's rows; float32, or the uint16 bits
            of ``kind`` (BF16, F16). f16: the float16 table. slots, froms, toks: ``[K]`` int64.
        out: ``[K, H, T, D]`` float32, written.
    """
    nk, h, t, d = out.shape
    ud = U64(d)
    for i in range(nk):
        s, f, k0 = slots[i], froms[i], toks[i]
        for a in range(h):
            for b in range(f):
                for c in range(ud):
                    out[i, a, b, c] = _value(tail[s, a, b, c], kind, f16)
            for b in range(f, t):
                for c in range(ud):
                    out[i, a, b, c] = _value(new[k0 + b - f, a, c], kind, f16)
    return _finite(out)


@njit(cache=True, nogil=True)
def rows_inside(tail, new, slots, froms, toks):
    """Whether every block :func:`gather_into` would assemble from ``tail`` ``[capacity, H, T, D]`` and ``new``
    ``[N, H, D]`` lies inside them (``slots``, ``froms``, ``toks``: ``[K]`` int64; a block with no tail rows,
    ``froms`` 0, reads no slot). In compiled code: the same checks in numpy cost ~70 us a call inside a serving
    engine, its caches cold."""
    cap, h, t, d = tail.shape
    n = new.shape[0]
    if new.shape[1] != h or new.shape[2] != d:
        return False
    for i in range(slots.shape[0]):
        f = froms[i]
        if f < 0 or f > t or toks[i] < 0 or toks[i] + t - f > n or (f > 0 and not (0 <= slots[i] < cap)):
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def seal_step(tail_k, tail_v, new_k, new_v, kind, f16, slots, froms, toks, ids, buf_k, buf_v,
              kq, k_data, k_scale, k_zero, vq, v_data, v_scale, v_zero):  # fmt: skip
    """The blocks a step fills, keys and values, gathered (:func:`gather_into`) and sealed (:func:`seal_int`)
    in one call. Returns 0; 1 with nothing written when a key or value is not finite; 2 with nothing read when a
    block's rows lie outside the tails or the step's rows (:func:`rows_inside`).

    Args:
        tail_k, tail_v: ``[capacity, H, T, D]`` the tails; new_k, new_v: ``[N, H, D]`` the step's rows; float32,
            or uint16 bits of ``kind`` (BF16, F16). slots, froms, toks, ids: ``[K]`` int64 (a block's slot is not
            read when it takes no tail rows, ``froms`` 0; ``ids`` checked by the caller). buf_k, buf_v:
            ``[K, H, T, D]`` float32 scratch.
        kq, vq: ``(hs, ts, cs, bits, asym, qmin, qmax)`` of the key and value specs (see :func:`seal_int`);
            k_data ... v_zero: their destination rows.
    """
    if not (rows_inside(tail_k, new_k, slots, froms, toks) and rows_inside(tail_v, new_v, slots, froms, toks)):
        return 2
    ok_k = gather_into(tail_k, new_k, kind, f16, slots, froms, toks, buf_k)
    ok_v = gather_into(tail_v, new_v, kind, f16, slots, froms, toks, buf_v)
    if not (ok_k and ok_v):
        return 1
    _seal_into(buf_k, kq[0], kq[1], kq[2], kq[3], kq[4], kq[5], kq[6], f16, ids, k_data, k_scale, k_zero)
    _seal_into(buf_v, vq[0], vq[1], vq[2], vq[3], vq[4], vq[5], vq[6], f16, ids, v_data, v_scale, v_zero)
    return 0


@njit(cache=True, nogil=True)
def _rows_fit(tail, new, toks, slots, offs):
    """Whether every row :func:`write_rows` would copy lies inside ``tail`` and ``new``."""
    cap, t = tail.shape[0], tail.shape[2]
    n = new.shape[0]
    for i in range(toks.shape[0]):
        if not (0 <= toks[i] < n and 0 <= slots[i] < cap and 0 <= offs[i] < t):
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def write_rows(tail_k, tail_v, new_k, new_v, toks, slots, offs):
    """``tail[slots[i], :, offs[i]] = new[toks[i]]`` for keys and values (any element type, bit for bit).
    Returns 1, with nothing written, when an index is outside ``tail`` or ``new``; else 0."""
    if not _rows_fit(tail_k, new_k, toks, slots, offs):
        return 1
    h, d = tail_k.shape[1], tail_k.shape[3]
    ud = U64(d)
    for i in range(toks.shape[0]):
        k0, s, o = toks[i], slots[i], offs[i]
        for a in range(h):
            for c in range(ud):
                tail_k[s, a, o, c] = new_k[k0, a, c]
                tail_v[s, a, o, c] = new_v[k0, a, c]
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def write_step(tail_k, tail_v, new_k, new_v, kind, f16, slots, froms, toks, ids, buf_k, buf_v,
               kq, k_data, k_scale, k_zero, vq, v_data, v_scale, v_zero, wtok, wslot, woff):  # fmt: skip
    """A step's writes in one call: :func:`seal_step` for the ``K = len(slots)`` blocks it fills (none: no seal),
    then :func:`write_rows` for the rows that go to tails. In the vLLM backend each compiled call of a layer's step
    starts with the caches cold, and its Python around it (arrays made, arguments unboxed) cost ~50 us of a seal's
    ~80 there: one call a step, its arrays made once per layer.

    Returns 0; 1 with nothing written when a key or value of a sealed block is not finite; 2 when a sealed block's
    rows lie outside the tails or the step's rows, 3 when a tail row does (nothing read or written). ``buf_k``,
    ``buf_v``: ``[>= K, H, T, D]`` float32 scratch (the first ``K`` used); the rest as :func:`seal_step` and
    :func:`write_rows` take them (``wtok``, ``wslot``, ``woff``: the latter's ``toks``, ``slots``, ``offs``)."""
    if not _rows_fit(tail_k, new_k, wtok, wslot, woff):  # checked before the seal writes anything
        return 3
    nk = slots.shape[0]
    if nk:
        err = seal_step(tail_k, tail_v, new_k, new_v, kind, f16, slots, froms, toks, ids, buf_k[:nk], buf_v[:nk],
                        kq, k_data, k_scale, k_zero, vq, v_data, v_scale, v_zero)  # fmt: skip
        if err:
            return err
    return 3 * write_rows(tail_k, tail_v, new_k, new_v, wtok, wslot, woff)


# -- kept key channels refined to 8 bits (o<k>r, o<k>qr): after the payload and scales are written


@njit(cache=True, nogil=True, error_model="numpy")
def _choose_channels(xb, ranked, energy, a, k, key1, key2, taken, chosen):
    """Head ``a``'s ``k`` kept channels of one block ``xb`` ``[H, T, D]``, ascending, into ``chosen``: by abs-max
    (``ranked`` 0), or by ``energy[a, c] * spread_c^2`` (1: the range, 2: twice the abs-max for a symmetric spec),
    ties to the wider channel, then to the lower one (as :func:`kvpack.outliers.seal_time_channels` and
    :func:`~kvpack.outliers.query_ranked_channels` order them)."""
    _, t, d = xb.shape
    for c in range(d):
        lo, hi, mx = np.float32(np.inf), np.float32(-np.inf), np.float32(0.0)
        for b in range(t):
            v = xb[a, b, c]
            lo = min(lo, v)
            hi = max(hi, v)
            mx = max(mx, abs(v))
        if ranked == 0:
            key1[c] = mx
            key2[c] = mx
        else:
            spread = np.float32(hi - lo) if ranked == 1 else np.float32(np.float32(2.0) * mx)
            key1[c] = np.float32(energy[a, c] * np.float32(spread * spread))
            key2[c] = spread
        taken[c] = False
    for j in range(k):
        best = -1
        for c in range(d):
            if taken[c]:
                continue
            if best < 0 or key1[c] > key1[best] or (key1[c] == key1[best] and key2[c] > key2[best]):
                best = c
        taken[best] = True
        chosen[j] = best
    for j in range(1, k):  # ascending (insertion sort: k is small)
        v = chosen[j]
        i = j - 1
        while i >= 0 and chosen[i] > v:
            chosen[i + 1] = chosen[i]
            i -= 1
        chosen[i + 1] = v


@njit(cache=True, nogil=True, error_model="numpy")
def refine_into(x, k, ranked, energy, fixed, bits, asym, f16, ids, data_out, scale_out, zero_out, res_out, idx_out,
                idx16):  # fmt: skip
    """The kept key channels of ``K`` sealed blocks as 4-bit refinement codes, once :func:`_seal_into` has written
    their payload, per-channel scales and zero-points: per block and head, the ``k`` channels (``fixed`` ``[H, k]``
    when it has rows, else :func:`_choose_channels`) into ``idx_out`` (``[H, k]`` uint8, or int16 little-endian
    when ``idx16``), and each kept element's code ``u = clamp(floor((x - deq) / s * 16 + 8), 0, 15)`` into
    ``res_out`` (``[H, T, ceil(k / 2)]``, channel ``j`` in byte ``j // 2``, the low nibble for even ``j``), with
    ``deq`` the stored code times the stored scale ``s`` (plus the zero-point), in float32 as
    :func:`kvpack.outliers.refine` computes it, so the bytes are the torch seal's.

    Args:
        x: ``[K, H, T, D]`` float32, the blocks as sealed. energy: ``[H, D]`` float32 (``ranked`` 1 or 2).
        bits, asym: the key spec's. f16: float16 bit pattern -> value. ids: ``[K]`` int64 rows.
        data_out, scale_out, zero_out: the rows :func:`_seal_into` wrote; res_out, idx_out: ``[NB, n]`` uint8 rows.
    """
    nk, h, t, d = x.shape
    per = 8 // bits
    packed = (d + per - 1) // per
    w = (k + 1) // 2
    off = 0 if (asym or bits == 8) else 1 << (bits - 1)
    mask = (1 << bits) - 1
    key1 = np.empty(d, np.float32)
    key2 = np.empty(d, np.float32)
    taken = np.zeros(d, np.bool_)
    chosen = np.empty(k, np.int64)
    sixteen, eight = np.float32(16.0), np.float32(8.0)
    for i in range(nk):
        row = ids[i]
        for a in range(h):
            if fixed.shape[0]:
                for j in range(k):
                    chosen[j] = fixed[a, j]
            else:
                _choose_channels(x[i], ranked, energy, a, k, key1, key2, taken, chosen)
            for j in range(k):
                c = chosen[j]
                if idx16:
                    idx_out[row, 2 * (a * k + j)] = np.uint8(c & 0xFF)
                    idx_out[row, 2 * (a * k + j) + 1] = np.uint8(c >> 8)
                else:
                    idx_out[row, a * k + j] = np.uint8(c)
            rbase = a * t * w
            for b in range(t):
                for e in range(w):
                    res_out[row, rbase + b * w + e] = 0
            for j in range(k):
                c = chosen[j]
                g = a * d + c  # per-channel scales: [H, 1, D]
                s = _f16_value(np.uint16(scale_out[row, 2 * g]) | (np.uint16(scale_out[row, 2 * g + 1]) << 8), f16)
                z = np.float32(0.0)
                if asym:
                    z = _f16_value(np.uint16(zero_out[row, 2 * g]) | (np.uint16(zero_out[row, 2 * g + 1]) << 8), f16)
                for b in range(t):
                    byte = np.int32(data_out[row, (a * t + b) * packed + c // per])
                    if bits == 8:  # asymmetric codes [0, 255]; symmetric ones two's complement
                        q = np.float32(byte) if asym else np.float32(np.int8(np.uint8(byte)))
                    else:
                        q = np.float32(((byte >> ((c % per) * bits)) & mask) - off)
                    deq = np.float32(q * s)
                    if asym:
                        deq = np.float32(deq + z)
                    r = np.float32(x[i, a, b, c] - deq)
                    u = 8
                    if s > 0:
                        f = np.floor(np.float32(np.float32(np.float32(r / s) * sixteen) + eight))
                        u = np.int32(min(max(f, np.float32(0.0)), np.float32(15.0)))
                    o = rbase + b * w + j // 2
                    res_out[row, o] = np.uint8(res_out[row, o] | (u << (4 * (j % 2))))
