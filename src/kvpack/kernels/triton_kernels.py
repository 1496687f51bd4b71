"""Triton code only: the paged decode kernel, its split merge, and the seal (write-path) kernel.

Launchers live in :mod:`kvpack.kernels.triton_decode` and :mod:`kvpack.kernels.triton_seal`; they check
shapes and turn a :class:`~kvpack.formats.QuantSpec` into the compile-time constants used here, the codes of
:func:`kvpack.kernels.lowering.lower` (written here as the literals Triton compares):

* ``KIND`` (:class:`~kvpack.kernels.lowering.TritonKind`): 0 float passthrough, 1 symmetric int (offset binary
  below 8 bits), 2 asymmetric int (unsigned codes plus a float zero), 3 fp8, 4 fp8 plus a zero-point.
* ``SCALE`` (:class:`~kvpack.kernels.lowering.TritonScale`): 0 none, 1 one scalar per block and head (tensor /
  head), 2 per channel, 3 per token, 4 per token and channel group. Scale arrays are indexed ``[block, head, token, channel // CGROUP]`` with
  stride 0 on the axes the granularity shares.
* ``SDT`` / ``ZDT`` (the seal kernel; :class:`~kvpack.kernels.lowering.ScaleKind`): how a scale / zero-point is
  stored, 1 fp32, 2 fp16, 3 bf16, 4 E8M0.
* ``PER``: elements per payload byte (1, or 2 for int4, 4 for int2). A packed tile is never interleaved
  in registers: part ``j`` of a tile holds channels ``c = i * PER + j``, and the query and the output
  accumulators are split the same way, so the dot products run on contiguous bytes.
* ``K_DP`` / ``V_DP``: columns of a part's tiles, ``HEAD_DIM // PER`` rounded up to a power of two of at
  least 16 (a dot operand's minimum). Where that pads (head_dim 80, 96, 112; int4 at 16), every load of a
  payload, scale, zero, query or full-precision row masks the padding columns (they read 0, so they add
  nothing to a score) and no store writes them; where it does not, no mask is compiled.
* ``HAS_SINK`` / ``BLOCK_SINK``: full-precision sink rows (``PagedKV.sink_k``; ``BLOCK_SINK`` a power of two
  >= 16 covering ``S``) replace the first ``min(S, n_sealed)`` sealed rows; without a sink none of it compiles.

This module imports triton at module level; import it only after ``TRITON_INTERPRET`` is settled.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Kernels defined while TRITON_INTERPRET=1 run on CPU tensors through the interpreter, never on a GPU.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------
# Shared helpers


@triton.jit
def _decode_scale(stored, E8M0: tl.constexpr):
    """Stored scale or zero -> float32; E8M0 exponents e -> 2**(e - 127), built from the bits (exact)."""
    if E8M0:
        return (stored.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        return stored.to(tl.float32)


@triton.jit
def _kept_residuals(r_base, offs_t, s_rt, offs_o, o_mask, idx, s_base, s_sc, REFINED: tl.constexpr,
                    E8M0: tl.constexpr):  # fmt: skip
    """The residuals ``[BLOCK_SIZE, BLOCK_O]`` float32 of a block's kept key channels ``idx`` (0 past ``o_mask``):
    fp16 rows ``r_base + t * s_rt + j``, or, ``REFINED``, 4-bit codes ``u`` (channel ``j`` in byte ``j // 2``, low
    nibble first) standing for ``(u - 7.5) * s[idx_j] / 16`` with the block's per-channel key scales ``s``
    (``s_base + c * s_sc``)."""
    if REFINED:
        byte = tl.load(r_base + offs_t[:, None] * s_rt + (offs_o // 2)[None, :], mask=o_mask[None, :], other=0)
        u = (byte.to(tl.int32) >> ((offs_o % 2) * 4)[None, :]) & 15
        step = _decode_scale(tl.load(s_base + idx * s_sc, mask=o_mask, other=0), E8M0)
        return (u.to(tl.float32) - 7.5) * (step * 0.0625)[None, :]
    else:
        r = tl.load(r_base + offs_t[:, None] * s_rt + offs_o[None, :], mask=o_mask[None, :], other=0.0)
        return r.to(tl.float32)


@triton.jit
def _chan_load(ptrs, offs_c, NC: tl.constexpr, DP: tl.constexpr, PER: tl.constexpr):
    """Load ``ptrs`` (``[DP]`` or ``[R, DP]``, the last axis over one part's columns, channels ``offs_c``):
    all of it when the part has no padding columns (``NC == DP``), else only real channels (padding reads 0)."""
    if NC == DP:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_c < NC * PER, other=0.0)
    return x


@triton.jit
def _store_cols(ptrs, x, offs_p, rmask, NC: tl.constexpr, DP: tl.constexpr):
    """Store a ``[R, DP]`` tile at rows ``rmask`` (``[R]``), leaving the padding columns past ``NC`` unwritten."""
    if NC == DP:
        tl.store(ptrs, x, mask=rmask[:, None])
    else:
        tl.store(ptrs, x, mask=rmask[:, None] & (offs_p < NC)[None, :])


@triton.jit
def _codes(raw, J: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, CVT: tl.constexpr):
    """Part ``J`` of a loaded payload tile: integer codes (signed when symmetric) or values.

    ``CVT`` picks how codes become numbers: 0 float32 through the converter (``I2F``, a quarter-rate
    instruction on NVIDIA GPUs; fp8 through Triton's conversion), 1 float16 built from the bits in Triton
    (fp8 as 0), 2 inline PTX for integer codes and fp8 (NVIDIA GPUs only), converting in the load's register
    layout (see ``_ptx4``). Integer codes are small integers and fp8 values are float16 values: float16 holds
    both exactly.
    """
    if (KIND == 1 or KIND == 2) and CVT == 2:
        c = _codes_ptx(raw, J, KIND, BITS)
    elif (KIND == 3 or KIND == 4) and CVT == 2:
        c = _fp8_ptx(raw)
    elif (KIND == 1 or KIND == 2) and CVT >= 1:
        c = _codes_bits(raw, J, KIND, BITS)
    elif KIND == 1 or KIND == 2:
        if BITS == 8:
            c = raw.to(tl.float32)
        else:
            c = ((raw >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            if KIND == 1:
                c = c - (1 << (BITS - 1))  # offset binary
    else:
        c = raw.to(tl.float32)
    return c


# Integer codes to float16 from the bits: the float16 whose bits are 0x6400 | u is 1024 + u for 0 <= u < 1024,
# so a code u (or u << shift) OR-ed under that exponent and one float16 subtract (or fused multiply-add)
# gives the code exactly, with no conversion instruction. In PTX, four payload bytes at a time:
# ``prmt`` spreads two bytes into the low bytes of two float16 halves, ``and``/``or`` keep the code's bits and
# set the exponent (one ``lop3``), and ``fma.rn.f16x2`` scales by 2**-shift and removes 1024 and the offset.


def _f16x2(x: float) -> str:
    """``x`` as a float16 pair in one 32-bit immediate (exact for the constants used here)."""
    import struct

    (h,) = struct.unpack("<H", struct.pack("<e", x))
    assert struct.unpack("<e", struct.pack("<H", h))[0] == x, x
    return f"0x{h:04x}{h:04x}"


def _codes_asm(bits: int, j: int, signed: bool) -> str:
    """PTX for part ``j`` of four packed payload bytes ``$2`` -> four float16 codes in ``$0`` (codes 0, 1) and
    ``$1`` (codes 2, 3). Symmetric codes: int8 two's complement, narrower offset binary."""
    lines = ["{", ".reg .b32 t0, t1, m, a;"]
    if bits == 8:  # the whole byte is the code: prmt takes the exponent byte 0x64 from m, no masking
        shift, off = 0, 128 if signed else 0
        lines += ["xor.b32 t1, $2, 0x80808080;" if signed else "mov.b32 t1, $2;"]  # int8 -> offset binary
        lines += ["mov.b32 m, 0x64646464;", "prmt.b32 t0, t1, m, 0x4140;", "prmt.b32 t1, t1, m, 0x4342;"]
    else:
        shift, off = j * bits, (1 << (bits - 1)) if signed else 0
        mask = (((1 << bits) - 1) << shift) * 0x10001
        lines += [
            "mov.b32 m, 0;",
            "prmt.b32 t0, $2, m, 0x4140;",  # bytes 0, 1 -> the low bytes of the two halves
            "prmt.b32 t1, $2, m, 0x4342;",  # bytes 2, 3
            f"and.b32 t0, t0, 0x{mask:08x};",
            f"and.b32 t1, t1, 0x{mask:08x};",
            "or.b32 t0, t0, 0x64006400;",
            "or.b32 t1, t1, 0x64006400;",
        ]
    lines += [
        f"mov.b32 m, {_f16x2(2.0**-shift)};",
        f"mov.b32 a, {_f16x2(-(1024.0 * 2.0**-shift + off))};",
        "fma.rn.f16x2 $0, t0, m, a;",
        "fma.rn.f16x2 $1, t1, m, a;",
        "}",
    ]
    return "\n".join(lines)


_PTX_8S = tl.constexpr(_codes_asm(8, 0, True))
_PTX_8U = tl.constexpr(_codes_asm(8, 0, False))
_PTX_4S0 = tl.constexpr(_codes_asm(4, 0, True))
_PTX_4S1 = tl.constexpr(_codes_asm(4, 1, True))
_PTX_4U0 = tl.constexpr(_codes_asm(4, 0, False))
_PTX_4U1 = tl.constexpr(_codes_asm(4, 1, False))
_PTX_2S0 = tl.constexpr(_codes_asm(2, 0, True))
_PTX_2S1 = tl.constexpr(_codes_asm(2, 1, True))
_PTX_2S2 = tl.constexpr(_codes_asm(2, 2, True))
_PTX_2S3 = tl.constexpr(_codes_asm(2, 3, True))
_PTX_2U0 = tl.constexpr(_codes_asm(2, 0, False))
_PTX_2U1 = tl.constexpr(_codes_asm(2, 1, False))
_PTX_2U2 = tl.constexpr(_codes_asm(2, 2, False))
_PTX_2U3 = tl.constexpr(_codes_asm(2, 3, False))


@triton.jit
def _ptx4(asm: tl.constexpr, raw):
    """Four payload bytes per asm -> float16. Not marked pure on purpose: Triton then keeps the conversion in
    the load's register layout (contiguous bytes per thread) instead of moving it after the change to the dot
    operand layout, where 8-bit elements are gathered byte by byte from shared memory (on sm_90: 64
    ``LDS.U8`` per thread and block, 679 instructions in the block loop against 525, 167 registers against 128)."""
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)


_PTX_E4M3 = tl.constexpr(
    "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}"
)
_PTX_E5M2 = tl.constexpr(
    "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e5m2x2 $0, lo;\ncvt.rn.f16x2.e5m2x2 $1, hi;\n}"
)


@triton.jit
def _fp8_ptx(raw):
    """fp8 payload -> float16 (exact: e4m3 and e5m2 values are all float16 values), four bytes per asm, in the
    load's register layout (see ``_ptx4``)."""
    if raw.dtype.is_fp8e5():
        c = _ptx4(_PTX_E5M2, raw)
    else:
        c = _ptx4(_PTX_E4M3, raw)
    return c


@triton.jit
def _ptx_by_kind(signed: tl.constexpr, unsigned: tl.constexpr, KIND: tl.constexpr, raw):
    """The symmetric (``KIND`` 1) or asymmetric form of one conversion."""
    if KIND == 1:
        c = _ptx4(signed, raw)
    else:
        c = _ptx4(unsigned, raw)
    return c


@triton.jit
def _codes_ptx(raw, J: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr):
    """Integer codes of part ``J`` as float16, from the bits in inline PTX (see ``_codes_asm``)."""
    if BITS == 8:
        c = _ptx_by_kind(_PTX_8S, _PTX_8U, KIND, raw)
    elif BITS == 4:
        if J == 0:
            c = _ptx_by_kind(_PTX_4S0, _PTX_4U0, KIND, raw)
        else:
            c = _ptx_by_kind(_PTX_4S1, _PTX_4U1, KIND, raw)
    elif J == 0:
        c = _ptx_by_kind(_PTX_2S0, _PTX_2U0, KIND, raw)
    elif J == 1:
        c = _ptx_by_kind(_PTX_2S1, _PTX_2U1, KIND, raw)
    elif J == 2:
        c = _ptx_by_kind(_PTX_2S2, _PTX_2U2, KIND, raw)
    else:
        c = _ptx_by_kind(_PTX_2S3, _PTX_2U3, KIND, raw)
    return c


@triton.jit
def _codes_bits(raw, J: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr):
    """Integer codes of part ``J`` as float16, from the bits in Triton (the same arithmetic as the PTX)."""
    u = raw.to(tl.uint8, bitcast=True).to(tl.int32)
    if BITS == 8:
        if KIND == 1:
            u = u ^ 0x80  # two's complement -> offset binary
    else:
        u = (u >> (J * BITS)) & ((1 << BITS) - 1)
    h = (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + u
    if KIND == 1:
        c = h - (1024.0 + (1 << (BITS - 1)))
    else:
        c = h - 1024.0
    return c


# ----------------------------------------------------------------------------------------------------
# Decode: one program = one sequence, one kv head (all its query heads), one split of the blocks.


@triton.jit
def _group_params(base, offs_t, offs_c, st, sc, E8M0: tl.constexpr, BLOCK_SIZE: tl.constexpr, DP: tl.constexpr,
                  PER: tl.constexpr, CGROUP: tl.constexpr, NC: tl.constexpr, STORED: tl.constexpr = False):  # fmt: skip
    """Per-(token, channel group) scales or zeros of one part as a float32 ``[BLOCK_SIZE, DP]`` tile (in the
    stored dtype with ``STORED``: float16 scales stay float16).

    When a group spans whole payload bytes (``CGROUP % PER == 0``), the columns of a part fall into groups in
    runs of ``CGROUP // PER``: load the small contiguous ``[BLOCK_SIZE, groups]`` array once and broadcast it
    in registers instead of gathering one element per column (not with padding columns: ``NC < DP``).
    """
    if CGROUP % PER == 0 and NC == DP:
        CS: tl.constexpr = DP * PER // CGROUP
        small = tl.load(base + offs_t[:, None] * st + tl.arange(0, CS)[None, :] * sc)
        if not STORED:
            small = _decode_scale(small, E8M0)
        return tl.reshape(tl.broadcast_to(small[:, :, None], [BLOCK_SIZE, CS, CGROUP // PER]), [BLOCK_SIZE, DP])
    else:
        params = _chan_load(base + offs_t[:, None] * st + (offs_c // CGROUP)[None, :] * sc, offs_c, NC, DP, PER)
        if not STORED:
            params = _decode_scale(params, E8M0)
        return params


@triton.jit
def _key_scores(
    q,  # [BLOCK_G, DP] float32 query part (already times sm_scale * log2(e))
    qd,  # the same in the dot dtype
    raw,  # [BLOCK_SIZE, DP] payload tile (bytes for packed formats)
    s_base,
    z_base,  # scale / zero pointers of this block and head
    offs_t,  # [BLOCK_SIZE] token index in the block
    offs_c,  # [DP] logical channels of part J
    s_st,
    s_sc,
    z_st,
    z_sc,
    J: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    SCALE: tl.constexpr,
    CGROUP: tl.constexpr,
    E8M0: tl.constexpr,
    GF16: tl.constexpr,
    CVT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DP: tl.constexpr,
    PER: tl.constexpr,
    NC: tl.constexpr,  # real columns of the part (DP pads them to a power of two)
):
    """Scores ``[BLOCK_G, BLOCK_SIZE]`` (log2 units) contributed by the channels of part ``J``.

    Per-channel and scalar key scales are folded into the query; per-token scales multiply the scores;
    asymmetric zeros add ``sum(q * z)``; only per-group scales dequantize the tile in registers.
    """
    c = _codes(raw, J, KIND, BITS, CVT)
    if SCALE == 0:
        sc = tl.dot(qd, tl.trans(c.to(DOT)))
    elif SCALE == 1:
        s = _decode_scale(tl.load(s_base), E8M0)
        sc = tl.dot(qd, tl.trans(c.to(DOT))) * s
        if KIND == 2 or KIND == 4:
            z = tl.load(z_base).to(tl.float32)
            sc += z * tl.sum(q, axis=1)[:, None]
    elif SCALE == 2:
        s = _decode_scale(_chan_load(s_base + (offs_c // CGROUP) * s_sc, offs_c, NC, DP, PER), E8M0)  # [DP]
        sc = tl.dot((q * s[None, :]).to(DOT), tl.trans(c.to(DOT)))
        if (KIND == 2 or KIND == 4) and not GF16:  # with GF16 the caller adds the zero-points of all parts (_key_zeros)
            z = _chan_load(z_base + (offs_c // CGROUP) * z_sc, offs_c, NC, DP, PER).to(tl.float32)
            sc += tl.sum(q * z[None, :], axis=1)[:, None]
    elif SCALE == 3:
        s = _decode_scale(tl.load(s_base + offs_t * s_st), E8M0)  # [BLOCK_SIZE]
        sc = tl.dot(qd, tl.trans(c.to(DOT))) * s[None, :]
        if KIND == 2 or KIND == 4:
            z = tl.load(z_base + offs_t * z_st).to(tl.float32)
            sc += tl.sum(q, axis=1)[:, None] * z[None, :]
    else:  # per group: dequantize the tile (in float16 when the codes and the stored scales are float16)
        k = c * _group_params(s_base, offs_t, offs_c, s_st, s_sc, E8M0, BLOCK_SIZE, DP, PER, CGROUP, NC, GF16)
        if KIND == 2 or KIND == 4:
            k += _group_params(z_base, offs_t, offs_c, z_st, z_sc, False, BLOCK_SIZE, DP, PER, CGROUP, NC, GF16)
        sc = tl.dot(qd, tl.trans(k.to(DOT)))
    return sc


@triton.jit
def _zeros_of(z_base, offs_c, z_sc, CGROUP: tl.constexpr, NC: tl.constexpr, DP: tl.constexpr, PER: tl.constexpr):
    """Float32 zero-points ``[DP]`` of channels ``offs_c`` (padding columns read 0)."""
    return _chan_load(z_base + (offs_c // CGROUP) * z_sc, offs_c, NC, DP, PER).to(tl.float32)


@triton.jit
def _key_zeros(s, q0, q1, q2, q3, z_base, offs_p, z_sc, CGROUP: tl.constexpr, PER: tl.constexpr,
               CD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DP: tl.constexpr, NC: tl.constexpr):  # fmt: skip
    """``s + sum_c q[:, c] * z[c]`` on every token of the block: per-channel zero-points of asymmetric keys.

    The parts' products are summed in float32 and multiplied by a ones tile on the tensor cores, which
    broadcasts the row sums over the tokens: no cross-thread reduction (on sm_90 the per-part ``tl.sum`` of
    ``q * z`` took int4 118 of its 773 block-loop instructions, kivi2 124 of 794).
    """
    qz = q0 * _zeros_of(z_base, offs_p * PER, z_sc, CGROUP, NC, DP, PER)[None, :]
    if PER >= 2:
        qz += q1 * _zeros_of(z_base, offs_p * PER + 1, z_sc, CGROUP, NC, DP, PER)[None, :]
    if PER >= 4:
        qz += q2 * _zeros_of(z_base, offs_p * PER + 2, z_sc, CGROUP, NC, DP, PER)[None, :]
        qz += q3 * _zeros_of(z_base, offs_p * PER + 3, z_sc, CGROUP, NC, DP, PER)[None, :]
    return tl.dot(qz.to(CD), tl.full([DP, BLOCK_SIZE], 1.0, CD), s)


@triton.jit
def _value_part(
    p,  # [BLOCK_G, BLOCK_SIZE] float32 probabilities (unnormalized)
    pd,  # the same in the dot dtype
    raw,  # [BLOCK_SIZE, DP] payload tile
    s_base,
    z_base,
    offs_t,
    offs_c,
    s_st,
    s_sc,
    z_st,
    z_sc,
    J: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    SCALE: tl.constexpr,
    CGROUP: tl.constexpr,
    E8M0: tl.constexpr,
    GF16: tl.constexpr,
    CVT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DP: tl.constexpr,
    PER: tl.constexpr,
    NC: tl.constexpr,  # real columns of the part (DP pads them to a power of two)
):
    """``p @ V`` for the channels of part ``J``: ``[BLOCK_G, DP]`` float32.

    Per-token value scales are folded into ``p``; scalar and per-channel scales multiply the result;
    zeros add ``sum(p * z)``; per-group scales dequantize the tile in registers.
    """
    c = _codes(raw, J, KIND, BITS, CVT)
    if SCALE == 0:
        o = tl.dot(pd, c.to(DOT))
    elif SCALE == 1:
        s = _decode_scale(tl.load(s_base), E8M0)
        o = tl.dot(pd, c.to(DOT)) * s
        if KIND == 2 or KIND == 4:
            z = tl.load(z_base).to(tl.float32)
            o += z * tl.sum(p, axis=1)[:, None]
    elif SCALE == 2:
        s = _decode_scale(_chan_load(s_base + (offs_c // CGROUP) * s_sc, offs_c, NC, DP, PER), E8M0)  # [DP]
        o = tl.dot(pd, c.to(DOT)) * s[None, :]
        if KIND == 2 or KIND == 4:
            z = _chan_load(z_base + (offs_c // CGROUP) * z_sc, offs_c, NC, DP, PER).to(tl.float32)
            o += tl.sum(p, axis=1)[:, None] * z[None, :]
    elif SCALE == 3:
        s = _decode_scale(tl.load(s_base + offs_t * s_st), E8M0)  # [BLOCK_SIZE]
        o = tl.dot((p * s[None, :]).to(DOT), c.to(DOT))
        if KIND == 2 or KIND == 4:
            z = tl.load(z_base + offs_t * z_st).to(tl.float32)
            o += tl.sum(p * z[None, :], axis=1)[:, None]
    else:  # per group: dequantize the tile (in float16 when the codes and the stored scales are float16)
        v = c * _group_params(s_base, offs_t, offs_c, s_st, s_sc, E8M0, BLOCK_SIZE, DP, PER, CGROUP, NC, GF16)
        if KIND == 2 or KIND == 4:
            v += _group_params(z_base, offs_t, offs_c, z_st, z_sc, False, BLOCK_SIZE, DP, PER, CGROUP, NC, GF16)
        o = tl.dot(pd, v.to(DOT))
    return o


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2: new running max, the rescale factor of the old sums, probabilities."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing attended yet stays at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_new, alpha, p


@triton.jit
def _tail_part(rows, offs_p, t_mask, J: tl.constexpr, PER: tl.constexpr, DOT: tl.constexpr, NC: tl.constexpr,
               DP: tl.constexpr):  # fmt: skip
    """Channels ``i * PER + J`` of the used full-precision rows ``[R, DP]`` in the dot dtype (unused rows and
    padding columns are not loaded: they read as 0)."""
    if NC == DP:
        x = tl.load(rows + (offs_p * PER + J)[None, :], mask=t_mask, other=0.0)
    else:
        x = tl.load(rows + (offs_p * PER + J)[None, :], mask=t_mask & (offs_p < NC)[None, :], other=0.0)
    return x.to(DOT)


@triton.jit
def _attend_rows(
    kr,  # [R, 1] pointers to full-precision key rows (the tail, or the sink)
    vr,  # [R, 1] pointers to the value rows
    offs_pk,
    offs_pv,
    load,  # [R, 1] rows to load (others are never read)
    valid,  # [R] rows attended (loaded and inside the start_pos / window range)
    qd0, qd1, qd2, qd3, m_i, l_i, acc0, acc1, acc2, acc3,
    K_PER: tl.constexpr, V_PER: tl.constexpr, DOT: tl.constexpr,
    DK: tl.constexpr, K_DP: tl.constexpr, DV: tl.constexpr, V_DP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over ``R`` full-precision rows, split into parts like the payload."""
    s = tl.dot(qd0, tl.trans(_tail_part(kr, offs_pk, load, 0, K_PER, DOT, DK, K_DP)))
    if K_PER >= 2:
        s += tl.dot(qd1, tl.trans(_tail_part(kr, offs_pk, load, 1, K_PER, DOT, DK, K_DP)))
    if K_PER >= 4:
        s += tl.dot(qd2, tl.trans(_tail_part(kr, offs_pk, load, 2, K_PER, DOT, DK, K_DP)))
        s += tl.dot(qd3, tl.trans(_tail_part(kr, offs_pk, load, 3, K_PER, DOT, DK, K_DP)))
    s = tl.where(valid[None, :], s, float("-inf"))
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
def paged_decode_kernel(
    q_ptr, sq_b, sq_h,  # q [batch, Hq, D]
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
    o_ptr, so_b, so_h,  # out [batch, Hq, D] (written here when not SPLIT)
    acc_ptr, sacc_b, sacc_h, sacc_s,  # partial sums [batch, Hq, splits, D] float32
    ml_ptr, sml_b, sml_h, sml_s,  # partial (max, sum) [batch, Hq, splits, 2] float32
    qk_scale, window, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, HAS_START: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINK: tl.constexpr, BLOCK_SINK: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, K_SCALE: tl.constexpr,
    K_CGROUP: tl.constexpr, K_E8M0: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr, V_SCALE: tl.constexpr,
    V_CGROUP: tl.constexpr, V_E8M0: tl.constexpr,
    N_OUT: tl.constexpr, BLOCK_O: tl.constexpr, REFINED: tl.constexpr, K_DP: tl.constexpr, V_DP: tl.constexpr,
    DOT: tl.constexpr, CVT: tl.constexpr, K_CD: tl.constexpr, V_CD: tl.constexpr,
    K_GF16: tl.constexpr, V_GF16: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    DK: tl.constexpr = HEAD_DIM // K_PER  # real columns of a key part; K_DP of them are loaded (padding reads 0)
    DV: tl.constexpr = HEAD_DIM // V_PER

    seq_len = tl.load(seq_ptr + pid_b)
    n_sealed = seq_len // BLOCK_SIZE
    lo = seq_len * 0  # first attended position
    if HAS_START:
        lo = tl.maximum(lo, tl.load(start_ptr + pid_b))
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)  # the query sits at seq_len - 1
    lo_sealed = lo  # first position read from a sealed block
    if HAS_SINK:  # sealed rows of sink positions are replaced by the sink's full-precision rows
        n_sink = tl.minimum(sink_len, n_sealed * BLOCK_SIZE)
        lo_sealed = tl.maximum(lo, n_sink)
    first = lo_sealed // BLOCK_SIZE  # blocks before it are never read (they may be released: id 0)
    per_split = (tl.maximum(n_sealed - first, 0) + num_splits - 1) // num_splits
    blk_lo = first + pid_s * per_split
    blk_hi = tl.minimum(blk_lo + per_split, n_sealed)

    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_pk = tl.arange(0, K_DP)  # payload byte (or element) index of a key row
    offs_pv = tl.arange(0, V_DP)
    g_mask = offs_g < GROUP
    q_mask = g_mask[:, None] & (offs_pk < DK)[None, :]
    heads = pid_h * GROUP + offs_g

    # The query of the kv head's GROUP query heads, split like the key payload: part j holds c = i*K_PER + j.
    q_rows = q_ptr + pid_b * sq_b + heads[:, None] * sq_h
    q0 = tl.load(q_rows + (offs_pk * K_PER)[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q1 = q0
    q2 = q0
    q3 = q0
    if K_PER >= 2:
        q1 = tl.load(q_rows + (offs_pk * K_PER + 1)[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q1 = q1 * qk_scale
    if K_PER >= 4:
        q2 = tl.load(q_rows + (offs_pk * K_PER + 2)[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q3 = tl.load(q_rows + (offs_pk * K_PER + 3)[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q2 = q2 * qk_scale
        q3 = q3 * qk_scale
    # Sealed keys multiply in K_CD (float16 when integer codes are built as float16, else the query's dtype);
    # the full-precision sink and tail rows in the query's dtype.
    qd0 = q0.to(K_CD)
    qd1 = q1.to(K_CD)
    qd2 = q2.to(K_CD)
    qd3 = q3.to(K_CD)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc0 = tl.zeros([BLOCK_G, V_DP], tl.float32)
    acc1 = tl.zeros([BLOCK_G, V_DP], tl.float32)
    acc2 = tl.zeros([BLOCK_G, V_DP], tl.float32)
    acc3 = tl.zeros([BLOCK_G, V_DP], tl.float32)

    # ---- the full-precision sink rows (positions [0, n_sink)), attended first by the first split: before the
    # block loop nothing else is live (attended after the loop, fp8-o4 took 142-158 registers on sm_90, not 128)
    if HAS_SINK:
        if pid_s == 0:
            offs_r = tl.arange(0, BLOCK_SINK)
            valid = (offs_r < n_sink) & (offs_r >= lo)  # sink slot r holds position r
            kr = sk_ptr + pid_b * ssk_b + pid_h * ssk_h + offs_r[:, None] * ssk_t
            vr = sv_ptr + pid_b * ssv_b + pid_h * ssv_h + offs_r[:, None] * ssv_t
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_rows(
                kr, vr, offs_pk, offs_pv, valid[:, None], valid, q0.to(DOT), q1.to(DOT), q2.to(DOT), q3.to(DOT),
                m_i, l_i,
                acc0, acc1, acc2, acc3, K_PER, V_PER, DOT, DK, K_DP, DV, V_DP)  # fmt: skip

    # fmt: off
    for i in range(blk_lo, blk_hi):
        blk = tl.load(bt_ptr + pid_b * sbt_b + i).to(tl.int64)
        # ---- keys: scores of this block, scales folded where the granularity allows
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
        if N_OUT > 0:  # outlier key channels: + sum_j q[idx_j] * residual[t, j] (the unfolded query)
            offs_o = tl.arange(0, BLOCK_O)
            o_mask = offs_o < N_OUT
            idx = tl.load(ki_ptr + blk * ski_n + pid_h * ski_h + offs_o, mask=o_mask, other=0).to(tl.int32)
            qo = tl.load(q_rows + idx[None, :], mask=g_mask[:, None] & o_mask[None, :], other=0.0)
            r = _kept_residuals(ko_ptr + blk * sko_n + pid_h * sko_h, offs_t, sko_t, offs_o, o_mask, idx, sb, sks_c,
                                REFINED, K_E8M0)
            s += tl.sum((qo.to(tl.float32) * qk_scale)[:, None, :] * r[None, :, :], axis=2)
        s = tl.where((i * BLOCK_SIZE + offs_t >= lo_sealed)[None, :], s, float("-inf"))
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

    # ---- the full-precision tail, attended last by the last split
    if pid_s == num_splits - 1:
        n_tail = seq_len - n_sealed * BLOCK_SIZE
        t_mask = (offs_t < n_tail)[:, None]  # never load unused (poisoned) tail slots
        valid = (offs_t < n_tail) & (n_sealed * BLOCK_SIZE + offs_t >= lo)
        tk = tk_ptr + pid_b * stk_b + pid_h * stk_h + offs_t[:, None] * stk_t
        tv = tv_ptr + pid_b * stv_b + pid_h * stv_h + offs_t[:, None] * stv_t
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_rows(
            tk, tv, offs_pk, offs_pv, t_mask, valid, q0.to(DOT), q1.to(DOT), q2.to(DOT), q3.to(DOT), m_i, l_i,
            acc0, acc1, acc2, acc3, K_PER, V_PER, DOT, DK, K_DP, DV, V_DP)  # fmt: skip

    # ---- results: normalized output when there is one split, else the partial sums for the merge
    if not SPLIT:
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # nothing attended -> zeros
        rows = o_ptr + pid_b * so_b + heads[:, None] * so_h
        ety = o_ptr.dtype.element_ty
        _store_cols(rows + (offs_pv * V_PER)[None, :], (acc0 * inv[:, None]).to(ety), offs_pv, g_mask, DV, V_DP)
        if V_PER >= 2:
            _store_cols(rows + (offs_pv * V_PER + 1)[None, :], (acc1 * inv[:, None]).to(ety), offs_pv, g_mask, DV, V_DP)
        if V_PER >= 4:
            _store_cols(rows + (offs_pv * V_PER + 2)[None, :], (acc2 * inv[:, None]).to(ety), offs_pv, g_mask, DV, V_DP)
            _store_cols(rows + (offs_pv * V_PER + 3)[None, :], (acc3 * inv[:, None]).to(ety), offs_pv, g_mask, DV, V_DP)
    else:
        rows = acc_ptr + pid_b * sacc_b + heads[:, None] * sacc_h + pid_s * sacc_s
        _store_cols(rows + (offs_pv * V_PER)[None, :], acc0, offs_pv, g_mask, DV, V_DP)
        if V_PER >= 2:
            _store_cols(rows + (offs_pv * V_PER + 1)[None, :], acc1, offs_pv, g_mask, DV, V_DP)
        if V_PER >= 4:
            _store_cols(rows + (offs_pv * V_PER + 2)[None, :], acc2, offs_pv, g_mask, DV, V_DP)
            _store_cols(rows + (offs_pv * V_PER + 3)[None, :], acc3, offs_pv, g_mask, DV, V_DP)
        ml = ml_ptr + pid_b * sml_b + heads * sml_h + pid_s * sml_s
        tl.store(ml, m_i, mask=g_mask)
        tl.store(ml + 1, l_i, mask=g_mask)


@triton.jit
def merge_splits_kernel(
    acc_ptr, sacc_b, sacc_h, sacc_s,  # [batch, Hq, splits, D] float32
    ml_ptr, sml_b, sml_h, sml_s,  # [batch, Hq, splits, 2] float32: running max (log2 units) and sum
    o_ptr, so_b, so_h,  # out [batch, Hq, D]
    num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of the splits of one (sequence, query head); ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a
    power of two."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    s_mask = offs_s < num_splits
    ml = ml_ptr + pid_b * sml_b + pid_h * sml_h + offs_s * sml_s
    m = tl.load(ml, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ml + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # empty splits (max -inf) weigh 0
    total = tl.sum(l_s * w, axis=0)
    acc = tl.load(
        acc_ptr + pid_b * sacc_b + pid_h * sacc_h + offs_s[:, None] * sacc_s + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(o_ptr + pid_b * so_b + pid_h * so_h + offs_d, o.to(o_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------
# Seal: one program = one block and the heads that share its scale (one head unless per tensor).
# Bit-identical to quant.choose_qparams + quant.quantize: IEEE division (div_rn), half-to-even rounding,
# scales rounded up and zeros rounded down exactly as quant.encode_scale does.


@triton.jit
def _round_half_even(x):
    """torch.round: nearest integer, ties to even (exact for |x| < 2**23)."""
    f = tl.floor(x)
    d = x - f
    half = f * 0.5
    odd = tl.floor(half) != half
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _next16(b, UP: tl.constexpr):
    """Bits (int32 holding a sign-extended 16-bit float) of the next float toward +inf (UP) or -inf."""
    if UP:
        return tl.where(b >= 0, b + 1, tl.where(b == -32768, 1, b - 1))
    else:
        return tl.where(b > 0, b - 1, tl.where(b == 0, -32767, b + 1))


@triton.jit
def _encode(s, SDT: tl.constexpr, UP: tl.constexpr):
    """float32 -> stored scale (UP: rounded toward +inf) or zero (toward -inf); see quant.encode_scale.
    ``SDT``: :class:`kvpack.kernels.lowering.ScaleKind` (1 fp32, 2 fp16, 3 bf16, 4 E8M0)."""
    if SDT == 1:
        return s
    elif SDT == 4:  # E8M0: ceil(log2(s)) + 127, from the bits of s clamped to [2**-126, 2**127]
        c = tl.minimum(tl.maximum(s, 1.1754943508222875e-38), 1.7014118346046923e38)
        bits = c.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + 1 - ((bits & 0x7FFFFF) == 0).to(tl.int32)
        return tl.minimum(tl.maximum(e, 0), 254).to(tl.uint8)
    else:
        if SDT == 2:
            if UP:
                s = tl.maximum(s, 6.103515625e-05)  # positive scales never round below the smallest normal
            o = s.to(tl.float16)
        else:
            if UP:
                s = tl.maximum(s, 1.1754943508222875e-38)
            o = s.to(tl.bfloat16)
        # Round to nearest, then step once if that went the wrong way: exact directed rounding.
        if UP:
            off = o.to(tl.float32) < s
        else:
            off = o.to(tl.float32) > s
        b = o.to(tl.int16, bitcast=True).to(tl.int32)
        b = tl.where(off, _next16(b, UP), b).to(tl.int16)
        if SDT == 2:
            return b.to(tl.float16, bitcast=True)
        else:
            return b.to(tl.bfloat16, bitcast=True)


@triton.jit
def _reduce(x, IS_MAX: tl.constexpr, SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr, CS: tl.constexpr,
            CGROUP: tl.constexpr):  # fmt: skip
    """Max or min of a ``[BLOCK_SIZE, D]`` tile over the axes one scale spans: scalar, ``[CS]``,
    ``[BLOCK_SIZE]`` or ``[BLOCK_SIZE, CS]``."""
    if SCALE == 1:
        if IS_MAX:
            r = tl.max(tl.max(x, axis=1), axis=0)
        else:
            r = tl.min(tl.min(x, axis=1), axis=0)
    elif SCALE == 3:
        if IS_MAX:
            r = tl.max(x, axis=1)
        else:
            r = tl.min(x, axis=1)
    else:
        x3 = tl.reshape(x, [BLOCK_SIZE, CS, CGROUP])
        if IS_MAX:
            r = tl.max(x3, axis=2)
        else:
            r = tl.min(x3, axis=2)
        if SCALE == 2:
            if IS_MAX:
                r = tl.max(r, axis=0)
            else:
                r = tl.min(r, axis=0)
    return r


@triton.jit
def _expand(r, SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr,
            CGROUP: tl.constexpr):  # fmt: skip
    """The inverse of ``_reduce``'s shape: something that broadcasts against ``[BLOCK_SIZE, HEAD_DIM]``."""
    if SCALE == 1:
        return r
    elif SCALE == 2:
        return tl.reshape(tl.broadcast_to(r[:, None], [CS, CGROUP]), [HEAD_DIM])[None, :]
    elif SCALE == 3:
        return r[:, None]
    else:
        return tl.reshape(tl.broadcast_to(r[:, :, None], [BLOCK_SIZE, CS, CGROUP]), [BLOCK_SIZE, HEAD_DIM])


@triton.jit
def _store_params(ptr, v, offs_t, st, sc, SCALE: tl.constexpr, CS: tl.constexpr):
    """Store reduced parameters ``v`` at ``ptr`` (this block and head) in the ``[Ts, Cs]`` layout."""
    offs_c = tl.arange(0, CS)
    if SCALE == 1:
        tl.store(ptr, v)
    elif SCALE == 2:
        tl.store(ptr + offs_c * sc, v)
    elif SCALE == 3:
        tl.store(ptr + offs_t * st, v)
    else:
        tl.store(ptr + offs_t[:, None] * st + offs_c[None, :] * sc, v)


@triton.jit
def seal_kernel(
    x_ptr, sx_n, sx_h, sx_t,  # x [n, H, B, D] float, last stride 1
    ids_ptr,  # [n] block ids to write
    d_ptr, sd_n, sd_h, sd_t,  # payload pool [num_blocks, H, B, P]
    s_ptr, ss_n, ss_h, ss_t, ss_c,  # scale pool [num_blocks, Hs, Ts, Cs]
    z_ptr, sz_n, sz_h, sz_t, sz_c,  # zero pool (asymmetric specs only)
    HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, SCALE: tl.constexpr, CS: tl.constexpr,
    CGROUP: tl.constexpr, SDT: tl.constexpr, ZDT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    TOP: tl.constexpr, PAYLOAD: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_h = tl.program_id(1)
    blk = tl.load(ids_ptr + pid_n).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    h0 = pid_h * HEADS
    x_rows = x_ptr + pid_n.to(tl.int64) * sx_n + offs_t[:, None] * sx_t + offs_d[None, :]

    # ---- pass 1: the ranges every scale covers (over all HEADS heads of this program)
    x = tl.load(x_rows + h0 * sx_h).to(tl.float32)
    if KIND == 2 or KIND == 4:
        hi = _reduce(x, True, SCALE, BLOCK_SIZE, CS, CGROUP)
        lo = _reduce(x, False, SCALE, BLOCK_SIZE, CS, CGROUP)
    else:
        hi = _reduce(tl.abs(x), True, SCALE, BLOCK_SIZE, CS, CGROUP)
        lo = hi
    for h in range(1, HEADS):
        x = tl.load(x_rows + (h0 + h) * sx_h).to(tl.float32)
        if KIND == 2 or KIND == 4:
            hi = tl.maximum(hi, _reduce(x, True, SCALE, BLOCK_SIZE, CS, CGROUP))
            lo = tl.minimum(lo, _reduce(x, False, SCALE, BLOCK_SIZE, CS, CGROUP))
        else:
            hi = tl.maximum(hi, _reduce(tl.abs(x), True, SCALE, BLOCK_SIZE, CS, CGROUP))

    # ---- scales (and zeros), stored once, then decoded so the payload uses exactly what is stored
    if KIND == 2:
        z_st = _encode(lo, ZDT, False)
        z = z_st.to(tl.float32)
        s = tl.div_rn(hi - z, tl.full(hi.shape, QMAX, tl.float32))
        _store_params(z_ptr + blk * sz_n + pid_h * sz_h, z_st, offs_t, sz_t, sz_c, SCALE, CS)
    elif KIND == 4:  # fp8 centred on the midpoint of each group's range (quant.choose_qparams)
        z_st = _encode(lo * 0.5 + hi * 0.5, ZDT, False)
        z = z_st.to(tl.float32)
        s = tl.div_rn(tl.maximum(hi - z, z - lo), tl.full(hi.shape, TOP, tl.float32))
        _store_params(z_ptr + blk * sz_n + pid_h * sz_h, z_st, offs_t, sz_t, sz_c, SCALE, CS)
    else:
        z = hi
        s = tl.div_rn(hi, tl.full(hi.shape, TOP, tl.float32))
    s = tl.where(s > 0, s, 1.0)
    s_st = _encode(s, SDT, True)
    _store_params(s_ptr + blk * ss_n + pid_h * ss_h, s_st, offs_t, ss_t, ss_c, SCALE, CS)
    s = _decode_scale(s_st, SDT == 4)
    s_full = tl.broadcast_to(_expand(s, SCALE, BLOCK_SIZE, HEAD_DIM, CS, CGROUP), [BLOCK_SIZE, HEAD_DIM])
    z_full = tl.broadcast_to(_expand(z, SCALE, BLOCK_SIZE, HEAD_DIM, CS, CGROUP), [BLOCK_SIZE, HEAD_DIM])

    # ---- pass 2: quantize, pack, scatter
    DP: tl.constexpr = HEAD_DIM // PER
    offs_p = tl.arange(0, DP)
    for h in range(0, HEADS):
        x = tl.load(x_rows + (h0 + h) * sx_h).to(tl.float32)
        out = d_ptr + blk * sd_n + (h0 + h) * sd_h + offs_t[:, None] * sd_t + offs_p[None, :]
        if KIND == 3 or KIND == 4:
            if KIND == 4:
                x = x - z_full
            v = tl.div_rn(x, s_full)
            tl.store(out, tl.minimum(tl.maximum(v, -TOP), TOP).to(PAYLOAD))
        else:
            if KIND == 2:
                x = x - z_full
            qf = _round_half_even(tl.div_rn(x, s_full))
            qf = tl.minimum(tl.maximum(qf, QMIN), QMAX)
            if BITS == 8:
                tl.store(out, qf.to(tl.int32).to(PAYLOAD))
            else:
                if KIND == 1:
                    qf = qf + (1 << (BITS - 1))  # offset binary
                u = tl.reshape(qf.to(tl.int32), [BLOCK_SIZE, DP, PER])
                shifts = tl.arange(0, PER) * BITS
                tl.store(out, tl.sum(u << shifts[None, None, :], axis=2).to(tl.uint8))


@triton.jit
def bf16_dot_probe(a_ptr, b_ptr, o_ptr):
    """``o = a @ b`` for 16 x 16 bfloat16 ``a``, ``b``: lets the launcher check the interpreter's bf16 dot."""
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))
