"""The compiled seal of integer formats: a full block's keys or values quantized and packed in one call.

:func:`kvpack.quant.quantize` does the same in ~40 small torch operations per spec, which on the CPU costs
~0.4 ms per call whatever the block's size: paid per layer and step in the vLLM backend, where a block seals
at whichever step fills it. :func:`seal_int` gives the very same bytes (scales and zero-points rounded to
float16 as :func:`kvpack.quant.encode_scale` rounds them, codes rounded half to even, the same packing), and
writes them straight into the rows of the destination blocks. Imported only through
:mod:`kvpack.kernels.cpu_seal`; numba's disk cache tracks this file alone.
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
def _encode_f16(v, f16, round_up):
    """:func:`kvpack.quant.encode_scale` to float16 of one float32 value ``v`` (``f16``: float16 bits ->
    float32 table): rounded to nearest, then one step in ``round_up``'s direction if that passed ``v``, kept
    normal when rounding up a positive value, saturated to +-65504."""
    tmp = np.empty(1, np.float32)
    tmp[0] = v
    h = _f32_to_f16_bits(np.int64(tmp.view(np.uint32)[0]))
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
    nk, h, t, d = x.shape
    for i in range(nk):
        for a in range(h):
            for b in range(t):
                for c in range(d):
                    v = x[i, a, b, c]
                    if not np.isfinite(v):
                        return 1
    gh, gt, gc = h // hs, t // ts, d // cs
    per = 8 // bits
    packed = (d + per - 1) // per
    ng = hs * ts * cs
    sc = np.empty(ng, np.uint16)
    zc = np.empty(ng, np.uint16)
    sf = np.empty(ng, np.float32)
    zf = np.zeros(ng, np.float32)
    codes = np.zeros(d + per, np.int64)
    one = np.float32(1.0)
    for i in range(nk):
        for g in range(ng):
            ga = g // (ts * cs)
            gb = (g // cs) % ts
            gcc = g % cs
            lo = np.float32(np.inf)
            hi = np.float32(-np.inf)
            for a in range(ga * gh, ga * gh + gh):
                for b in range(gb * gt, gb * gt + gt):
                    for c in range(gcc * gc, gcc * gc + gc):
                        v = x[i, a, b, c]
                        if asym:
                            lo = min(lo, v)
                            hi = max(hi, v)
                        else:
                            hi = max(hi, abs(v))
            if asym:
                zh = _encode_f16(lo, f16, False)
                z = f16[zh]
                s = np.float32(np.float32(hi - z) / np.float32(qmax))
                zc[g] = zh
                zf[g] = z
            else:
                s = np.float32(hi / np.float32(qmax))
            if not s > 0:
                s = one
            shh = _encode_f16(s, f16, True)
            sc[g] = shh
            sf[g] = f16[shh]
        row = ids[i]
        for a in range(h):
            for b in range(t):
                for c in range(d):
                    g = ((a // gh) * ts + b // gt) * cs + c // gc
                    v = x[i, a, b, c]
                    if asym:
                        v = np.float32(v - zf[g])
                    q = np.rint(np.float32(v / sf[g]))
                    q = min(max(q, np.float32(qmin)), np.float32(qmax))
                    codes[c] = np.int64(q)
                base = (a * t + b) * packed
                if bits == 8:
                    for c in range(d):
                        data_out[row, base + c] = np.uint8(codes[c] & 0xFF)
                else:
                    off = 0 if asym else 1 << (bits - 1)
                    for c in range(d, d + per):
                        codes[c] = -off  # padding of a ragged last byte packs as zero
                    for j in range(packed):
                        byte = 0
                        for e in range(per):
                            byte |= ((codes[j * per + e] + off) & ((1 << bits) - 1)) << (e * bits)
                        data_out[row, base + j] = np.uint8(byte)
        for g in range(ng):
            scale_out[row, 2 * g] = np.uint8(sc[g] & 0xFF)
            scale_out[row, 2 * g + 1] = np.uint8(sc[g] >> 8)
            if asym:
                zero_out[row, 2 * g] = np.uint8(zc[g] & 0xFF)
                zero_out[row, 2 * g + 1] = np.uint8(zc[g] >> 8)
    return 0
