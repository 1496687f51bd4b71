"""The compiled seal of integer formats: a full block's keys or values quantized and packed in one call.

:func:`kvpack.quant.quantize` does the same in ~40 small torch operations per spec, which on the CPU costs
~0.4 ms per call whatever the block's size: paid per layer and step in the vLLM backend, where a block seals
at whichever step fills it. :func:`seal_int` gives the very same bytes (scales and zero-points rounded to
float16 as :func:`kvpack.quant.encode_scale` rounds them, codes rounded half to even, the same packing), and
writes them straight into the rows of the destination blocks. Imported only through
:mod:`kvpack.kernels.cpu_seal`; numba's disk cache tracks this file alone.

What keeps it fast (an int4 block of 3 kv heads x 64 tokens x 64 channels: keys 37 -> 20 us, values 64 -> 29 us,
measured on the 2-core development VM): no allocation per scale group (the float16 rounding reads the bits of a
whole array of scales through one view), no integer division per element (each row's scales are spread over
its channels once, group by group), the finiteness check an integer max over the bits, and int4 bytes packed
two codes at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_F16_MAX_BITS = 0x7BFF  # 65504
_F16_TINY_BITS = 0x0400  # 2**-14, the smallest normal float16


@njit(cache=True)
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


@njit(cache=True)
def _next_f16(h, up):
    """``nextafter`` of float16 bits ``h`` towards +inf (``up``) or -inf."""
    if h & 0x7FFF == 0:  # +-0
        return 0x0001 if up else 0x8001
    if (h & 0x7FFF) > 0x7C00:  # NaN
        return h
    if h == 0x7C00:
        return h if up else 0x7BFF
    if h == 0xFC00:
        return 0xFBFF if up else h
    positive = (h & 0x8000) == 0
    return h + 1 if positive == up else h - 1


@njit(cache=True)
def _encode_f16(v, bits, f16, round_up):
    """:func:`kvpack.quant.encode_scale` to float16 of one float32 value ``v`` (``bits``: its bit pattern, uint32;
    ``f16``: float16 bits -> float32 table): rounded to nearest, then one step in ``round_up``'s direction if
    that passed ``v``, kept normal when rounding up a positive value, saturated to +-65504."""
    h = _f32_to_f16_bits(np.int64(bits))
    if round_up:
        if f16[h] < v:
            h = _next_f16(h, True)
        if v > 0 and f16[h] < f16[_F16_TINY_BITS]:
            h = _F16_TINY_BITS
    elif f16[h] > v:
        h = _next_f16(h, False)
    if (h & 0x7FFF) > 0x7C00:
        return h
    if (h & 0x7FFF) > _F16_MAX_BITS:
        h = (h & 0x8000) | _F16_MAX_BITS
    return h


@njit(cache=True)
def _finite(x):
    """Whether every element of the contiguous float32 array ``x`` is finite (exponent bits not all ones; an
    integer max over the bits, which vectorizes)."""
    bits = x.reshape(-1).view(np.uint32)
    top = np.uint32(0)
    for i in range(bits.size):
        e = bits[i] & np.uint32(0x7F800000)
        top = e if e > top else top
    return top < np.uint32(0x7F800000)


@njit(cache=True)
def _ranges(x, i, hs, ts, cs, asym, lo, hi):
    """Each scale group's range over block ``i`` of ``x`` ``[K, H, T, D]``: ``lo``/``hi`` ``[Hs * Ts * Cs]``
    (symmetric: ``hi`` the largest magnitude). Rows are read in order; groups one channel wide
    (per-channel scales) are updated element-wise along the row, wider groups reduced over their span."""
    _, h, t, d = x.shape
    gh, gt, gc = h // hs, t // ts, d // cs
    lo[:] = np.inf
    hi[:] = -np.inf
    for a in range(h):
        for b in range(t):
            gb = ((a // gh) * ts + b // gt) * cs
            if gc == 1:
                for c in range(d):
                    v = x[i, a, b, c]
                    if asym:
                        lo[gb + c] = v if v < lo[gb + c] else lo[gb + c]
                        hi[gb + c] = v if v > hi[gb + c] else hi[gb + c]
                    else:
                        m = abs(v)
                        hi[gb + c] = m if m > hi[gb + c] else hi[gb + c]
                continue
            for cc in range(cs):
                lv, hv = lo[gb + cc], hi[gb + cc]
                for c in range(cc * gc, cc * gc + gc):
                    v = x[i, a, b, c]
                    if asym:
                        lv = v if v < lv else lv
                        hv = v if v > hv else hv
                    else:
                        m = abs(v)
                        hv = m if m > hv else hv
                lo[gb + cc], hi[gb + cc] = lv, hv


@njit(cache=True, nogil=True)
def gather_blocks(tail, new, slots, froms, toks, out):
    """Assemble the blocks a step fills: block ``i`` is slot ``slots[i]``'s first ``froms[i]`` tail rows, then
    new rows ``toks[i], toks[i] + 1, ...`` up to the block's end. Returns whether every value is finite.

    Args:
        tail: ``[capacity, H, T, D]`` float32 tail rows; new: ``[N, H, D]`` float32 the step's rows.
        slots, froms, toks: ``[K]`` int64. out: ``[K, H, T, D]`` float32, written.
    """
    nk, h, t, d = out.shape
    for i in range(nk):
        s, f, k0 = slots[i], froms[i], toks[i]
        for a in range(h):
            for b in range(f):
                for c in range(d):
                    out[i, a, b, c] = tail[s, a, b, c]
            for b in range(f, t):
                for c in range(d):
                    out[i, a, b, c] = new[k0 + b - f, a, c]
    return _finite(out)


@njit(cache=True, nogil=True)
def seal_int(x, hs, ts, cs, bits, asym, qmin, qmax, f16, ids, data_out, scale_out, zero_out):
    """Quantize and pack ``K`` blocks into their pages; returns 1 (nothing written) if ``x`` holds a NaN/inf.

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
    if not _finite(x):
        return 1
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
    srow = np.empty(d, np.float32)  # the scale and zero-point of each channel of the current row
    zrow = np.zeros(d, np.float32)
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
        lo_bits, s_bits = lo.view(np.uint32), sv.view(np.uint32)  # the values' bit patterns, for _encode_f16
        for g in range(ng):
            if asym:
                zh = _encode_f16(lo[g], lo_bits[g], f16, False)
                z = f16[zh]
                sv[g] = np.float32(np.float32(hi[g] - z) / fmax)
                zc[g] = zh
                zf[g] = z
            else:
                sv[g] = np.float32(hi[g] / fmax)
            if not sv[g] > 0:
                sv[g] = one
        for g in range(ng):
            shh = _encode_f16(sv[g], s_bits[g], f16, True)
            sc[g] = shh
            sf[g] = f16[shh]
        row = ids[i]
        last = -1
        for a in range(h):
            for b in range(t):
                gb = ((a // gh) * ts + b // gt) * cs
                if gb != last:  # the row's scales, one per channel
                    for cc in range(cs):
                        for c in range(cc * gc, cc * gc + gc):
                            srow[c] = sf[gb + cc]
                            zrow[c] = zf[gb + cc]
                    last = gb
                for c in range(d):
                    v = x[i, a, b, c]
                    if asym:
                        v = np.float32(v - zrow[c])
                    q = np.rint(np.float32(v / srow[c]))
                    q = min(max(q, fmin), fmax)
                    codes[c] = np.int32(q)
                base = (a * t + b) * packed
                if bits == 8:
                    for c in range(d):
                        data_out[row, base + c] = np.uint8(codes[c] & 0xFF)
                elif bits == 4:
                    for j in range(packed):
                        lo4 = (codes[2 * j] + off) & mask
                        hi4 = (codes[2 * j + 1] + off) & mask
                        data_out[row, base + j] = np.uint8(lo4 | (hi4 << 4))
                else:
                    for j in range(packed):
                        byte = 0
                        for e in range(per):
                            byte |= ((codes[j * per + e] + off) & mask) << (e * bits)
                        data_out[row, base + j] = np.uint8(byte)
        for g in range(ng):
            scale_out[row, 2 * g] = np.uint8(sc[g] & 0xFF)
            scale_out[row, 2 * g + 1] = np.uint8(sc[g] >> 8)
            if asym:
                zero_out[row, 2 * g] = np.uint8(zc[g] & 0xFF)
                zero_out[row, 2 * g + 1] = np.uint8(zc[g] >> 8)
    return 0
