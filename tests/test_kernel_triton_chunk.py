"""The Triton chunk (multi-query) kernel against ``reference.paged_attention_reference``, under the interpreter.

conftest.py sets TRITON_INTERPRET=1 before any kernel is defined. Caches come from ``testing.random_paged_kv``
(shuffled block tables; null block, spare blocks, unused tail and sink slots poisoned with NaN or extreme
codes; the quantized presets keep a one-position sink), and every tensor the kernel touches sits inside a
poisoned guard region (``test_kernel_triton._guard_all``), so a stray read shows up as NaN or a wrong result
and a stray write as a changed guard. The output starts as NaN: every element must be written.

Tolerances: the reference runs in float32 on the same stored bytes, the kernel's dots in q's dtype with float32
accumulation, with the decode kernel's tolerances (``test_kernel_triton.TOL``) except for float16 queries:
their dots take the query with the per-channel key scale folded in, rounded to float16 (2**-11 relative), so a
score of magnitude ``|s|`` (large with the outlier channels of realistic keys) moves by ``|s| * 2**-11`` and an
output of the order of the values (1 here) by up to about 1e-2; that error is the decode kernel's, which gives
the same answer for the last query row (``test_last_row_is_the_decode_kernels_answer``).
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

from _triton_interpreter import fixed_interpreter
from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import parse_format
from kvpack.kernels import BACKENDS, reference
from kvpack.kernels import triton_chunk as tc
from kvpack.kernels import triton_decode as td
from kvpack.kernels.views import PagedKV
from kvpack.rotation import rotate
from kvpack.testing import assert_close, random_paged_kv
from test_kernel_triton import TOL, _guard_all, _guarded

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
DECODE_PRESETS = ["fp16", "bf16", "int8", "fp8-plain", "fp8_e5m2", "int4", "k8v4", "k4v2", "kivi2", "int4-g32"]
DECODE_PRESETS += ["fp8-o4", "int4-o4", "k=int4:channel:asym:o5r,v=int4:g32:asym"]
TOL = {**TOL, torch.float16: (1e-2, 1e-2)}  # see the module docstring


@pytest.fixture(autouse=True)
def _interpreter_fixes():
    with fixed_interpreter():
        yield


def _cache(
    fmt_name: str,
    seq_lens: list[int],
    *,
    block: int = 16,
    kv_heads: int = 1,
    head_dim: int = 64,
    tail_dtype: torch.dtype = torch.float16,
    start_pos: list[int] | None = None,
    sink: int = 0,
    seed: int = 0,
) -> PagedKV:
    """A random poisoned cache (see the module docstring), every tensor inside a guard region."""
    fmt = parse_format(f"{fmt_name},block={block}")
    kv, _, _ = random_paged_kv(fmt, seq_lens, kv_heads, head_dim, tail_dtype=tail_dtype, seed=seed, sink=sink)
    if start_pos is not None:
        kv = replace(kv, start_pos=torch.tensor(start_pos, dtype=torch.int32))
    return _guard_all(kv)


def _check_against_reference(
    kv: PagedKV,
    t: int,
    *,
    group: int = 4,
    q_dtype: torch.dtype = torch.float16,
    window: int | None = None,
    block_m: int | None = None,
    seed: int = 1,
    msg: str = "",
) -> torch.Tensor:
    """Run the kernel on a guarded random ``q`` ``[batch, t, kv_heads * group, D]`` into a poisoned ``out``;
    assert it matches the reference and wrote exactly ``out``. Returns the output ``[batch, t, Hq, D]``."""
    g = torch.Generator().manual_seed(seed)
    q = _guarded(torch.randn(kv.batch, t, kv.kv_heads * group, kv.head_dim, generator=g).to(q_dtype))
    out = _guarded(torch.full_like(q, float("nan")))
    expected = reference.paged_attention_reference(q.float(), kv, window=window)
    got = tc.chunk_attention(q, kv, window=window, out=out, block_m=block_m)
    assert got.data_ptr() == out.data_ptr() and got.shape == q.shape and got.dtype == q_dtype
    assert_close(got.float(), expected, *TOL[q_dtype], msg=f"{msg} T={t} window={window}")
    base, start = out._base, out.storage_offset()
    assert base[:start].isnan().all() and base[start + out.numel() :].isnan().all(), "a write outside the output"
    return got


# ---- every preset the decode kernel takes (quantized ones with a one-position sink); short chunks that cross
# a block boundary, over histories that end inside a block, at a block end, or hold only the chunk


@pytest.mark.parametrize("name", DECODE_PRESETS)
@pytest.mark.parametrize("t", [1, 2, 7])
def test_presets_match_reference(name, t):
    kv = _cache(name, [70, 23, 48, 7], kv_heads=2)
    _check_against_reference(kv, t, msg=name)


@pytest.mark.parametrize("name", ["int8", "kivi2", "fp8-plain", "int4-o4", "fp8-o4", "k=int4:channel:o6r,v=int4"])
def test_last_row_is_the_decode_kernels_answer(name):
    # the chunk's last query sits where a decode query sits; both kernels read the same codes with the same
    # helpers in the same order (sink, blocks, tail): the same numbers out up to the last bit of a float16 result
    # (under the interpreter the two kernels' dot products are different numpy calls, whose float16 rounding
    # depends on the SIMD path numpy picks for the CPU: on one VM 2 of 2,048 outputs differed for this seed, by
    # up to 1e-3, on another none), except that the chunk kernel takes the outlier channels' scores
    # in one float16 dot (the decode kernel sums them in float32)
    kv = _cache(name, [70, 23, 48, 7], kv_heads=2)
    q = torch.randn(4, 5, 8, 64).half()
    chunk = tc.chunk_attention(q, kv, window=40)[:, -1]
    decode = td.decode_attention(q[:, -1].contiguous(), kv, window=40, num_splits=1)
    if kv.k_outlier is None:
        # one float16 ulp of the partial sums (values of order 1), which a small output of cancelling terms keeps
        assert_close(chunk.float(), decode.float(), 2e-3, 1e-3, msg=name)
        assert (chunk != decode).float().mean() < 0.05, name  # and nearly every output bit for bit (seen: <= 1.4%)
    else:
        assert_close(chunk.float(), decode.float(), 3e-3, 0.0, msg=name)
        assert not torch.equal(chunk, tc.chunk_attention(q, replace(kv, k_outlier=kv.k_outlier * 0))[:, -1])


def test_rotated_preset_through_the_dispatch_contract():
    # what kernels.run_backend does for a fused backend: rotate q, pass the view without the rotation
    kv = _cache("fp8", [70, 23], kv_heads=2, tail_dtype=torch.float32)
    assert kv.key_rotation is not None
    q = torch.randn(2, 7, 8, 64)
    expected = reference.paged_attention_reference(q, kv, window=30)
    got = tc.chunk_attention(rotate(q, kv.key_rotation), replace(kv, key_rotation=None), window=30)
    assert_close(got, expected, *TOL[torch.float32])
    with pytest.raises(UnsupportedError, match="rotated keys"):
        tc.chunk_attention(q, kv)  # a direct call must not read rotated keys with an unrotated query


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_centred_fp8_keys_with_16_bit_queries(q_dtype):
    """The ``fp8`` preset's keys (e4m3 centred per channel: zero-points, float16 scales) with 16-bit queries: the
    codes multiply in float16 and the zero-points of every part are added once after the parts (``_key_zeros``),
    in the chunk kernel as in decode (the chunk kernel once skipped them for fp8, which only float32 queries hid)."""
    kv = _cache("fp8", [70, 23], kv_heads=2)
    assert kv.format.key.has_zero and kv.key_rotation is not None
    q = torch.randn(2, 7, 8, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    expected = reference.paged_attention_reference(q.float(), kv)
    plain = replace(kv, key_rotation=None)
    qr = rotate(q.float(), kv.key_rotation).to(q_dtype)
    # float16 queries take the float16 path for the keys' zero-points here; bfloat16 ones do on a GPU (PTX codes)
    assert td.cache_constexprs(plain, qr)["K_GF16"] == (q_dtype == torch.float16)
    assert_close(tc.chunk_attention(qr, plain).float(), expected, *TOL[q_dtype], msg="chunk")
    assert_close(td.decode_attention(qr[:, -1], plain).float(), expected[:, -1], *TOL[q_dtype], msg="decode")


# ---- head_dims whose parts pad to a power of two (Phi-2's 80, Phi-3's 96) or to a dot's 16 (int2 at 32)


@pytest.mark.parametrize(
    ("name", "head_dim"), [("int8", 80), ("int4", 80), ("kivi2", 96), ("fp8-o4", 80), ("kivi2", 32)]
)
def test_head_dims_that_pad(name, head_dim):
    kv = _cache(name, [45, 19], head_dim=head_dim, sink=1)
    _check_against_reference(kv, 5, group=2, msg=f"{name} D={head_dim}")


# ---- longer chunks: 64 and 65 queries (tiles of 64 rows, a padded last tile), and 512 once


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "fp8-o4"])
@pytest.mark.parametrize("t", [64, 65])
def test_long_chunks(name, t):
    # 4 heads per kv head: 256 or 260 rows, four or five tiles; the second sequence is all chunk (prefill)
    kv = _cache(name, [150, t], seed=t)
    _check_against_reference(kv, t, msg=name)


def test_chunk_of_512_over_a_history():
    kv = _cache("int4", [512 + 90, 512], block=64, seed=3)
    _check_against_reference(kv, 512, group=1, msg="int4 T=512")


# ---- masks: windows, left padding, rows with nothing to attend, released blocks


@pytest.mark.parametrize("window", [1, 5, 20, 100])
def test_windows(window):
    # window 1: each row attends only itself; 20 < T: rows' windows start in different blocks
    kv = _cache("int8", [130, 40, 33])
    _check_against_reference(kv, 33, group=2, window=window, msg="int8")


@pytest.mark.parametrize(("start_pos", "window"), [([3, 0, 38], None), ([0, 30, 2], 9)])
def test_left_padding(start_pos, window):
    # start 38 of a 40-token sequence: its first 5 of 7 queries attend nothing and must be zeros
    kv = _cache("int4", [50, 33, 40], start_pos=start_pos)
    got = _check_against_reference(kv, 7, window=window, msg=f"start={start_pos}")
    if start_pos[2] == 38:
        assert (got[2, :5] == 0).all() and (got[2, 5:] != 0).any()


def test_released_blocks_outside_the_window_are_never_read():
    kv = _cache("int4", [150])
    window, t = 20, 8  # queries at 142..149 attend positions 123..149: blocks 7, 8 and the tail
    tables = kv.block_tables.clone()
    tables[0, :7] = 0  # released to the poisoned null block
    _check_against_reference(replace(kv, block_tables=_guarded(tables)), t, window=window, msg="released")


# ---- grouped-query attention, head_dim, query and tail dtypes, block sizes, granularities


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(group):
    kv = _cache("k8v4", [61, 20], kv_heads=2)
    _check_against_reference(kv, 9, group=group, msg=f"G={group}")


@pytest.mark.parametrize(("name", "head_dim"), [("int8", 64), ("int4", 128), ("kivi2", 128), ("fp8-o4", 256)])
def test_head_dims(name, head_dim):
    kv = _cache(name, [45, 19], head_dim=head_dim)
    _check_against_reference(kv, 5, group=2, msg=f"{name} D={head_dim}")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_query_and_tail_dtypes(q_dtype):
    kv = _cache("int4-o4", [52, 37], tail_dtype=q_dtype)
    _check_against_reference(kv, 7, q_dtype=q_dtype, msg=str(q_dtype))


@pytest.mark.parametrize(("name", "block"), [("int8", 32), ("k4v2", 64)])
def test_block_sizes(name, block):
    kv = _cache(name, [2 * block + 9, block], block=block)
    _check_against_reference(kv, 11, msg=f"{name} block={block}")


@pytest.mark.parametrize(
    "spec",
    [
        "k=int8:tensor:sym:e8m0,v=int4:g16:sym:bf16",
        "k=int8:token:asym:fp32,v=int8:channel:asym:bf16",
        "k=fp8:channel:fp32,v=fp8_e5m2:token:e8m0",
        "k=int2:g32:sym:e8m0,v=int4:head:asym:fp16",
        "k=int2:g2:asym:fp16,v=int2:g8:asym:e8m0",
    ],
)
def test_granularities_and_scale_dtypes(spec):
    kv = _cache(spec, [40, 18], tail_dtype=torch.float32)
    _check_against_reference(kv, 6, q_dtype=torch.float32, msg=spec)


@pytest.mark.parametrize("block_m", [16, 32])
def test_smaller_query_tiles(block_m):
    # 7 queries x 4 heads = 28 rows: two tiles of 16 (the second padded), or one of 32
    kv = _cache("int8", [60, 30])
    _check_against_reference(kv, 7, block_m=block_m, window=12, msg=f"block_m={block_m}")


# ---- sinks: S = 1, a few, a whole block; chunks whose early rows see part of the sink; windows that mask it


@pytest.mark.parametrize(("sink", "seq_lens", "t", "window"), [
    (5, [40, 16, 9], 9, None),  # the 16-token sequence: its rows at 7..15 see sink positions 0..4 (all sealed)
    (16, [50, 33], 33, None),  # the second one is all chunk: row p sees sink positions 0..min(p, 15)
    (4, [50, 33], 12, 40),  # the window drops position 0 of the first sequence's earliest rows, then all
    (3, [70], 20, 15),  # no row reaches the sink
])  # fmt: skip
def test_sink_rows(sink, seq_lens, t, window):
    kv = _cache("int4", seq_lens, sink=sink, seed=sink)
    got = _check_against_reference(kv, t, window=window, msg=f"S={sink}")
    assert got.isfinite().all()


def test_a_sink_changes_the_answer():
    # the same cache with its sink rows dropped reads the block rows instead: another answer where attended
    kv = _cache("fp8-plain", [40, 20], sink=6, seed=2)
    q = torch.randn(2, 4, 4, 64).half()
    with_sink = tc.chunk_attention(q, kv)
    without = tc.chunk_attention(q, replace(kv, sink_k=None, sink_v=None))
    assert (with_sink.float() - without.float()).abs().amax() > 1e-2


# ---- block-strided pools (views into one page per block, vLLM's layout)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[n, ...]`` copied into every other slot of a poisoned ``[n, 2, ...]`` buffer: a view strided
    along its first axis only (each ``t[i]`` contiguous, poison between them)."""
    big = _guarded(torch.empty(t.shape[0], 2, *t.shape[1:], dtype=t.dtype))
    big.copy_(_guarded(torch.empty_like(big)))  # poison everywhere (NaN / 0x7F / 0xFF)
    view = big[:, 1]
    view.copy_(t)
    return view


def test_block_strided_pools():
    kv = _cache("int4-o4", [70, 23], kv_heads=2)
    pools = ("k_data", "k_scale", "k_zero", "v_data", "v_scale", "v_zero")
    strided = replace(kv, **{n: _strided(getattr(kv, n)) for n in pools if getattr(kv, n) is not None})
    assert strided.k_data.stride(0) == 2 * kv.k_data[0].numel()
    q = torch.randn(2, 7, 8, 64).half()
    assert torch.equal(tc.chunk_attention(q, strided), tc.chunk_attention(q, kv))
    assert_close(tc.chunk_attention(q, strided).float(), reference.paged_attention_reference(q.float(), kv),
                 *TOL[torch.float16])  # fmt: skip


# ---- the launch allocates nothing but the output; reasons; bad input


def test_the_launch_reads_only_the_inputs_and_writes_only_the_output():
    # never a dequantized history or scratch: every tensor argument is q, a tensor of the view, or the output
    kv = _cache("kivi2", [70, 23], kv_heads=2)
    q = torch.randn(2, 7, 8, 64).half()
    launch, result = tc.build_launch(q, kv)
    known = {q.data_ptr(), result.data_ptr()}
    known |= {getattr(kv, f.name).data_ptr() for f in kv.__dataclass_fields__.values()
              if isinstance(getattr(kv, f.name), torch.Tensor)}  # fmt: skip
    tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
    assert tensors and {a.data_ptr() for a in tensors} <= known
    assert result.shape == q.shape and result.dtype == q.dtype


def test_reasons_are_the_decode_kernels():
    kv, _, _ = random_paged_kv(parse_format("int8,block=8"), [9], head_dim=8)
    q = torch.randn(1, 3, 4, 8, dtype=torch.float64)
    text = " | ".join(tc.reasons_unsupported(q, kv, window=0))
    for needle in ("float16, bfloat16 or float32", "head_dim must be in [16, 256]", "block_size", "window"):
        assert needle in text, text
    with pytest.raises(UnsupportedError) as e:
        tc.chunk_attention(q, kv)
    assert e.value.reasons
    caps = BACKENDS["triton"].capabilities
    assert caps.chunk and caps.outliers and caps.sink


def test_bad_shapes_raise_before_launch():
    kv = _cache("int8", [20, 3], kv_heads=2)
    with pytest.raises(ShapeError, match="q must be"):
        tc.chunk_attention(torch.randn(2, 4, 64).half(), kv)  # decode-shaped query
    with pytest.raises(ShapeError, match="q must be"):
        tc.chunk_attention(torch.randn(2, 1, 3, 64).half(), kv)  # 3 heads over 2 kv heads
    with pytest.raises(ShapeError, match="out must be"):
        tc.chunk_attention(torch.randn(2, 1, 4, 64).half(), kv, out=torch.empty(2, 1, 4, 64))
    with pytest.raises(ShapeError, match="block_tables"):
        tc.chunk_attention(torch.randn(2, 1, 4, 64).half(), replace(kv, block_tables=kv.block_tables.long()))
    with pytest.raises(ShapeError, match="block_m"):
        tc.chunk_attention(torch.randn(2, 1, 4, 64).half(), kv, block_m=24)
    empty = tc.chunk_attention(torch.randn(2, 0, 4, 64).half(), kv)
    assert empty.shape == (2, 0, 4, 64)


def test_default_tiles():
    assert [tc.default_block_m(n) for n in (1, 16, 17, 40, 64, 2048)] == [16, 16, 32, 64, 64, 64]
    assert tc.launch_config(64, 128)["num_warps"] == 8 and tc.launch_config(16, 64)["num_warps"] == 4


# ---- the kernel builds for Hopper (sm_90) with Triton's own ptxas, without register spills

AOT_SCRIPT = """
import json, torch
from dataclasses import replace
from kvpack.formats import parse_format
from kvpack.testing import random_paged_kv
from kvpack.kernels import triton_decode as td, triton_chunk as tc
out = []
cases = [("int8", torch.float16, 128, 0), ("int4", torch.bfloat16, 128, 0), ("kivi2", torch.float16, 128, 0),
         ("fp8-o4", torch.float16, 128, 64), ("int4-o4", torch.bfloat16, 64, 0), ("int8", torch.float16, 256, 0),
         ("fp16", torch.float16, 128, 0), ("int4", torch.float16, 80, 0)]
for name, qdt, d, sink in cases:
    kv, _, _ = random_paged_kv(parse_format(name), [300, 70], kv_heads=8, head_dim=d, tail_dtype=qdt)
    if sink:
        rows = torch.randn(2, 8, sink, d, dtype=qdt)
        kv = replace(kv, sink_k=rows, sink_v=rows.clone())
    q = torch.randn(2, 128, 32, d, dtype=qdt)
    out.append({"case": f"{name} D={d} sink={sink}", **td.compile_launch(tc.build_launch(q, kv, window=200)[0])})
print(json.dumps(out))
"""


def test_kernel_compiles_for_hopper_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    usage = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(usage) == 8
    for u in usage:
        assert u["name"] == "paged_chunk_kernel" and u["registers"] > 0, u
        assert u["local"] == 0, f"register spills: {u}"
        assert u["shared"] <= 227 * 1024, f"more shared memory than an H100/H200 SM holds: {u}"
        mma = [op for op in u["loop_ops"] if op.startswith(("HMMA", "HGMMA"))]
        assert mma, f"no tensor-core dot in the block loop: {u}"


def test_gpu_prefill_benchmark_smoke_mode(tmp_path):
    """benchmarks/gpu_prefill.py end to end under the interpreter: its device checks pass, every provider is timed
    (flash SDPA's stand-in on the CPU, the chunk kernel at its default launch and a variant), JSON written."""
    out = tmp_path / "prefill.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_prefill.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["checks"] and all(c["ok"] for c in data["checks"]), data["checks"]
    providers = {(r["provider"], str(r.get("launch"))) for r in data["timings"]}
    assert {p for p, _ in providers} == {"sdpa:fp16", "sdpa:bf16", "triton-chunk:int4"}, providers
    assert len([p for p in providers if p[0] == "triton-chunk:int4"]) == 2, providers
    assert "median_ms" in res.stdout  # the table is printed last
