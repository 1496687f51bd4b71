"""Integer codes built as float16 from their bits (``triton_kernels._codes``, ``CVT`` 1 and 2).

The Triton bit arithmetic runs here under the interpreter on every byte value. The inline PTX cannot run
without a GPU, so its text is executed by a small emulator of the instructions it uses (``mov``, ``xor``,
``prmt``, ``and``, ``or``, ``fma.rn.f16x2``, and the fp8 ``cvt.rn.f16x2`` forms), with the operand packing Triton uses for ``pack=4``: four
payload bytes in ``$2`` (element 0 in the low byte), codes 0-1 in ``$0`` and 2-3 in ``$1`` (element 0 in the
low half). ``benchmarks/gpu_decode.py`` checks the PTX path on a GPU against the reference.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from kvpack.errors import ConfigError
from kvpack.kernels import triton_decode as td
from kvpack.kernels import triton_kernels as tk

CASES = [(8, 0, True), (8, 0, False)] + [(b, j, s) for b in (4, 2) for j in range(8 // b) for s in (True, False)]


def expected_codes(byte: np.ndarray, bits: int, j: int, signed: bool) -> np.ndarray:
    """What the payload byte stores for part ``j``: int8 two's complement, uint8, or offset-binary fields."""
    if bits == 8:
        return byte.astype(np.int8).astype(np.float64) if signed else byte.astype(np.float64)
    field = (byte.astype(np.int64) >> (j * bits)) & ((1 << bits) - 1)
    return (field - (1 << (bits - 1)) if signed else field).astype(np.float64)


@triton.jit
def _codes_probe(raw_ptr, out_ptr, J: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, CVT: tl.constexpr):
    offs = tl.arange(0, 256)
    c = tk._codes(tl.load(raw_ptr + offs), J, KIND, BITS, CVT)
    tl.store(out_ptr + offs, c.to(tl.float32))


@pytest.mark.parametrize("bits,j,signed", CASES)
def test_bit_arithmetic_gives_every_code_exactly(bits, j, signed):
    byte = np.arange(256, dtype=np.uint8)
    dtype = torch.int8 if bits == 8 and signed else torch.uint8
    raw = torch.from_numpy(byte.copy()).view(dtype)
    out = torch.full((256,), float("nan"))
    _codes_probe[(1,)](raw, out, j, 1 if signed else 2, bits, 1)
    np.testing.assert_array_equal(out.numpy(), expected_codes(byte, bits, j, signed))


# ---- a PTX emulator for the generated asm


def _f16x2(word: int) -> tuple[float, float]:
    lo, hi = struct.unpack("<ee", struct.pack("<I", word))
    return lo, hi


def _to_word(lo: float, hi: float) -> int:
    return struct.unpack("<I", struct.pack("<ee", lo, hi))[0]


def _fma_f16(a: float, b: float, c: float) -> float:
    """``a * b + c`` with one rounding to float16."""
    return float(np.float16(a * b + c))  # exact product and sum in float64, one rounding to float16


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute the instructions of ``text`` on 32-bit registers; ``operands`` maps ``$2`` etc. to values."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32" and not dst.startswith("{"):
            regs[dst] = val(src[0])
        elif op == "xor.b32":
            regs[dst] = val(src[0]) ^ val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "prmt.b32":  # default mode: selector nibble i picks byte i of d from the 8 bytes {b, a}
            pool = val(src[0]) | (val(src[1]) << 32)
            sel = val(src[2])
            regs[dst] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "fma.rn.f16x2":
            a, b, c = (_f16x2(val(x)) for x in src)
            regs[dst] = _to_word(*(_fma_f16(a[i], b[i], c[i]) for i in range(2)))
        elif op == "mov.b32" and dst.startswith("{"):  # mov.b32 {lo, hi}, $2: split into two 16-bit halves
            lo, hi = dst.strip("{ "), src[0].strip(" }")
            word = val(src[1])
            regs[lo], regs[hi] = word & 0xFFFF, word >> 16
        elif op in ("cvt.rn.f16x2.e4m3x2", "cvt.rn.f16x2.e5m2x2"):  # low byte -> low half
            fp8 = torch.float8_e4m3fn if "e4m3" in op else torch.float8_e5m2
            pair = torch.tensor([val(src[0]) & 0xFF, val(src[0]) >> 8], dtype=torch.uint8).view(fp8)
            regs[dst] = _to_word(*pair.to(torch.float32).tolist())
        else:
            raise AssertionError(f"instruction the emulator does not know: {line}")
    return regs


@pytest.mark.parametrize("bits,j,signed", CASES)
def test_ptx_text_gives_every_code_exactly(bits, j, signed):
    text = tk._codes_asm(bits, j, signed)
    assert set(re.findall(r"\$\d", text)) == {"$0", "$1", "$2"}
    byte = np.arange(256, dtype=np.uint8)
    got = np.empty(256)
    for w in range(0, 256, 4):
        word = int.from_bytes(bytes(byte[w : w + 4]), "little")  # element 0 in the low byte
        regs = run_ptx(text, {"$2": word, "$0": 0xDEADBEEF, "$1": 0xDEADBEEF})
        got[w : w + 4] = [*_f16x2(regs["$0"]), *_f16x2(regs["$1"])]
    np.testing.assert_array_equal(got, expected_codes(byte, bits, j, signed))


@pytest.mark.parametrize("name,fp8", [("_PTX_E4M3", torch.float8_e4m3fn), ("_PTX_E5M2", torch.float8_e5m2)])
def test_fp8_ptx_text_gives_every_value_exactly(name, fp8):
    text = getattr(tk, name).value
    byte = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(byte.copy()).view(fp8).to(torch.float32).numpy()
    got = np.empty(256, dtype=np.float32)
    for w in range(0, 256, 4):
        regs = run_ptx(text, {"$2": int.from_bytes(bytes(byte[w : w + 4]), "little"), "$0": 0, "$1": 0})
        got[w : w + 4] = [*_f16x2(regs["$0"]), *_f16x2(regs["$1"])]
    np.testing.assert_array_equal(got, want)  # NaN codes stay NaN (assert_array_equal treats NaN == NaN)


def test_ptx_codes_are_refused_under_the_interpreter_and_unknown_names_everywhere():
    from kvpack.formats import parse_format
    from kvpack.testing import random_paged_kv

    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [20], kv_heads=1, head_dim=32)
    q = torch.randn(1, 2, 32)
    with pytest.raises(ConfigError, match="GPU only"):
        td.decode_attention(q, kv, codes="ptx")
    with pytest.raises(ConfigError, match="one of"):
        td.decode_attention(q, kv, codes="fast")
