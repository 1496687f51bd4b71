"""Compiled loops of the fused CPU chunk kernel (numba, cached on disk): many queries per sequence over the
paged cache. Launch it through :mod:`kvpack.kernels.cpu_chunk`, which checks shapes and builds the arguments.

Work item: one sequence, one kv head, one tile of up to ``rows`` query rows (the chunk's ``T x G`` rows of that
kv head, row ``t * G + g`` for query ``t`` and head ``g`` of the group, so a tile covers consecutive positions).
The tile walks the history it attends in steps of whole blocks: each step dequantizes its blocks once (codes,
scales, zero-points, outlier residuals, the sink rows, the tail) into a small float32 tile ``[step, D]`` shared
by all rows of the tile, computes the scores of all rows with one small matrix product, applies each row's
causal bound, window and left padding, and updates each row's online softmax (base 2: the query arrives
scores times ``sm_scale * log2(e)``). Scratch is O(rows x D + step x D) per thread (the scores and weights
of one register tile of rows at a time); the history is never materialized.

The two products run on bfloat16 operands with float32 sums: on the AMX tile unit (``tdpbf16ps``, 32 rows per
call, ``B`` packed in 16-column panels; :func:`_gemm_amx_ir`) where the CPU has it and Linux grants the process
the tile registers, else ``vdpbf16ps`` on CPUs with AVX-512 BF16, else the same arithmetic in plain float32 FMAs
(:func:`_gemm_ir`). The build is chosen from numba's target features when the kernel compiles (:func:`variant`). Scores keep float32 accuracy: the
keys and the query are each split into a bfloat16 high part and the bfloat16 rounding of the rest, and the
score is ``q_hi.k_hi + q_hi.k_lo + q_lo.k_hi`` (relative error ~2**-16, one reduction three ``D`` long). The
attention weights and the values are rounded to bfloat16 once (relative 2**-9 per element; the row sums
are taken over the rounded weights, so a weight's rounding cancels where one position dominates).

This module is self-contained on purpose (the decoders here are small copies of ideas in
:mod:`kvpack.kernels.cpu_decode_numba`, not imports): numba's disk cache is invalidated by the source file of the
cached function only, so compiled helpers imported from another file could be served stale. Its spec vector
(``C_*``) is built by the launcher from the decode kernel's (:func:`kvpack.kernels.cpu_chunk.spec_vector`).
"""

from __future__ import annotations

import ctypes
import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# payload kinds (the launcher maps the decode kernel's codes onto these)
S8, U8, U4, U2, E4M3, E5M2, FLT = range(7)
FK_F16, FK_BF16, FK_F32 = range(3)
SC_NONE, SC_F32, SC_F16, SC_BF16, SC_E8M0 = range(5)
# a spec vector: payload kind, offset of offset-binary codes, codes per byte, scale / zero kinds, scale shape
# [HS, TS, CS] per block, packed row length (elements), float kind of FLT rows, block strides of the payload,
# scale and zero pools, outlier channels and whether their indices are int16
(C_KIND, C_OFF, C_PER, C_SKIND, C_ZKIND, C_HS, C_TS, C_CS, C_ROW, C_FK, C_BST, C_SBST, C_ZBST, C_NOUT,
 C_IDX16, C_OBST, C_IBST, C_REF) = range(18)  # fmt: skip
N_SPEC = 18

FASTMATH = {"nnan", "reassoc", "contract", "nsz", "arcp", "afn"}
MR = 6  # rows per call of the matrix product (one register tile: MR x 64 float32 sums)
AMX_RT, AMX_CT = 2, 2  # AMX: row tiles x column tiles of C held in tile registers (with one A, B per tile: 8)
AMX_MR = 16 * AMX_RT  # rows per call on the AMX tile unit
NL = 64  # lanes per call (4 vectors of 16)
U64 = np.uint64
_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_LOG2_MIN = np.float32(-126.0)
# 2**f on [-0.5, 0.5], relative error ~2.3e-7 (least squares on Chebyshev nodes)
_C0, _C1, _C2, _C3, _C4, _C5 = (np.float32(c) for c in (1.00000007, 0.69314695, 0.24022122, 0.05550743,
                                                        0.00967546, 0.0013267))  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# The matrix product, as LLVM IR (numba has no vector types)


def _gemm_ir(name: str, bf16: bool) -> str:
    """IR of ``void name(ptr c, ptr a, ptr b, i64 lda, i64 ldb, i64 ldc, i64 k2, i64 init)``:
    ``C[r, n] (+)= sum_{kk < k2} A[r, kk] . B[kk, n]`` for ``r < MR``, ``n < NL``, where ``A`` (``i32`` words,
    row stride ``lda``) and ``B`` (``i32`` words, row stride ``ldb``) hold pairs of bfloat16 (element ``2 kk``
    in the low half) and ``.`` is the pair's dot product; ``C`` float32, row stride ``ldc``; ``init`` != 0
    overwrites ``C``. ``k2 >= 1``. ``A``'s word is broadcast, ``B``'s four vectors loaded once per ``kk``: 24
    accumulators in registers."""
    nv = NL // 16
    lines = [f"define void @{name}(ptr %c, ptr %a, ptr %b, i64 %lda, i64 %ldb, i64 %ldc, i64 %k2, i64 %init) {{",
             "entry:"]  # fmt: skip
    for r in range(MR):
        lines += [f"  %ao{r} = mul i64 %lda, {r}", f"  %arow{r} = getelementptr i32, ptr %a, i64 %ao{r}"]
    lines += ["  br label %loop", "loop:", "  %kk = phi i64 [0, %entry], [%kk.next, %loop]"]
    for r in range(MR):
        for v in range(nv):
            lines.append(f"  %acc{r}_{v} = phi <16 x float> [zeroinitializer, %entry], [%nacc{r}_{v}, %loop]")
    lines += ["  %bo = mul i64 %kk, %ldb", "  %bp = getelementptr i32, ptr %b, i64 %bo"]
    for v in range(nv):
        lines += [f"  %bp{v} = getelementptr i32, ptr %bp, i64 {16 * v}",
                  f"  %bv{v} = load <16 x i32>, ptr %bp{v}, align 4"]  # fmt: skip
        if bf16:
            lines.append(f"  %bb{v} = bitcast <16 x i32> %bv{v} to <32 x bfloat>")
        else:
            lines += [f"  %bes{v} = shl <16 x i32> %bv{v}, {_splat('i32', 16)}",
                      f"  %be{v} = bitcast <16 x i32> %bes{v} to <16 x float>",
                      f"  %bos{v} = and <16 x i32> %bv{v}, {_splat('i32', -65536)}",
                      f"  %bo{v} = bitcast <16 x i32> %bos{v} to <16 x float>"]  # fmt: skip
    for r in range(MR):
        lines += [f"  %ap{r} = getelementptr i32, ptr %arow{r}, i64 %kk",
                  f"  %as{r} = load i32, ptr %ap{r}, align 4",
                  f"  %ai{r} = insertelement <16 x i32> poison, i32 %as{r}, i32 0",
                  f"  %ab{r} = shufflevector <16 x i32> %ai{r}, <16 x i32> poison, <16 x i32> zeroinitializer"]  # fmt: skip
        if bf16:
            lines.append(f"  %abf{r} = bitcast <16 x i32> %ab{r} to <32 x bfloat>")
        else:
            lines += [f"  %aes{r} = shl <16 x i32> %ab{r}, {_splat('i32', 16)}",
                      f"  %ae{r} = bitcast <16 x i32> %aes{r} to <16 x float>",
                      f"  %aos{r} = and <16 x i32> %ab{r}, {_splat('i32', -65536)}",
                      f"  %ao.{r} = bitcast <16 x i32> %aos{r} to <16 x float>"]  # fmt: skip
        for v in range(nv):
            if bf16:
                lines.append(f"  %nacc{r}_{v} = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> "
                             f"%acc{r}_{v}, <32 x bfloat> %abf{r}, <32 x bfloat> %bb{v})")  # fmt: skip
            else:
                lines += [f"  %t{r}_{v} = call <16 x float> @llvm.fma.v16f32(<16 x float> %ae{r}, <16 x float> "
                          f"%be{v}, <16 x float> %acc{r}_{v})",
                          f"  %nacc{r}_{v} = call <16 x float> @llvm.fma.v16f32(<16 x float> %ao.{r}, <16 x float> "
                          f"%bo{v}, <16 x float> %t{r}_{v})"]  # fmt: skip
    lines += ["  %kk.next = add i64 %kk, 1", "  %more = icmp ult i64 %kk.next, %k2",
              "  br i1 %more, label %loop, label %exit", "exit:", "  %fresh = icmp ne i64 %init, 0"]  # fmt: skip
    for r in range(MR):
        lines += [f"  %co{r} = mul i64 %ldc, {r}", f"  %crow{r} = getelementptr float, ptr %c, i64 %co{r}"]
        for v in range(nv):
            lines += [f"  %cp{r}_{v} = getelementptr float, ptr %crow{r}, i64 {16 * v}",
                      f"  %old{r}_{v} = load <16 x float>, ptr %cp{r}_{v}, align 4",
                      f"  %sum{r}_{v} = fadd <16 x float> %nacc{r}_{v}, %old{r}_{v}",
                      f"  %res{r}_{v} = select i1 %fresh, <16 x float> %nacc{r}_{v}, <16 x float> %sum{r}_{v}",
                      f"  store <16 x float> %res{r}_{v}, ptr %cp{r}_{v}, align 4"]  # fmt: skip
    lines += ["  ret void", "}"]
    if bf16:
        lines.append(
            "declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)"
        )
    else:
        lines.append("declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)")
    return "\n".join(lines) + "\n"


def _gemm_amx_ir(name: str) -> str:
    """IR of the same product on the AMX tile unit (``tdpbf16ps``) for ``AMX_MR`` rows, with ``B`` packed in
    panels of 16 columns (:func:`_b_word`: each 16 x 16-word tile one contiguous KiB; ``ldb`` is the panels'
    row count and the column offset of ``b`` is ``column * ldb``): the ``NL`` columns in
    passes of ``16 * AMX_CT``, each pass keeping ``AMX_RT x AMX_CT`` float32 tiles of ``C`` (16 x 16) in tile
    registers while ``k2`` runs in steps of 16 words (one ``A`` tile per row tile and one ``B`` tile per column
    tile each step: every loaded tile feeds several products). ``k2`` must be a multiple of 16. The tile
    configuration is LLVM's (the ``.internal`` intrinsics carry the shapes)."""
    rt, ct = AMX_RT, AMX_CT
    tiles = [(i, j) for i in range(rt) for j in range(ct)]
    lines = [f"define void @{name}(ptr %c, ptr %a, ptr %b, i64 %lda, i64 %ldb, i64 %ldc, i64 %k2, i64 %init) {{",
             "entry:", "  %sa = shl i64 %lda, 2", "  %sc = shl i64 %ldc, 2",
             "  %fresh = icmp ne i64 %init, 0"]  # fmt: skip
    for i in range(rt):
        lines += [f"  %ao{i} = mul i64 %lda, {16 * i}", f"  %arow{i} = getelementptr i32, ptr %a, i64 %ao{i}",
                  f"  %co{i} = mul i64 %ldc, {16 * i}", f"  %crow{i} = getelementptr float, ptr %c, i64 %co{i}"]  # fmt: skip
    for ps in range(NL // (16 * ct)):
        col = [16 * (ct * ps + j) for j in range(ct)]
        lines += [f"  br i1 %fresh, label %zero{ps}, label %load{ps}", f"zero{ps}:"]
        lines += [f"  %z{ps}_{i}_{j} = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)" for i, j in tiles]
        lines += [f"  br label %start{ps}", f"load{ps}:"]
        for i, j in tiles:
            lines += [f"  %cp{ps}_{i}_{j} = getelementptr float, ptr %crow{i}, i64 {col[j]}",
                      f"  %l{ps}_{i}_{j} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, "
                      f"ptr %cp{ps}_{i}_{j}, i64 %sc)"]  # fmt: skip
        lines += [f"  br label %start{ps}", f"start{ps}:"]
        lines += [f"  %c{ps}_{i}_{j} = phi x86_amx [%z{ps}_{i}_{j}, %zero{ps}], [%l{ps}_{i}_{j}, %load{ps}]"
                  for i, j in tiles]  # fmt: skip
        lines += [f"  br label %loop{ps}", f"loop{ps}:", f"  %kk{ps} = phi i64 [0, %start{ps}], [%kn{ps}, %loop{ps}]"]
        lines += [f"  %acc{ps}_{i}_{j} = phi x86_amx [%c{ps}_{i}_{j}, %start{ps}], [%n{ps}_{i}_{j}, %loop{ps}]"
                  for i, j in tiles]  # fmt: skip
        for i in range(rt):
            lines += [f"  %ap{ps}_{i} = getelementptr i32, ptr %arow{i}, i64 %kk{ps}",
                      f"  %ta{ps}_{i} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %ap{ps}_{i}, "
                      "i64 %sa)"]  # fmt: skip
        lines += [f"  %bo{ps} = shl i64 %kk{ps}, 4", f"  %bp{ps} = getelementptr i32, ptr %b, i64 %bo{ps}"]
        for j in range(ct):
            lines += [f"  %bc{ps}_{j} = mul i64 %ldb, {col[j]}",
                      f"  %bq{ps}_{j} = getelementptr i32, ptr %bp{ps}, i64 %bc{ps}_{j}",
                      f"  %tb{ps}_{j} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %bq{ps}_{j}, "
                      "i64 64)"]  # fmt: skip
        for i, j in tiles:
            lines.append(f"  %n{ps}_{i}_{j} = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, "
                         f"x86_amx %acc{ps}_{i}_{j}, x86_amx %ta{ps}_{i}, x86_amx %tb{ps}_{j})")  # fmt: skip
        lines += [f"  %kn{ps} = add i64 %kk{ps}, 16", f"  %more{ps} = icmp ult i64 %kn{ps}, %k2",
                  f"  br i1 %more{ps}, label %loop{ps}, label %exit{ps}", f"exit{ps}:"]  # fmt: skip
        for i, j in tiles:
            lines += [f"  %sp{ps}_{i}_{j} = getelementptr float, ptr %crow{i}, i64 {col[j]}",
                      f"  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %sp{ps}_{i}_{j}, i64 %sc, "
                      f"x86_amx %n{ps}_{i}_{j})"]  # fmt: skip
    lines += ["  ret void", "}",
              "declare x86_amx @llvm.x86.tilezero.internal(i16, i16)",
              "declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)",
              "declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)",
              "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _splat(ty: str, val: int) -> str:
    return "<" + ", ".join([f"{ty} {val}"] * 16) + ">"


_LIBS: dict = {}
_AMX: list[bool] = []


def amx_permitted() -> bool:
    """Whether this process may use the AMX tile registers. Linux hands them out per process on request
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, kernel 5.16+); asked once, the answer kept."""
    if not _AMX:
        ok = False
        if sys.platform == "linux" and platform.machine() == "x86_64":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                ok = libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
            except (OSError, AttributeError):
                ok = False
        _AMX.append(ok)
    return _AMX[0]


def _features(context=None) -> set[str]:
    if context is None:
        from numba.core.registry import cpu_target

        context = cpu_target.target_context
    return set(getattr(context.codegen(), "_tm_features", "").split(","))


def target_has_amx(context=None) -> bool:
    """Whether numba's CPU target (``context``'s, default numba's own) has the AMX tile and bfloat16 units."""
    return {"+amx-tile", "+amx-bf16"} <= _features(context)


def variant(context=None) -> str:
    """Which product the target runs (``context``'s, default numba's own): ``amx`` (the tile unit, where the
    process may use it), ``bf16`` (``vdpbf16ps``) or ``fma`` (the same arithmetic in float32 FMAs). Numba's
    target is the host unless ``NUMBA_CPU_FEATURES`` says otherwise."""
    if target_has_amx(context) and amx_permitted():
        return "amx"
    return "bf16" if "+avx512bf16" in _features(context) else "fma"


def _gemm_function(context) -> str:
    """Name of the generated product for the target of ``context`` (its library linked into the caller)."""
    from llvmlite import binding as llvm

    kind = variant(context)
    name = f"kvpack_chunk_gemm_{kind}"
    cg = context.codegen()
    lib = _LIBS.get((id(cg), name))
    if lib is None:
        lib = cg.create_library(name)
        mod = llvm.parse_assembly(_gemm_amx_ir(name) if kind == "amx" else _gemm_ir(name, kind == "bf16"))
        mod.triple = llvm.get_process_triple()
        lib.add_llvm_module(mod)
        _LIBS[(id(cg), name)] = lib
    context.add_linking_libs([lib])
    return name


@intrinsic
def _gemm_rows(typingctx):
    """Rows of ``A`` and ``C`` one call of :func:`_gemm` covers on this target: ``AMX_MR`` or ``MR``."""

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(64), AMX_MR if variant(context) == "amx" else MR)

    return types.int64(), codegen


@intrinsic
def _gemm(typingctx, c, co, a, ao, b, bo, lda, ldb, ldc, k2, init):
    """``_gemm_ir`` on 1-D arrays at element offsets ``co``, ``ao``, ``bo`` (``c`` float32, ``a`` / ``b`` uint32)."""
    sig = types.void(c, co, a, ao, b, bo, lda, ldb, ldc, k2, init)

    def codegen(context, builder, signature, vals):
        name = _gemm_function(context)
        ptrs = []
        for i in (0, 2, 4):
            ty = signature.args[i]
            ary = context.make_array(ty)(context, builder, vals[i])
            off = context.cast(builder, vals[i + 1], signature.args[i + 1], types.int64)
            nbytes = builder.mul(off, ir.Constant(ir.IntType(64), ty.dtype.bitwidth // 8))
            ptrs.append(cgutils.pointer_add(builder, ary.data, nbytes, ir.IntType(8).as_pointer()))
        ints = [context.cast(builder, vals[i], signature.args[i], types.int64) for i in range(6, 11)]
        fnty = ir.FunctionType(ir.VoidType(), [p.type for p in ptrs] + [x.type for x in ints])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), ptrs + ints)
        return context.get_dummy_value()

    return sig, codegen


amx_permitted()  # before any compiled product runs: code loaded from the disk cache skips codegen

# ----------------------------------------------------------------------------------------------------
# Scalars


@intrinsic
def _as_f32(typingctx, bits):
    """The float32 with the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        x = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _bits(typingctx, x):
    """The 32 bits of a float32, as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(fastmath=FASTMATH, cache=True)
def _half(h):
    """IEEE fp16 bits to float32."""
    hi = np.int32(h)
    sign = np.int32(hi & np.int32(0x8000)) << np.int32(16)
    em = np.int32(hi & np.int32(0x7FFF))
    if em < 0x0400:  # zero / subnormal: em * 2**-24
        v = np.float32(em) * np.float32(2.0**-24)
        return -v if sign else v
    if em >= 0x7C00:
        return np.float32(np.nan) if em & 0x3FF else (np.float32(-np.inf) if sign else np.float32(np.inf))
    return _as_f32(np.int32(sign | np.int32((em << np.int32(13)) + np.int32(112 << 23))))


@njit(fastmath=FASTMATH, cache=True)
def _bf16_value(h):
    return _as_f32(np.int32(np.int32(h) << np.int32(16)))


@njit(fastmath=FASTMATH, cache=True)
def _e4m3(byte):
    """float8_e4m3fn byte to float32 (0x7f / 0xff are NaN)."""
    bi = np.int32(byte)
    sign = np.int32(bi & np.int32(0x80)) << np.int32(24)
    em = np.int32(bi & np.int32(0x7F))
    if em == 0x7F:
        return np.float32(np.nan)
    if em < 8:  # zero / subnormal: em * 2**-9
        v = np.float32(em) * np.float32(2.0**-9)
        return -v if sign else v
    return _as_f32(np.int32(sign | np.int32((em << np.int32(20)) + np.int32(120 << 23))))


@njit(fastmath=FASTMATH, cache=True)
def _scale_value(arrs, kind, o):
    """Stored scale (or zero-point) number ``o`` of a pool read as ``(uint8, uint16, float32)`` views."""
    if kind == SC_F32:
        return arrs[2][o]
    if kind == SC_F16:
        return _half(arrs[1][o])
    if kind == SC_BF16:
        return _bf16_value(arrs[1][o])
    if kind == SC_E8M0:
        e = np.int32(arrs[0][o])
        return _as_f32(np.int32(e << np.int32(23))) if e > 0 else np.float32(2.0**-127)
    return _ZERO


@njit(inline="always")
def _bf16_bits(x):
    """float32 -> bfloat16 bits (round to nearest even), as uint32 in the low half."""
    u = _bits(np.float32(x))
    return np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always")
def _exp2(x):
    """2**x for float32 ``x <= 0`` (exactly 0 below 2**-126, so -inf gives 0)."""
    xc = max(x, _LOG2_MIN)
    xi = np.rint(xc)
    f = xc - xi
    p = _C5 * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    r = _as_f32(np.int32((np.int32(xi) + np.int32(127)) << np.int32(23))) * p
    return r if x > _LOG2_MIN else _ZERO


# ----------------------------------------------------------------------------------------------------
# Dequantizing one block row


@njit(fastmath=FASTMATH, cache=True)
def _row_codes(pay, sp, blk, h, t, bs, d, dst, do):
    """Row ``t`` of head ``h`` in block ``blk`` of a pool (spec vector ``sp``) before its scales: ``dst[do : do + d]``
    gets the codes as float32 (less the offset of offset-binary codes), or the values of a passthrough pool."""
    kind, per = sp[C_KIND], sp[C_PER]
    o = U64(blk) * U64(sp[C_BST]) + (U64(h) * U64(bs) + U64(t)) * U64(sp[C_ROW])
    ud = U64(d)
    udo = U64(do)
    p8, p16, p32 = pay
    if kind == FLT:
        fk = sp[C_FK]
        if fk == FK_F32:
            for c in range(ud):
                dst[udo + c] = p32[o + c]
        elif fk == FK_BF16:
            for c in range(ud):
                dst[udo + c] = _bf16_value(p16[o + c])
        else:
            for c in range(ud):
                dst[udo + c] = _half(p16[o + c])
        return
    off = np.float32(sp[C_OFF])
    if kind == S8:
        for c in range(ud):
            dst[udo + c] = np.float32(np.int8(p8[o + c]))
    elif kind == U8:
        for c in range(ud):
            dst[udo + c] = np.float32(p8[o + c])
    elif kind == E4M3:
        for c in range(ud):
            dst[udo + c] = _e4m3(p8[o + c])
    elif kind == E5M2:
        for c in range(ud):
            dst[udo + c] = _half(np.int32(p8[o + c]) << np.int32(8))
    elif per == 2 and d % 2 == 0:  # int4: constant shifts, no division per code (vectorizes)
        for cb in range(ud // U64(2)):
            byte = np.int32(p8[o + cb])
            dst[udo + U64(2) * cb] = np.float32(byte & np.int32(15)) - off
            dst[udo + U64(2) * cb + U64(1)] = np.float32(byte >> np.int32(4)) - off
    elif per == 4 and d % 4 == 0:  # int2
        for cb in range(ud // U64(4)):
            byte = np.int32(p8[o + cb])
            c = udo + U64(4) * cb
            dst[c] = np.float32(byte & np.int32(3)) - off
            dst[c + U64(1)] = np.float32((byte >> np.int32(2)) & np.int32(3)) - off
            dst[c + U64(2)] = np.float32((byte >> np.int32(4)) & np.int32(3)) - off
            dst[c + U64(3)] = np.float32(byte >> np.int32(6)) - off
    else:
        bits = np.int32(8 // per)
        mask = np.int32((1 << bits) - 1)
        upr = U64(per)
        for c in range(ud):
            byte = np.int32(p8[o + c // upr])
            dst[udo + c] = np.float32((byte >> (bits * np.int32(c % upr))) & mask) - off


@njit(inline="always")
def _scale_offsets(sp, blk, h, t):
    """Flat offsets of the first scale and zero-point of row ``t`` of head ``h`` in block ``blk`` (``[Hs, Ts, Cs]``
    per block: a head or token axis of size 1 is shared)."""
    hs, ts, cs = sp[C_HS], sp[C_TS], sp[C_CS]
    inner = U64(h if hs > 1 else 0) * U64(ts * cs) + U64(t if ts > 1 else 0) * U64(cs)
    return U64(blk) * U64(sp[C_SBST]) + inner, U64(blk) * U64(sp[C_ZBST]) + inner


@njit(fastmath=FASTMATH, cache=True)
def _row_scales(scl, zero, sp, blk, h, t, d, srow, zrow):
    """The scale and zero-point (0 without) of each channel of row ``t`` of head ``h`` in block ``blk``: ``srow``,
    ``zrow`` ``[d]`` float32. Scales constant over a block's tokens (``Ts == 1``) are the same for every row: a
    caller decodes them once per block."""
    cs = sp[C_CS]
    so, zo = _scale_offsets(sp, blk, h, t)
    skind, zkind = sp[C_SKIND], sp[C_ZKIND]
    span = U64(d // cs)
    for grp in range(U64(cs)):
        s = _scale_value(scl, skind, so + grp)
        z = _scale_value(zero, zkind, zo + grp) if zkind != SC_NONE else _ZERO
        base = grp * span
        for c in range(span):
            srow[base + c] = s
            zrow[base + c] = z


@njit(fastmath=FASTMATH, cache=True)
def _apply_row_scales(scl, zero, sp, blk, h, t, d, dst, o):
    """``dst[o : o + d] = dst * scale + zero`` with row ``t``'s scales and zero-points (per-token scales, ``Ts > 1``;
    see :func:`_row_scales`)."""
    cs = sp[C_CS]
    so, zo = _scale_offsets(sp, blk, h, t)
    skind, zkind = sp[C_SKIND], sp[C_ZKIND]
    span = U64(d // cs)
    for grp in range(U64(cs)):
        s = _scale_value(scl, skind, so + grp)
        z = _scale_value(zero, zkind, zo + grp) if zkind != SC_NONE else _ZERO
        base = o + grp * span
        for c in range(span):
            dst[base + c] = dst[base + c] * s + z


@njit(fastmath=FASTMATH, cache=True)
def _fill_block(role_key, pay, scl, zero, sp, kout, kidx, tab, b, h, j, nsealed, bs, d, sink, sink_rows, tail,
                dst, row0, ld, srow, zrow):  # fmt: skip
    """The ``bs`` rows of block ``j`` of sequence ``b`` (head ``h``) into ``dst[(row0 + i) * ld ...]``.

    Sealed blocks are dequantized (outlier residuals added to keys; the sink rows replace positions below
    ``sink``; a released block, id 0, gives zeros); block ``nsealed`` is the tail (``tail`` ``[batch, H, B, D]``
    float32), of which only the first ``n - nsealed * bs`` rows are read by the caller. ``srow``, ``zrow``: ``[d]``
    float32 scratch for the rows' scales and zero-points."""
    if j >= nsealed:
        for i in range(bs):
            o = U64((row0 + i) * ld)
            for c in range(U64(d)):
                dst[o + c] = tail[b, h, i, c]
        return
    blk = np.int64(tab[b, j])
    if blk == 0:
        for i in range(bs):
            o = U64((row0 + i) * ld)
            for c in range(U64(d)):
                dst[o + c] = _ZERO
        return
    flt = sp[C_KIND] == FLT
    per_row = sp[C_TS] > 1  # per-token scales; otherwise the block's scales are decoded once, not once per row
    if not (flt or per_row):
        _row_scales(scl, zero, sp, blk, h, 0, d, srow, zrow)
    ud = U64(d)
    for i in range(bs):
        o = U64((row0 + i) * ld)
        _row_codes(pay, sp, blk, h, i, bs, d, dst, o)
        if flt:
            continue
        if per_row:  # each group's scale and zero-point applied as decoded (no per-channel copies)
            _apply_row_scales(scl, zero, sp, blk, h, i, d, dst, o)
            continue
        for c in range(ud):
            dst[o + c] = dst[o + c] * srow[c] + zrow[c]
    nout = sp[C_NOUT]
    if role_key and nout > 0:  # residual and index blocks C_OBST / C_IBST elements apart (vLLM's pages)
        io = blk * sp[C_IBST] + h * nout
        ref = sp[C_REF]  # 4-bit refinement codes, (u - 7.5) * s / 16 with the channel's scale (per channel: srow)
        ow = (nout + 1) // 2 if ref else nout
        for i in range(bs):
            ro = blk * sp[C_OBST] + (h * bs + i) * ow
            o = (row0 + i) * ld
            for jj in range(nout):
                c = np.int64(kidx[1][io + jj]) if sp[C_IDX16] else np.int64(kidx[0][io + jj])
                if ref:
                    u = (np.int32(kout[0][ro + jj // 2]) >> np.int32(4 * (jj % 2))) & np.int32(15)
                    dst[o + c] += (np.float32(u) - np.float32(7.5)) * srow[c] * np.float32(1.0 / 16.0)
                else:
                    dst[o + c] += _half(kout[1][ro + jj])
    if j == 0:
        for i in range(min(sink, bs)):
            o = U64((row0 + i) * ld)
            for c in range(U64(d)):
                dst[o + c] = sink_rows[b, h, i, c]


# ----------------------------------------------------------------------------------------------------
# One work item


@njit(inline="always")
def _order_key(x):
    """An int32 that orders like the float32 ``x`` (integer max reductions vectorize; float ones stay scalar)."""
    i = np.int32(_bits(x))
    return i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(inline="always")
def _from_order_key(i):
    return _as_f32(np.int32(i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF))))


@njit(inline="always")
def _b_word(row, col, rows, cols, packed):
    """Offset of word ``[row, col]`` of a ``B`` operand ``[rows, cols]``: row-major, or (``packed``, the AMX
    build) in panels of 16 columns, each panel ``[rows, 16]`` contiguous."""
    if packed:
        return ((col >> U64(4)) * U64(rows) + row) * U64(16) + (col & U64(15))
    return row * U64(cols) + col


@njit(fastmath=FASTMATH, cache=True)
def _split_keys(kf, nkp, dp, kx, packed):
    """Keys ``kf`` ``[nkp, dp]`` float32 as the product's ``B`` words ``kx`` ``[3 * dp / 2, nkp]``: the pair of
    channels ``2c, 2c + 1`` of position ``i`` at word ``[c, i]`` of each part, parts ``hi | lo | hi``
    (:func:`_b_word`)."""
    dh = dp // 2
    un = U64(nkp)
    rows = U64(3 * dh)
    for c in range(U64(dh)):
        for i in range(un):
            x0 = kf[i, U64(2) * c]
            x1 = kf[i, U64(2) * c + U64(1)]
            h0 = _bf16_bits(x0)
            h1 = _bf16_bits(x1)
            l0 = _bf16_bits(x0 - _as_f32(h0 << np.uint32(16)))
            l1 = _bf16_bits(x1 - _as_f32(h1 << np.uint32(16)))
            w = h0 | (h1 << np.uint32(16))
            kx[_b_word(c, i, rows, un, packed)] = w
            kx[_b_word(U64(dh) + c, i, rows, un, packed)] = l0 | (l1 << np.uint32(16))
            kx[_b_word(U64(2 * dh) + c, i, rows, un, packed)] = w


@njit(fastmath=FASTMATH, cache=True)
def _pair_values(vf, nkp, dp, vx, packed):
    """Values ``vf`` ``[nkp, dp]`` float32 as the product's ``B`` words ``vx`` ``[nkp / 2, dp]``: positions
    ``2i, 2i + 1`` of channel ``c`` at word ``[i, c]`` (:func:`_b_word`)."""
    ud = U64(dp)
    rows = U64(nkp // 2)
    for i in range(rows):
        for c in range(ud):
            vx[_b_word(i, c, rows, ud, packed)] = _bf16_bits(vf[U64(2) * i, c]) | (
                _bf16_bits(vf[U64(2) * i + U64(1), c]) << np.uint32(16)
            )


@njit(fastmath=FASTMATH, cache=True)
def _softmax_step(sc, rl, r, a, e, nkp, scale, mrow, lrow, pw16, acc, dp):
    """Online softmax of row ``r`` over the step's scores ``scale * sc[rl, a:e]`` (others get weight 0; ``rl``: the
    row's place in the row tile's score buffer): updates the row's max and sum, rescales its accumulator, writes its
    bfloat16 weights ``pw16[rl * nkp : (rl + 1) * nkp]``."""
    un = U64(nkp)
    base = U64(rl) * un
    if a >= e:
        for i in range(un):
            pw16[base + i] = np.uint16(0)
        return
    ua, ue = U64(a), U64(e)
    for i in range(un):  # one select per lane: vectorizes
        x = sc[rl, i] * scale
        sc[rl, i] = x if i >= ua and i < ue else _NEG_INF
    mk = _order_key(mrow[r])
    for i in range(un):
        mk = max(mk, _order_key(sc[rl, i]))
    mx = _from_order_key(mk)
    alpha = _exp2(mrow[r] - mx)
    mrow[r] = mx
    tot = _ZERO
    for i in range(un):
        b16 = _bf16_bits(_exp2(sc[rl, i] - mx))
        tot += _as_f32(b16 << np.uint32(16))
        pw16[base + i] = np.uint16(b16)
    lrow[r] = lrow[r] * alpha + tot
    if alpha != np.float32(1.0):
        for c in range(U64(dp)):
            acc[r, c] *= alpha


@njit(fastmath=FASTMATH, cache=True)
def _tile(q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, kout, kidx, tailk, tailv, sinkk, sinkv, tables,
          seq_lens, start_pos, window, group, scale, q_lo, b, h, r0, r1, step_blocks, out):  # fmt: skip
    """Rows ``r0 .. r1 - 1`` (``t * group + g``) of sequence ``b``, kv head ``h``, into ``out`` (see the module
    docstring). ``q`` / ``out``: ``[batch, T, Hq, D]`` float32; ``scale``: ``sm_scale * log2(e)``; ``q_lo``: whether
    the query has a bfloat16 low part (False when every element is a bfloat16 number: a bfloat16 query)."""
    t_q, d = q.shape[1], q.shape[3]
    bs = tailk.shape[2]
    n = np.int64(seq_lens[b])
    nsealed = n // bs
    sink = min(sinkk.shape[2], nsealed * bs) if sinkk.shape[0] > 0 else 0
    nr = r1 - r0
    mr = _gemm_rows()
    packed = mr > MR  # the AMX build reads B in 16-column panels
    rp = -(-nr // mr) * mr  # rows padded to whole register tiles
    dp = -(-d // NL) * NL  # head_dim padded to whole lane groups (zeros)
    k2q = 3 * dp // 2  # words of the score reduction: q_hi.k_hi + q_hi.k_lo + q_lo.k_hi
    k2u = k2q if q_lo else dp  # bfloat16 queries have no low part: q_hi.k_hi + q_hi.k_lo
    nkp = -(-(step_blocks * bs) // NL) * NL  # positions per step, padded to whole lane groups
    # scratch (per item, O(rows x D + step x D)): the scores and weights of one row tile at a time
    qx16 = np.zeros(rp * 2 * k2q, np.uint16)  # [rp, q_hi | q_hi | q_lo] bfloat16
    sc = np.empty((mr, nkp), np.float32)
    pw16 = np.zeros(mr * nkp, np.uint16)  # [mr, nkp] bfloat16 weights
    acc = np.zeros((rp, dp), np.float32)
    mrow = np.full(rp, _NEG_INF, np.float32)
    lrow = np.zeros(rp, np.float32)
    lo = np.empty(rp, np.int64)
    hi = np.empty(rp, np.int64)
    kf = np.zeros((nkp, dp), np.float32)
    vf = np.zeros((nkp, dp), np.float32)
    kx = np.empty(k2q * nkp, np.uint32)  # every word a step uses is written by _split_keys / _pair_values
    vx = np.empty(nkp // 2 * dp, np.uint32)
    srow = np.empty(d, np.float32)  # a block row's scales and zero-points, one per channel
    zrow = np.empty(d, np.float32)
    kflat = kf.reshape(-1)
    vflat = vf.reshape(-1)
    st = np.int64(start_pos[b]) if start_pos.shape[0] > 0 else np.int64(0)
    for r in range(nr):
        t = (r0 + r) // group
        hq = h * group + (r0 + r) % group
        p = n - t_q + t
        hi[r] = p
        lo[r] = max(st, p - window + 1) if window > 0 else st
        o = r * 2 * k2q
        for c in range(d):
            x = q[b, t, hq, c]
            h16 = _bf16_bits(x)
            qx16[o + c] = np.uint16(h16)
            qx16[o + dp + c] = np.uint16(h16)
            qx16[o + 2 * dp + c] = np.uint16(_bf16_bits(x - _as_f32(h16 << np.uint32(16))))
    klo = lo[0]
    khi = hi[nr - 1]
    for r in range(nr):
        klo = min(klo, lo[r])
    if klo <= khi:
        qx = qx16.view(np.uint32)
        sflat = sc.reshape(-1)
        pw = pw16.view(np.uint32)
        aflat = acc.reshape(-1)
        jend = khi // bs + 1
        ja = klo // bs
        while ja < jend:
            jb = min(ja + step_blocks, jend)
            if ja < nsealed and jb > nsealed:
                jb = nsealed  # the tail is a step of its own
            # the step's keys and values, float32 [nkp, dp] (padding rows and channels stay zero)
            nvalid = 0
            for j in range(ja, jb):
                rows_j = bs if j < nsealed else n - nsealed * bs
                _fill_block(True, kpay, kscl, kzero, kp, kout, kidx, tables, b, h, j, nsealed, bs, d, sink,
                            sinkk, tailk, kflat, nvalid, dp, srow, zrow)  # fmt: skip
                _fill_block(False, vpay, vscl, vzero, vp, kout, kidx, tables, b, h, j, nsealed, bs, d, sink,
                            sinkv, tailv, vflat, nvalid, dp, srow, zrow)  # fmt: skip
                nvalid += rows_j
            # the step's width: its valid positions in whole lane groups (a short step, such as the tail's, costs
            # its own positions, not a full step's); buffers keep their nkp-wide allocation
            nk = max(NL, -(-nvalid // NL) * NL)
            for i in range(nvalid, nk):  # rows past the valid ones (a short tail): zeros, not garbage
                for c in range(dp):
                    kf[i, c] = _ZERO
                    vf[i, c] = _ZERO
            _split_keys(kf, nk, dp, kx, packed)
            _pair_values(vf, nk, dp, vx, packed)
            p0 = ja * bs
            for m0 in range(0, rp, mr):  # one row tile at a time: scores [mr, nk], softmax, weights x values
                for n0 in range(0, nk, NL):
                    if packed:
                        _gemm(sflat, n0, qx, m0 * k2q, kx, n0 * k2q, k2q, k2q, nkp, k2u, 1)
                    else:
                        _gemm(sflat, n0, qx, m0 * k2q, kx, n0, k2q, nk, nkp, k2u, 1)
                m1 = min(m0 + mr, nr)
                for r in range(m0, m1):
                    _softmax_step(sc, r - m0, r, max(lo[r] - p0, 0), min(hi[r] - p0 + 1, nvalid), nk, scale, mrow,
                                  lrow, pw16, acc, dp)  # fmt: skip
                for i in range(U64(max(m1 - m0, 0)) * U64(nk), U64(mr * nk)):  # padding rows weigh nothing
                    pw16[i] = np.uint16(0)
                for c0 in range(0, dp, NL):
                    if packed:
                        _gemm(aflat, m0 * dp + c0, pw, 0, vx, c0 * (nk // 2), nk // 2, nk // 2, dp, nk // 2, 0)
                    else:
                        _gemm(aflat, m0 * dp + c0, pw, 0, vx, c0, nk // 2, dp, dp, nk // 2, 0)
            ja = jb
    for r in range(nr):
        t = (r0 + r) // group
        hq = h * group + (r0 + r) % group
        inv = np.float32(1.0) / lrow[r] if lrow[r] > _ZERO else _ZERO
        for c in range(d):
            out[b, t, hq, c] = acc[r, c] * inv


@njit(cache=True)
def check_contents(seq_lens, tables, t_q, bs, num_blocks):
    """0 when every sequence holds the chunk's ``t_q`` tokens and its sealed blocks' ids lie in
    ``[0, num_blocks)``; else 1 (a sequence too short), 2 (``tables`` too narrow) or 3 (an id outside)."""
    for b in range(seq_lens.shape[0]):
        n = np.int64(seq_lens[b])
        if n < t_q:
            return 1
        nsealed = n // bs
        if nsealed > tables.shape[1]:
            return 2
        for j in range(nsealed):
            blk = np.int64(tables[b, j])
            if blk < 0 or blk >= num_blocks:
                return 3
    return 0


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def chunk(q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, kout, kidx, tailk, tailv, sinkk, sinkv, tables,
          seq_lens, start_pos, window, group, scale, q_lo, rows, step_blocks, num_blocks, out):  # fmt: skip
    """Every work item (sequence x kv head x row tile of ``rows`` rows) on numba's threads (see :func:`_tile`),
    after :func:`check_contents` (its code returned, nothing written, when not 0)."""
    batch, t_q = q.shape[0], q.shape[1]
    err = check_contents(seq_lens, tables, t_q, tailk.shape[2], num_blocks)
    if err != 0:
        return err
    kv_heads = tailk.shape[1]
    nrows = t_q * group
    ntiles = -(-nrows // rows)
    for it in prange(batch * kv_heads * ntiles):
        b = it // (kv_heads * ntiles)
        rest = it % (kv_heads * ntiles)
        h = rest // ntiles
        tile = rest % ntiles
        r0 = tile * rows
        r1 = min(r0 + rows, nrows)
        _tile(q, kpay, kscl, kzero, kp, vpay, vscl, vzero, vp, kout, kidx, tailk, tailv, sinkk, sinkv, tables,
              seq_lens, start_pos, window, group, scale, q_lo, b, h, r0, r1, step_blocks, out)  # fmt: skip
    return 0
