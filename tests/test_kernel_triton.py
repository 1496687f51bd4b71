"""The Triton decode kernel against the torch reference, under the Triton interpreter (CPU).

conftest.py sets TRITON_INTERPRET=1 before any kernel is defined. Caches come from
``testing.random_paged_kv`` (shuffled block tables; null block, spare blocks and unused tail slots poisoned
with NaN / extreme codes), and every tensor the kernel touches is placed inside a poisoned guard region so
a stray read shows up as NaN or a wrong result, and a stray write as a changed guard.

Tolerances (kernel vs reference, the reference computed in float32 from the same stored bytes): the dot
runs in q's dtype with float32 accumulation, so float32 queries agree to float32 rounding, float16 ones
to a few float16 output ulps, bfloat16 ones to a few bfloat16 ulps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _triton_interpreter import fixed_interpreter, stock_interpreter
from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import parse_format
from kvpack.kernels import decode_attention as dispatch_decode
from kvpack.kernels import reference
from kvpack.kernels import triton_decode as td
from kvpack.kernels.views import PagedKV
from kvpack.testing import assert_close, random_paged_kv

pytest.importorskip("triton")

TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 2e-2)}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _interpreter_fixes():
    with fixed_interpreter():
        yield


def _guarded(t: torch.Tensor, guard: int = 64) -> torch.Tensor:
    """``t`` copied into the middle of a larger poisoned buffer (NaN, or 0xFF bytes for 1-byte dtypes)."""
    flat = torch.empty(t.numel() + 2 * guard, dtype=t.dtype)
    if t.dtype.is_floating_point and t.element_size() > 1:
        flat.fill_(float("nan"))
    else:
        flat.view(torch.uint8).fill_(0x7F if t.dtype.is_floating_point else 0xFF)  # 0x7F: fp8 NaN
    view = flat[guard : guard + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _guard_all(kv: PagedKV) -> PagedKV:
    fields = ["k_data", "k_scale", "k_zero", "v_data", "v_scale", "v_zero", "block_tables", "seq_lens"]
    fields += ["tail_k", "tail_v", "start_pos", "k_outlier", "k_outlier_idx", "sink_k", "sink_v"]
    return replace(kv, **{f: _guarded(getattr(kv, f)) for f in fields if getattr(kv, f) is not None})


def _run(
    fmt_name: str,
    seq_lens: list[int],
    *,
    block: int = 16,
    kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    q_dtype: torch.dtype = torch.float16,
    tail_dtype: torch.dtype = torch.float16,
    window: int | None = None,
    start_pos: list[int] | None = None,
    num_splits: int | None = None,
    seed: int = 0,
) -> None:
    fmt = parse_format(f"{fmt_name},block={block}")
    kv, _, _ = random_paged_kv(fmt, seq_lens, kv_heads, head_dim, tail_dtype=tail_dtype, seed=seed)
    if start_pos is not None:
        kv = replace(kv, start_pos=torch.tensor(start_pos, dtype=torch.int32))
    kv = _guard_all(kv)
    g = torch.Generator().manual_seed(seed + 1)
    q = _guarded(torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(q_dtype))
    out = _guarded(torch.full_like(q, float("nan")))  # poisoned: every element must be written
    expected = reference.decode_attention(q.float(), kv, window=window)
    got = td.decode_attention(q, kv, window=window, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    atol, rtol = TOL[q_dtype]
    assert_close(got.float(), expected, atol, rtol, msg=f"{fmt_name} {seq_lens} splits={num_splits}")
    base, start = out._base, out.storage_offset()
    assert base[:start].isnan().all(), "a write before the output"
    assert base[start + out.numel() :].isnan().all(), "a write past the output"


# ---- every preset; lengths 1, B-1, B+1 and several blocks, GQA 4, shuffled tables, split and not

# kept key channels stored as 4-bit refinement codes (an odd count: the last byte of each row half used)
REFINED = "k=int4:channel:asym:o5r,v=int4:g32:asym"


@pytest.mark.parametrize(
    "name",
    ["fp16", "bf16", "int8", "fp8-plain", "fp8_e5m2", "int4", "k8v4", "k4v2", "kivi2", "int4-g32", "fp8-o4", "int4-o4",
     REFINED],
)  # fmt: skip
def test_presets_match_reference(name):
    _run(name, [1, 15, 17, 50], num_splits=None)


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "fp8-plain", "int4-o4"])
def test_split_context_merges_exactly(name):
    _run(name, [1, 15, 17, 83], num_splits=3)


@pytest.mark.parametrize(("name", "lengths"), [("int8", [31, 33, 100]), ("k4v2", [32, 1, 65])])
def test_block_size_32(name, lengths):
    _run(name, lengths, block=32, num_splits=2)


# ---- head_dims whose parts are not a power of two (Phi-2's 80, Phi-3's 96, 112) or narrower than a dot's 16
# (int4 at 16, int2 at 32): the tiles pad to a power of two and mask the padding columns. Value groups of 20 at
# head_dim 80 (int4, k4v2) take the per-group gather; the poisoned guards catch any read past a row.


@pytest.mark.parametrize(
    ("name", "head_dim"),
    [("int8", 80), ("int4", 80), ("kivi2", 80), ("fp8-o4", 96), ("k4v2", 112), ("int4-o4", 96), ("fp16", 80),
     ("int4", 16), ("kivi2", 32), (REFINED, 96)],
)  # fmt: skip
def test_head_dims_that_pad(name, head_dim):
    _run(name, [1, 15, 17, 50], head_dim=head_dim, num_splits=2)


@pytest.mark.parametrize("group", [1, 4])
def test_gqa_ratios(group):
    _run("int4", [40, 9], group=group, kv_heads=2, num_splits=2)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_query_and_tail_dtypes(q_dtype):
    _run("k8v4", [20, 37], q_dtype=q_dtype, tail_dtype=q_dtype if q_dtype != torch.float16 else torch.float32)


@pytest.mark.parametrize(
    "spec",
    [
        "k=int8:tensor:sym:e8m0,v=int4:g16:sym:bf16",
        "k=int8:token:asym:fp32,v=int8:channel:asym:bf16",
        "k=fp8:channel:fp32,v=fp8_e5m2:token:e8m0",
        "k=int2:g32:sym:e8m0,v=int4:head:asym:fp16",
        "k=int2:g2:asym:fp16,v=int2:g8:asym:e8m0",  # a group narrower than a byte's worth: gathered scales
    ],
)
def test_granularities_and_scale_dtypes(spec):
    _run(spec, [18, 49], q_dtype=torch.float32, tail_dtype=torch.float32, num_splits=2)


@pytest.mark.parametrize(("window", "start_pos"), [(20, None), (None, [3, 0, 40]), (7, [0, 30, 2])])
def test_window_and_start_pos(window, start_pos):
    # the third row of case 2 starts past its query: nothing to attend, zeros (as the reference)
    _run("int8", [50, 33, 40], window=window, start_pos=start_pos, num_splits=2)


def test_released_blocks_outside_the_window_are_never_read():
    fmt = parse_format("int4,block=16")
    kv, _, _ = random_paged_kv(fmt, [90], head_dim=64)
    q = torch.randn(1, 8, 64)
    window = 20  # positions 70..89: blocks 4 and 5 and the tail
    tables = kv.block_tables.clone()
    tables[0, :4] = 0  # released to the null block, which is poisoned
    kv = replace(kv, block_tables=tables)
    expected = reference.decode_attention(q, kv, window=window)
    got = td.decode_attention(q, kv, window=window, num_splits=2)
    assert_close(got, expected, *TOL[torch.float32])


# ---- the dispatcher, reasons and bad input


def test_dispatcher_runs_the_triton_backend():
    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [5, 40], head_dim=32)
    q = torch.randn(2, 4, 32)
    got = dispatch_decode(q, kv, backend="triton")
    assert_close(got, reference.decode_attention(q, kv), *TOL[torch.float32])


def test_reasons_unsupported_lists_every_problem(monkeypatch):
    kv, _, _ = random_paged_kv(parse_format("int8,block=8"), [9], head_dim=8)
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    reasons = td.reasons_unsupported(q, kv, window=0)
    text = " | ".join(reasons)
    for needle in ("float16, bfloat16 or float32", "head_dim must be in [16, 256]", "block_size", "window"):
        assert needle in text, text
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("CUDA device" in r for r in td.reasons_unsupported(q, kv))
    with pytest.raises(UnsupportedError) as e:
        td.decode_attention(q, kv)
    assert e.value.reasons


def test_bf16_queries_under_the_stock_interpreter_are_refused_or_right():
    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [20], head_dim=32)
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    expected = reference.decode_attention(q.float(), kv)
    assert td.reasons_unsupported(q, kv) == []  # the fixed interpreter of this test set-up runs them
    with stock_interpreter():
        reasons = td.reasons_unsupported(q, kv)
        if reasons:  # refused with the reason, never silent garbage
            assert "bfloat16 queries under the Triton interpreter" in reasons[0]
            with pytest.raises(UnsupportedError):
                td.decode_attention(q, kv)
        else:  # a triton whose interpreter was fixed upstream
            assert_close(td.decode_attention(q, kv).float(), expected, *TOL[torch.bfloat16])


def test_bad_shapes_raise_before_launch():
    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [20, 3], head_dim=32)
    with pytest.raises(ShapeError, match="q must be"):
        td.decode_attention(torch.randn(2, 3, 32), kv)  # 3 heads, not a multiple of 2 kv heads
    with pytest.raises(ShapeError, match="out must be"):
        td.decode_attention(torch.randn(2, 4, 32), kv, out=torch.empty(2, 4, 32, dtype=torch.float16))
    with pytest.raises(ShapeError, match="k_scale"):
        td.decode_attention(torch.randn(2, 4, 32), replace(kv, k_scale=kv.k_scale.float()))
    with pytest.raises(ShapeError, match="block_tables"):
        td.decode_attention(torch.randn(2, 4, 32), replace(kv, block_tables=kv.block_tables.long()))


def test_default_splits_fill_the_machine_without_tiny_splits():
    fmt = parse_format("int8,block=16")
    kv, _, _ = random_paged_kv(fmt, [16 * 40], kv_heads=1, head_dim=16)
    assert td.default_num_splits(kv) == 10  # 2 "SMs" on the CPU: 16 per SM wants 32, 40 blocks allow 10
    assert td.default_num_splits(kv, window=40) == 1  # a short window reads 4 blocks at most
    # KIND 2: int8's values are uint8 codes above a per-token zero-point
    assert td.spec_constants(fmt.value, 2, 16, 64) == {
        "KIND": 2, "BITS": 8, "PER": 1, "SCALE": 3, "CGROUP": 64, "E8M0": False
    }  # fmt: skip
    assert td.spec_constants(parse_format("k=int8,v=int8").value, 2, 16, 64)["KIND"] == 1  # symmetric int8


# ---- the kernels build for Hopper (sm_90) with Triton's own ptxas, without register spills


AOT_SCRIPT = """
import json, torch
from dataclasses import replace
from kvpack.formats import parse_format
from kvpack.quant import payload_torch_dtype, scale_torch_dtype
from kvpack.testing import random_paged_kv
from kvpack.kernels import triton_decode as td, triton_seal as ts
out = []
cases = [("int8", torch.float16), ("int4", torch.bfloat16), ("kivi2", torch.float16), ("fp8-plain", torch.float16)]
sinks = [("int4", torch.float16, 1), ("fp8-o4", torch.bfloat16, 64)]  # full-precision sink rows: S = 1, S = B
for name, qdt, sink in [(n, t, 0) for n, t in cases] + [("fp8-o4", torch.float16, 0)] + sinks:
    fmt = parse_format(name)
    kv, _, _ = random_paged_kv(fmt, [300, 70], kv_heads=8, head_dim=128, tail_dtype=qdt)
    if sink:
        rows = torch.randn(2, 8, sink, 128, dtype=qdt)
        kv = replace(kv, sink_k=rows, sink_v=rows.clone())
        name = f"{name} sink={sink}"
    q = torch.randn(2, 32, 128, dtype=qdt)
    for launch in td.build_launches(q, kv, num_splits=2)[0]:
        out.append({"case": name, **td.compile_launch(launch)})
kv, _, _ = random_paged_kv(parse_format("int4"), [300, 70], kv_heads=8, head_dim=80, tail_dtype=torch.float16)
for launch in td.build_launches(torch.randn(2, 32, 80, dtype=torch.float16), kv, num_splits=2)[0]:  # padded parts
    out.append({"case": "int4 D=80", **td.compile_launch(launch)})
for name in ("int4", "fp8-plain"):
    spec = parse_format(name).value
    x = torch.randn(4, 8, 64, 128, dtype=torch.float16)
    data = torch.empty(9, 8, 64, spec.packed_head_dim(128), dtype=payload_torch_dtype(spec))
    shape = spec.scale_shape(8, 64, 128)
    scale = torch.empty(9, *shape, dtype=scale_torch_dtype(spec.scale_dtype))
    zero = torch.empty(9, *shape, dtype=scale_torch_dtype(spec.zero_dtype)) if spec.has_zero else None
    launch = ts.seal_launch(x, spec, data, scale, zero, torch.arange(4, dtype=torch.int32))
    out.append({"case": "seal " + name, **td.compile_launch(launch)})
print(json.dumps(out))
"""


def test_kernels_compile_for_hopper_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    usage = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(usage) == 18
    for u in usage:
        assert u["registers"] > 0, u
        assert u["local"] == 0, f"register spills: {u}"


def test_gpu_benchmark_smoke_mode(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["checks"] and all(c["ok"] for c in data["checks"]), data["checks"]
    assert data["timings"], "no timing rows"
    assert "median_ms" in res.stdout  # the table is printed last


def test_codes_are_converted_in_the_load_layout_on_hopper():
    """The PTX conversions keep 8-bit tiles out of the byte-wise gather into the dot operand layout, and a
    register cap (``max_registers``) reaches the compiler without spills.

    Compiled for sm_90 (no GPU needed); the converter path is the control: it does gather bytes (``LDS.U8`` /
    ``LDS.S8``), so a zero below is the property, not an artifact of the count.
    """
    script = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_sass; import torch; "
        "from kvpack.kernels import triton_decode as td; from kvpack.formats import parse_format; "
        "from kvpack.testing import random_paged_kv; "
        "kv = random_paged_kv(parse_format('fp8-o4'), [300, 70], kv_heads=8, head_dim=128, "
        "tail_dtype=torch.float16)[0]; "
        "capped = td.compile_launch(td.build_launches(torch.randn(2, 32, 128, dtype=torch.float16), kv, num_splits=2, "
        "max_registers=128)[0][0]); capped.pop('loop_ops'); print(json.dumps(capped)); "
        "print(json.dumps([gpu_sass.loop_row(f, c, __import__('torch').float16) for f, c in "
        "[('int8', 'ptx'), ('int8', 'convert'), ('fp8-plain', 'ptx'), ('int4', 'ptx'), ('kivi2', 'ptx')]]))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    capped = json.loads(res.stdout.strip().splitlines()[-2])  # fp8-o4 takes 175 registers uncapped
    assert 0 < capped["registers"] <= 128 and capped["local"] == 0, capped
    rows = {(r["format"], r["codes"]): r for r in json.loads(res.stdout.strip().splitlines()[-1])}
    assert rows[("int8", "convert")]["byte_lds"] > 0
    for key in [("int8", "ptx"), ("fp8-plain", "ptx"), ("int4", "ptx"), ("kivi2", "ptx")]:
        assert rows[key]["byte_lds"] == 0, rows[key]
        assert rows[key]["local"] == 0, rows[key]
    assert rows[("int8", "ptx")]["loop"] < rows[("int8", "convert")]["loop"]


def test_gpu_tuner_smoke_mode(tmp_path):
    """gpu_tune.py end to end under the interpreter: every variant checked against the converter path, a
    launch chosen per format, and gpu_decode.py --tuned times with it."""
    tune, out = tmp_path / "tune.json", tmp_path / "decode.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_tune.py"), "--smoke", "--out", str(tune)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(tune.read_text())
    timed = [r for r in data["rows"] if "median_ms" in r]
    assert timed and all(r["ok"] for r in timed), data["rows"]
    assert {r["codes"] for r in timed} == {"bits", "convert"}  # no PTX under the interpreter
    assert set(data["chosen"]) == {"int8", "int4"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--smoke", "--out", str(out), "--tuned", str(tune)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    launches = {
        r["format"]: r["launch"] for r in json.loads(out.read_text())["timings"] if r["provider"].startswith("triton:")
    }
    assert launches["int8"] != "default" and launches["fp16"] == "default"
    assert launches["int8"]["codes"] == data["chosen"]["int8"]["codes"]
