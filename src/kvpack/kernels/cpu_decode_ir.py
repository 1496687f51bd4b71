"""The integer path's two hot loops of the CPU decode kernel, generated as LLVM IR text.

Numba has no vector types, so the key loop (:func:`_kdot_ir`) and the value loop (:func:`_vdot_ir`) are LLVM IR
with explicit ``<32 x i16>`` / ``<16 x i32>`` vectors, linked into the compiled kernel. Codes are widened to
int16 words and multiplied with int16 operands (the folded query, or the attention weights) by ``vpdpwssd``
(AVX-512 VNNI: 32 multiply-adds per instruction, exact int32 sums); without VNNI the same IR uses ``vpmaddwd``
+ add (AVX-512 BW), without AVX-512 a portable multiply + pairwise add that LLVM lowers for the target. The
launcher picks the integer path on AVX-512 BW and AVX2 machines (``cpu_decode.int_dot_isa``), the float path
elsewhere. A packed row is read 32 bytes at a time (a 2-bit value row of 16 bytes, head_dim 64, whole, by the value
loop's narrow variant :func:`_vdot_narrow`): bytes -> words (sign- or zero-extended), then plane ``k``
(``(word >> bits * k) & mask``) holds the codes of channels ``per * j + k`` for the bytes ``j``.

:mod:`kvpack.kernels.cpu_decode_numba` links the generated functions into its loops (``_simd_function``).
numba's disk cache is invalidated by the cached function's own source file only, so that module holds this
file's SHA-256 (``IR_SOURCE_DIGEST``), which ``tests/test_kernel_cpu.py`` checks: an edit here fails the
tests until the digest there is updated, and updating it recompiles the kernel. Pure Python: no numba.
"""

from __future__ import annotations

from functools import lru_cache

from kvpack.kernels.lowering import PayloadKind

S8, U8, U4, U2, E4M3, E5M2 = (int(k) for k in (PayloadKind.S8, PayloadKind.U8, PayloadKind.U4, PayloadKind.U2,
                                               PayloadKind.E4M3, PayloadKind.E5M2))  # fmt: skip

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
             "  %narrow = icmp ult i64 %dp, 32" if per == 4 else "  %narrow = or i1 false, false",
             "  br i1 %narrow, label %nstart, label %unit",
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
        _ir_head_weight(lines, "%", g)
        for e in range(2):
            for h in range(2):
                n = g * 4 + e * 2 + h
                chan = [f"  %c{n}.a = add i64 %ab{g}, %cb{e}", f"  %c{n} = add i64 %c{n}.a, {16 * h}"]
                _ir_acc_add(lines, "%", n, f"%a{n}.out", g, chan)
    lines += ["  %ui.next = add i64 %ui, 1", "  %uc.n = mul i64 %ui.next, 2", "  %uc = icmp ult i64 %uc.n, %nu",
              "  br i1 %uc, label %unit, label %exit", "exit:", "  ret void"]  # fmt: skip
    _vdot_narrow(lines, kind, isa)
    lines.append("}")
    return "\n".join(lines) + "\n" + _ir_decl(isa) + _IR_PREFETCH + _ir_lut_decl(kind, isa)


def _ir_head_weight(lines: list[str], p: str, g: int) -> None:
    """The value loops' end, head ``g``: ``{p}wiv{g}``, its weights' inverse scale (``%wi4[g]``) in 16 lanes, and
    ``{p}ab{g}``, its row of ``acc`` (``g * %ld``). ``p``: the names' prefix (``%`` or ``%n.``)."""
    lines += [f"  {p}wi{g} = extractelement <4 x float> %wi4, i64 {g}",
              f"  {p}wiv{g}.i = insertelement <16 x float> poison, float {p}wi{g}, i64 0",
              f"  {p}wiv{g} = shufflevector <16 x float> {p}wiv{g}.i, <16 x float> poison, {_ir_mask([0] * 16)}",
              f"  {p}ab{g} = mul i64 %ld, {g}"]  # fmt: skip


def _ir_acc_add(lines: list[str], p: str, n: int, src: str, g: int, chan: list[str]) -> None:
    """``acc[{p}c{n} .. + 16] += float(src) * {p}wiv{g}``: integer sums ``src`` (<16 x i32>) of head ``g`` into the
    float accumulator, at the channel ``{p}c{n}`` that the lines ``chan`` compute."""
    lines += [f"  {p}f{n} = sitofp <16 x i32> {src} to <16 x float>", *chan,
              f"  {p}p{n} = getelementptr float, ptr %acc, i64 {p}c{n}",
              f"  {p}o{n} = load <16 x float>, ptr {p}p{n}, align 4",
              f"  {p}m{n} = fmul <16 x float> {p}f{n}, {p}wiv{g}",
              f"  {p}s{n} = fadd <16 x float> {p}o{n}, {p}m{n}",
              f"  store <16 x float> {p}s{n}, ptr {p}p{n}, align 4"]  # fmt: skip


def _vdot_narrow(lines: list[str], kind: int, isa: str) -> None:
    """The value loop of :func:`_vdot_ir` for 2-bit rows of 16 bytes (head_dim 64), from label ``nstart``: the
    wide loop reads rows in 32-byte pieces. Each row pair is loaded once, and each of its four planes (16
    channels of both rows, interleaved word by word) is one ``vpdpwssd`` per head: 4 heads x 4 planes = 16
    accumulators. Bytes 0-7 and 8-15 take the weights of their own value groups, as the wide loop's halves do.
    Other kinds never branch here (``%narrow`` is false)."""
    per, _ = _INT_KINDS[kind]
    if per != 4:
        lines += ["nstart:", "  ret void"]
        return
    inter = [i // 2 + (16 if i % 2 else 0) for i in range(32)]  # words of x and y, interleaved
    lines += ["nstart:",
              "  %n.offi = insertelement <16 x i16> poison, i16 %off16, i64 0",
              f"  %n.off = shufflevector <16 x i16> %n.offi, <16 x i16> poison, {_ir_mask([0] * 16)}",
              "  %n.gb = udiv i64 8, %span",  # the group of bytes 8-15 (bytes 0-7: group 0)
              "  %n.gob = mul i64 %n.gb, %wgrp",
              "  br label %nloop",
              "nloop:",
              "  %n.pi = phi i64 [0, %nstart], [%n.pi.next, %nloop]"]  # fmt: skip
    for n in range(16):  # accumulator n: head n // 4, plane n % 4
        lines.append(f"  %n.a{n} = phi <16 x i32> [zeroinitializer, %nstart], [%n.a{n}.d, %nloop]")
    lines += ["  %n.ro = mul i64 %n.pi, %rs2", "  %n.r0p = getelementptr i8, ptr %v, i64 %n.ro",
              "  %n.r1p = getelementptr i8, ptr %n.r0p, i64 %rs",
              "  %n.x0.b = load <16 x i8>, ptr %n.r0p, align 1", "  %n.x1.b = load <16 x i8>, ptr %n.r1p, align 1",
              "  %n.x0.w = zext <16 x i8> %n.x0.b to <16 x i16>", "  %n.x1.w = zext <16 x i8> %n.x1.b to <16 x i16>",
              "  %n.wo = mul i64 %n.pi, 4", "  %n.wp = getelementptr i8, ptr %w, i64 %n.wo"]  # fmt: skip
    for g in range(4):
        wg = f"%n.wg{g}"
        lines += [f"  {wg}.r = mul i64 %wld, {g}", f"  {wg}.p = getelementptr i8, ptr %n.wp, i64 {wg}.r",
                  f"  {wg}.s = load i32, ptr {wg}.p, align 2", f"  {wg}.ob = add i64 %n.gob, {wg}.r",
                  f"  {wg}.pb = getelementptr i8, ptr %n.wp, i64 {wg}.ob", f"  {wg}.sb = load i32, ptr {wg}.pb, align 2",
                  f"  {wg}.i = insertelement <16 x i32> poison, i32 {wg}.s, i64 0",
                  f"  {wg}.ib = insertelement <16 x i32> {wg}.i, i32 {wg}.sb, i64 1",
                  f"  {wg}.v = shufflevector <16 x i32> {wg}.ib, <16 x i32> poison, {_ir_mask([0] * 8 + [1] * 8)}",
                  f"  {wg} = bitcast <16 x i32> {wg}.v to <32 x i16>"]  # fmt: skip
    for k in range(4):
        for r in range(2):
            x = f"%n.x{r}p{k}"
            lines += [f"  {x}.s = lshr <16 x i16> %n.x{r}.w, {_ir_vec('i16', [2 * k] * 16)}",
                      f"  {x}.m = and <16 x i16> {x}.s, {_ir_vec('i16', [3] * 16)}",
                      f"  {x} = sub <16 x i16> {x}.m, %n.off"]  # fmt: skip
        xy = f"%n.xy{k}"
        lines.append(f"  {xy} = shufflevector <16 x i16> %n.x0p{k}, <16 x i16> %n.x1p{k}, {_ir_mask(inter)}")
        for g in range(4):
            n = g * 4 + k
            _ir_dot(lines, f"%n.a{n}.d", f"%n.a{n}", xy, f"%n.wg{g}", isa)
    lines += ["  %n.pi.next = add i64 %n.pi, 1", "  %n.pc = icmp ult i64 %n.pi.next, %npairs",
              "  br i1 %n.pc, label %nloop, label %nend", "nend:"]  # fmt: skip
    for g in range(4):
        _ir_head_weight(lines, "%n.", g)
        for k in range(4):  # plane-order channel of plane k: k * dp
            n = g * 4 + k
            chan = [f"  %n.cb{n} = mul i64 %dp, {k}", f"  %n.c{n} = add i64 %n.ab{g}, %n.cb{n}"]
            _ir_acc_add(lines, "%n.", n, f"%n.a{n}.d", g, chan)
    lines.append("  ret void")


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
