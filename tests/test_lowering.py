"""One lowering of a spec (:mod:`kvpack.kernels.lowering`): the codes every backend uses, and the literal copies
the numba modules keep of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpack.formats import PRESETS, ScaleDType, parse_format
from kvpack.kernels.lowering import (
    FloatKind,
    PayloadKind,
    ScaleKind,
    TritonKind,
    TritonScale,
    lower,
    scale_kind,
)


def test_lowering_is_pure_python() -> None:
    code = (
        "import json, sys, kvpack.kernels.lowering\n"
        "print(json.dumps([m for m in ('numba', 'triton', 'llvmlite') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("module", ["cpu_decode_numba", "cpu_chunk_numba"])
def test_numba_literals_equal_the_enums(module: str) -> None:
    pytest.importorskip("numba")
    import importlib

    m = importlib.import_module(f"kvpack.kernels.{module}")
    assert (m.S8, m.U8, m.U4, m.U2, m.E4M3, m.E5M2, m.FLT) == tuple(PayloadKind)
    assert (m.FK_F16, m.FK_BF16, m.FK_F32) == tuple(FloatKind)
    assert (m.SC_NONE, m.SC_F32, m.SC_F16, m.SC_BF16, m.SC_E8M0) == tuple(ScaleKind)


def test_enum_values() -> None:
    # the numbers the compiled kernels compare (numba literals above; Triton's constexpr literals in triton_kernels)
    assert [int(k) for k in PayloadKind] == list(range(7))
    assert [int(k) for k in ScaleKind] == list(range(5))
    assert (TritonKind.FLOAT, TritonKind.SYM, TritonKind.ASYM, TritonKind.FP8, TritonKind.FP8_ASYM) == (0, 1, 2, 3, 4)
    assert (TritonScale.NONE, TritonScale.SCALAR, TritonScale.CHANNEL, TritonScale.TOKEN, TritonScale.GROUP) == (
        0, 1, 2, 3, 4)  # fmt: skip
    assert scale_kind(ScaleDType.FP32) == ScaleKind.F32 and scale_kind(ScaleDType.E8M0) == ScaleKind.E8M0
    assert lower(PRESETS["bf16"].key, 1, 64, 64).float_kind == FloatKind.BF16


def _triton_codes(spec, h: int, b: int, d: int) -> tuple[int, int, int]:
    """KIND, SCALE, CGROUP derived independently from the spec (as triton_decode.spec_constants did by hand)."""
    if spec.is_passthrough:
        return 0, 0, d
    kind = (3 if spec.symmetric else 4) if spec.dtype.is_fp8 else (1 if spec.symmetric else 2)
    _, ts, cs = spec.scale_shape(h, b, d)
    return kind, 1 + (cs > 1) + 2 * (ts > 1), d // cs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_lowers(name: str) -> None:
    fmt = PRESETS[name]
    for spec in (fmt.key, fmt.value):
        for h, b, d in ((2, 16, 64), (8, 64, 128)):
            low = lower(spec, h, b, d)
            assert (low.triton_kind, low.triton_scale, low.cgroup) == _triton_codes(spec, h, b, d)
            assert low.row == spec.packed_head_dim(d)
            if spec.is_passthrough:
                assert low.kind == PayloadKind.FLT and low.scale_kind == ScaleKind.NONE
                continue
            assert low.per * spec.bits == 8 or low.per == 1
            assert low.scale_shape == spec.scale_shape(h, b, d)
            assert low.scale_kind == scale_kind(spec.scale_dtype)
            assert low.zero_kind == (scale_kind(spec.zero_dtype) if spec.has_zero else ScaleKind.NONE)
            assert low.e8m0 == (spec.scale_dtype is ScaleDType.E8M0)


def test_packed_codes() -> None:
    low = lower(parse_format("int4").key, 2, 16, 64)
    assert low.kind == PayloadKind.U4 and low.per == 2
    sym = lower(parse_format("kivi2").value, 2, 16, 64)
    assert sym.kind == PayloadKind.U2 and sym.per == 4
    assert low.offset == (0 if parse_format("int4").key.has_zero else 8)
