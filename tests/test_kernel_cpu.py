"""The fused CPU decode kernel against the torch reference, on poisoned, shuffled random paged caches.

Tolerances: both paths read the same stored bytes and accumulate in float32, so they differ only by
summation order: float32 queries get atol 2e-4 / rtol 2e-3; half-precision queries and outputs get the
rounding of that dtype on top (atol/rtol 2e-2 for bf16, 5e-3 for fp16).

The integer path (int8/int4/int2 codes, and fp8 with AVX-512 BW; ``cpu_decode.int_dot_enabled()``) rounds two
float operands to int16, per block and head, at 32767 over their largest magnitude: the key-scale-folded
query ``qf`` and the
attention weights ``p * v_scale`` (bounded by the block's largest ``p`` times its largest scale). Each
rounding moves an operand by at most 1/65534 of that maximum, independently per element:

* a base-2 logit moves by ``sum_c r_c (code_c - mid)`` over ``D`` channels: with ``|r_c| <= max|qf| / 65534``
  and random signs this is about ``max|qf| sqrt(D) rms(code - mid) / (65534 sqrt(3))``, 1e-4 to 5e-4 of a
  logit on these caches (int8 codes rms ~40, int4 ~4.5 at 17x the step), i.e. a relative change of a
  weight of ``ln 2`` times that, and of an output element ``~|v|`` times that: up to ~1e-3 at |v| ~ 3;
* a weight moves by at most ``p_max s_max / 65534``: over the ``B`` rows of a block, random signs,
  ``sqrt(B) |v|max / 65534 / lsum``, below 2e-4 at B = 64.

Measured over the presets: at most ~3x the float path's tolerance, so the integer path is held to
``INT_TOL`` = atol 1e-3 / rtol 1e-2, about 2x above what was seen and still ~10x below the int8 cache's own
quantization error. Every case runs on both paths (``dot_path``); the float path keeps the tight bound.

fp8 codes on the integer path become int16 words through a table, each code's value rounded to a grid of
``max / 2047`` (the format's largest value over 2047; 12 bits, so the query keeps 13 before int32 sums could
overflow): a key element moves by at most ``max|k| / 4094`` of its block and head, and the query is rounded
at ~8192 instead of 32767. A base-2 logit then moves by about ``|q| max|k| / (2047 sqrt(12))``: ~8e-3 on these
caches (keys with x12 outlier channels make ``max|k|`` large), an output element by ``~ln 2 |v|`` times that.
Measured: up to 1.0e-2 at head_dim 64 (6e-3 at 128), against the fp8 cache's own error of 0.07-0.29 on the
same caches (vs full precision attention); ``FP8_INT_TOL`` = atol 2e-2 / rtol 5e-2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpack.kernels as K
from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import PRESETS, ScaleDType, parse_format
from kvpack.kernels import cpu_decode, reference
from kvpack.kernels import cpu_decode_ir as ir
from kvpack.kernels.lowering import scale_kind
from kvpack.testing import FP8_INT_PATH_TOL, INT_PATH_TOL, assert_close, cpu_kernel_tolerance, random_paged_kv

TOL = {torch.float32: (2e-4, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}
INT_TOL = INT_PATH_TOL
FP8_INT_TOL = FP8_INT_PATH_TOL


@pytest.fixture(params=["int", "float"])
def dot_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the integer path (forced: where the CPU has neither AVX2 nor AVX-512 BW the portable IR runs
    anyway) and the float one."""
    monkeypatch.setattr(cpu_decode, "INT_DOT", request.param == "int")
    return request.param


def _int_path(kv) -> bool:
    """Whether the integer path handles the keys or the values of ``kv`` here."""
    p_dot = cpu_decode._nb().P_DOT
    keys = cpu_decode._params(kv.format.key, kv, kv.k_data, "key")[p_dot]
    values = cpu_decode._params(kv.format.value, kv, kv.v_data, "value")[p_dot]
    return bool(keys or values)


def _tol(kv, base: tuple[float, float]) -> tuple[float, float]:
    """The bound for ``kv`` on the path the kernel takes here (module docstring)."""
    return cpu_kernel_tolerance(kv, base)


def _lengths(b: int) -> list[int]:
    """The odd lengths that matter for block size ``b``: 1, b - 1, b + 1 and several blocks plus a tail."""
    return [1, b - 1, b + 1, 3 * b + 5]


def _check(kv, q, *, window=None, sm_scale=None, tol=None):
    """Run the kernel into a NaN-poisoned buffer and compare with the reference."""
    out = torch.full_like(q, float("nan"))
    res = cpu_decode.decode_attention(q, kv, sm_scale, window, out)
    assert res is out
    ref = reference.decode_attention(q, kv, sm_scale, window)
    atol, rtol = _tol(kv, tol or TOL[q.dtype])
    assert_close(out, ref, atol, rtol, msg=f"{kv.format.name} window={window}")
    return out, ref


# Pairwise rather than cartesian: every preset meets every block size, GQA ratio and head_dim at least once.
PRESET_CASES = [
    ("fp16", 16, 1, 64),
    ("bf16", 32, 4, 128),
    ("fp8-plain", 64, 8, 64),
    ("fp8_e5m2", 16, 3, 128),
    ("int8", 16, 4, 64),
    ("int8", 64, 1, 256),
    ("int4", 32, 8, 128),
    ("int4", 16, 3, 256),
    ("k8v4", 64, 4, 128),
    ("k4v2", 16, 8, 64),
    ("kivi2", 32, 3, 64),
    ("kivi2", 64, 4, 128),
    ("int4-g32", 64, 1, 64),
    ("int4-g32", 32, 4, 128),
    # head_dims that g32 does not divide (Phi-2's 80, 120): narrower groups of whole 4-channel runs
    ("int4", 32, 4, 80),
    ("kivi2", 16, 2, 80),
    ("k4v2", 64, 8, 120),
    ("int4-g32", 16, 1, 80),
]


@pytest.mark.parametrize("name,block,group,head_dim", PRESET_CASES)
def test_presets_match_reference(name: str, block: int, group: int, head_dim: int, dot_path: str) -> None:
    fmt = PRESETS[name].with_block_size(block)
    kv_heads = 2
    kv, _, _ = random_paged_kv(fmt, _lengths(block), kv_heads=kv_heads, head_dim=head_dim, seed=block + group)
    q = torch.randn(kv.batch, kv_heads * group, head_dim)
    _check(kv, q)


# Every scale dtype, granularity and code family, keys and values separately.
CUSTOM = [
    "k=int8:channel:sym:e8m0,v=int4:g32:asym:bf16",
    "k=int8:head:asym:bf16,v=int8:tensor:sym:e8m0",
    "k=int2:token:asym:fp32,v=int8:channel:asym:fp16",
    "k=int4:g16:sym:fp16,v=int2:head:sym:fp32",
    "k=int4:tensor:asym:e8m0,v=int4:token:sym:fp16",
    "kv=fp8:tensor:fp32",
    "k=e5m2:head:bf16,v=e4m3:head:e8m0",
    "k=int8:token:sym:fp32,v=int2:g16:asym:fp16",
    "k=int8:g32:asym:fp16,v=int8:g64:sym:bf16",
    "k=fp32,v=int4:g32:asym",
    "k=int4:channel:asym,v=bf16",
    "k=int4:channel:sym:fp16,v=int4:token:sym",  # offset-binary codes centred on the integer path
    "k=int2:channel:sym,v=int2:g32:sym:bf16",
    "k=int8:channel:asym:fp32,v=int8:token:asym",
]


@pytest.mark.parametrize("spec", CUSTOM)
def test_custom_formats_match_reference(spec: str, dot_path: str) -> None:
    fmt = parse_format(spec).with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [7, 16, 41, 70], kv_heads=2, head_dim=64, seed=3)
    q = torch.randn(kv.batch, 8, 64)
    _check(kv, q)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tail_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries_and_tails(q_dtype: torch.dtype, tail_dtype: torch.dtype) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(32), [5, 33, 90], kv_heads=2, head_dim=64,
                               tail_dtype=tail_dtype, seed=7)  # fmt: skip
    q = torch.randn(kv.batch, 8, 64).to(q_dtype)
    out, _ = _check(kv, q)
    assert out.dtype == q_dtype


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2"])
@pytest.mark.parametrize("window", [1, 17, 64, 200])
def test_sliding_window(name: str, window: int, dot_path: str) -> None:
    fmt = PRESETS[name].with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [3, 40, 130, 257], kv_heads=2, head_dim=64, seed=window)
    q = torch.randn(kv.batch, 4, 64)
    _check(kv, q, window=window)


def test_window_with_released_blocks(dot_path: str) -> None:
    """Blocks that left the window are released (block id 0, the poisoned null block): never read."""
    b = 16
    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(b), [300, 77], kv_heads=2, head_dim=64, seed=11)
    window = 40
    tables = kv.block_tables.clone()
    for row, n in enumerate(kv.seq_lens.tolist()):
        first_needed = max(n - window, 0) // b
        tables[row, :first_needed] = 0
    kv = dataclasses.replace(kv, block_tables=tables)
    q = torch.randn(2, 4, 64)
    _check(kv, q, window=window)


def test_left_padding_start_pos(dot_path: str) -> None:
    kv, _, _ = random_paged_kv(PRESETS["k8v4"].with_block_size(16), [50, 50, 90, 20], kv_heads=2, head_dim=64, seed=5)
    # row 1: nothing to attend (start past the end) -> zeros, as the reference says
    kv = dataclasses.replace(kv, start_pos=torch.tensor([0, 60, 37, 3], dtype=torch.int32))
    q = torch.randn(4, 6, 64)
    out, _ = _check(kv, q)
    assert torch.count_nonzero(out[1]) == 0
    out_w, _ = _check(kv, q, window=25)  # window and start_pos together
    assert torch.isfinite(out_w).all()


def test_long_sequence_is_split_and_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single long sequence is cut into chunks that run on several threads and merge exactly."""
    monkeypatch.setattr(cpu_decode, "MIN_CHUNK_TOKENS", 64)
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [3001], kv_heads=1, head_dim=64, seed=2)
    items, first = cpu_decode._nb().work_items(
        kv.seq_lens.numpy(), torch.zeros(1, dtype=torch.int32).numpy(), -1, 16, 1, 8, 4
    )
    assert len(items) > 1 and first[-1] == len(items)
    q = torch.randn(1, 4, 64)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(kv, q)
    finally:
        torch.set_num_threads(old)


def test_sm_scale_and_fresh_output() -> None:
    kv, _, _ = random_paged_kv(PRESETS["fp8-plain"].with_block_size(32), [45, 64], kv_heads=1, head_dim=128, seed=9)
    q = torch.randn(2, 2, 128)
    _check(kv, q, sm_scale=0.3)
    fresh = cpu_decode.decode_attention(q, kv)  # no out buffer: a new tensor in q.dtype
    assert fresh.shape == q.shape and fresh.dtype == q.dtype
    assert_close(fresh, reference.decode_attention(q, kv), *_tol(kv, TOL[torch.float32]))


# ----------------------------------------------------------------------------------------------------
# Capabilities, dispatch and bad input


def test_reasons_unsupported_lists_why() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [20], kv_heads=1, head_dim=64)
    assert cpu_decode.reasons_unsupported(torch.randn(1, 2, 64), kv) == []
    reasons = cpu_decode.reasons_unsupported(torch.randn(1, 2, 64, dtype=torch.float64), kv)
    assert any("float64" in r for r in reasons)
    per_channel_int4_values = parse_format("k=int8,v=int4:channel:asym").with_block_size(16)
    kv4, _, _ = random_paged_kv(per_channel_int4_values, [20], kv_heads=1, head_dim=64)
    reasons = cpu_decode.reasons_unsupported(torch.randn(1, 2, 64), kv4)
    assert len(reasons) == 1 and reasons[0].startswith("value:") and "g16" in reasons[0]


def test_auto_backend_picks_cpu_without_warning() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(16), [20, 33], kv_heads=2, head_dim=64)
    q = torch.randn(2, 4, 64)
    assert K.choose_backend(q, kv) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = K.decode_attention(q, kv)
    assert_close(out, reference.decode_attention(q, kv), *_tol(kv, TOL[torch.float32]))


def test_unsupported_case_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K, "_warned", set())
    fmt = parse_format("k=int8,v=int4:channel:asym").with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [20, 9], kv_heads=2, head_dim=64)
    q = torch.randn(2, 4, 64)
    with pytest.warns(RuntimeWarning, match="groups of a multiple of 2"):
        out = K.decode_attention(q, kv)
    assert_close(out, reference.decode_attention(q, kv), 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        K.decode_attention(q, kv)
    with pytest.raises(UnsupportedError, match="cpu"):
        K.decode_attention(q, kv, backend="cpu")


def test_bad_input_raises_shape_errors() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [20, 40], kv_heads=2, head_dim=64)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ShapeError, match="q must be"):
        cpu_decode.decode_attention(torch.randn(2, 3, 64), kv)
    with pytest.raises(ShapeError, match="out must be"):
        cpu_decode.decode_attention(q, kv, out=torch.empty(2, 4, 64, dtype=torch.float64))
    bad_tables = kv.block_tables.clone()
    bad_tables[0, 0] = kv.k_data.shape[0]
    with pytest.raises(ShapeError, match="outside"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, block_tables=bad_tables))
    with pytest.raises(ShapeError, match="at least one token"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, seq_lens=torch.tensor([0, 40], dtype=torch.int32)))
    with pytest.raises(ShapeError, match="too few for seq_len"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, block_tables=kv.block_tables[:, :1].clone()))
    # the same view, its contents changed in place: checked on every call, and nothing is left changed
    kv.block_tables[1, 0] = -3
    with pytest.raises(ShapeError, match="outside"):
        cpu_decode.decode_attention(q, kv)
    with pytest.raises(ShapeError, match="payload dtype"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, k_data=kv.k_data.view(torch.int8)))
    with pytest.raises(ShapeError, match="key scale"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, k_scale=None))


def test_kind_tables_match_the_compiled_module() -> None:
    nbm = cpu_decode._nb()
    assert scale_kind(ScaleDType.FP32) == nbm.SC_F32
    assert scale_kind(ScaleDType.FP16) == nbm.SC_F16
    assert scale_kind(ScaleDType.BF16) == nbm.SC_BF16
    assert scale_kind(ScaleDType.E8M0) == nbm.SC_E8M0
    assert cpu_decode._FLOAT_KIND == {torch.float16: nbm.FK_F16, torch.bfloat16: nbm.FK_BF16, torch.float32: nbm.FK_F32}


# ----------------------------------------------------------------------------------------------------
# The integer path and outlier key channels


def test_int_path_is_chosen_for_int_and_fp8_codes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    kv8, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [40], kv_heads=1, head_dim=64)
    kvf, _, _ = random_paged_kv(PRESETS["fp8-plain"].with_block_size(16), [40], kv_heads=1, head_dim=64)
    kvs, _, _ = random_paged_kv(PRESETS["fp16"].with_block_size(16), [40], kv_heads=1, head_dim=64)
    monkeypatch.setattr(cpu_decode, "INT_DOT", True)
    fp8_int = cpu_decode.int_dot_isa() == "avx512bw"  # fp8 codes through a vpermt2w table: AVX-512 BW only
    assert _int_path(kv8) and _int_path(kvf) == fp8_int and not _int_path(kvs)  # fp16 never
    odd, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(18), [40], kv_heads=1, head_dim=64)
    p_dot = cpu_decode._nb().P_DOT
    assert cpu_decode._params(odd.format.key, odd, odd.k_data, "key")[p_dot] == 0  # rows come 4 at a time
    assert cpu_decode._params(odd.format.value, odd, odd.v_data, "value")[p_dot] > 0  # and 2 at a time
    # 2-bit rows at head_dim 64 are 16 bytes: values take the value loop's narrow variant (test_presets_match_reference
    # runs it: k4v2 and kivi2 at head_dim 64), keys stay on the float path (the key loop reads 32-byte pieces)
    two, _, _ = random_paged_kv(PRESETS["kivi2"].with_block_size(16), [40], kv_heads=1, head_dim=64)
    assert cpu_decode._params(two.format.value, two, two.v_data, "value")[p_dot] > 0
    assert cpu_decode._params(two.format.key, two, two.k_data, "key")[p_dot] == 0
    if fp8_int:  # fp8's 12-bit codes leave the query 11 bits at head_dim 512 (still the integer path), 10 at 1024
        wide, _, _ = random_paged_kv(PRESETS["fp8-plain"].with_block_size(16), [40], kv_heads=1, head_dim=512)
        assert cpu_decode._params(wide.format.key, wide, wide.k_data, "key")[p_dot] == 2049  # 2**31 // (512 * 2047)
        wider, _, _ = random_paged_kv(PRESETS["fp8-plain"].with_block_size(16), [40], kv_heads=1, head_dim=1024)
        assert cpu_decode._params(wider.format.key, wider, wider.k_data, "key")[p_dot] == 0
        assert cpu_decode._params(wider.format.value, wider, wider.v_data, "value")[p_dot] > 0
        assert cpu_decode._params(kvf.format.key, kvf, kvf.k_data, "key")[p_dot] == 16392  # 2**31 // (64 * 2047)
    monkeypatch.setattr(cpu_decode, "INT_DOT", False)
    assert not _int_path(kv8)
    monkeypatch.setattr(cpu_decode, "INT_DOT", None)
    monkeypatch.setenv("KVPACK_CPU_INT_DOT", "0")
    assert not cpu_decode.int_dot_enabled()


def test_int_and_float_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, _, _ = random_paged_kv(PRESETS["k8v4"].with_block_size(64), [700, 64, 130], kv_heads=2, head_dim=128, seed=4)
    q = torch.randn(3, 8, 128)
    outs = {}
    for flag in (True, False):
        monkeypatch.setattr(cpu_decode, "INT_DOT", flag)
        outs[flag] = cpu_decode.decode_attention(q, kv)
    assert not torch.equal(outs[True], outs[False])  # two different computations...
    assert_close(outs[True], outs[False], *INT_TOL)  # ...within the stated bound


OUTLIER_FORMATS = [
    "fp8-o4",
    "int4-o4",
    "k=int4:channel:o4,v=int8:token",
    "k=int8:token:o2,v=int4:g32",
    "k=int4:channel:asym:o5r,v=int4:g32:asym",  # refinement codes, an odd count (a half-filled byte per row)
    "k=int2:channel:asym:o4r,v=int8:token",  # refined 2-bit keys
]


@pytest.mark.parametrize("spec", OUTLIER_FORMATS)
@pytest.mark.parametrize("block,head_dim", [(16, 64), (64, 128), (32, 512)])
def test_outlier_channels_match_reference(spec: str, block: int, head_dim: int, dot_path: str) -> None:
    fmt = (PRESETS[spec] if spec in PRESETS else parse_format(spec)).with_block_size(block)
    kv, _, _ = random_paged_kv(fmt, _lengths(block), kv_heads=2, head_dim=head_dim, seed=block)
    assert kv.k_outlier is not None and kv.k_outlier_idx.dtype == (torch.int16 if head_dim > 256 else torch.uint8)
    assert K.backend_reasons("cpu", torch.randn(kv.batch, 4, head_dim), kv) == []
    q = torch.randn(kv.batch, 4, head_dim)
    _, ref = _check(kv, q)
    # the residuals matter: without them the reference moves by more than the tolerance (0x88: refinement
    # codes of a zero residual)
    plain = dataclasses.replace(kv, k_outlier=torch.full_like(kv.k_outlier, 0x88 if fmt.key.refined else 0))
    assert (reference.decode_attention(q, plain) - ref).abs().max() > 10 * INT_TOL[0]
    _check(kv, q, window=block + 3)


def test_outlier_pools_are_checked() -> None:
    kv, _, _ = random_paged_kv(PRESETS["fp8-o4"].with_block_size(16), [40], kv_heads=1, head_dim=64)
    q = torch.randn(1, 2, 64)
    with pytest.raises(ShapeError, match="k_outlier must be"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, k_outlier=kv.k_outlier.float()))
    with pytest.raises(ShapeError, match="come together"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, k_outlier_idx=None))
    bad = kv.k_outlier_idx.clone()
    bad[kv.block_tables[0, 0].long(), 0, 0] = 64  # a channel past head_dim in a block the sequence uses
    with pytest.raises(ShapeError, match="outside"):
        cpu_decode.decode_attention(q, dataclasses.replace(kv, k_outlier_idx=bad))


def test_the_compiled_kernel_names_the_ir_generators_source() -> None:
    """numba's disk cache follows ``cpu_decode_numba.py`` alone, so that file holds the SHA-256 of the module that
    generates its integer loops: an edit there must change the digest (which recompiles the kernel), or the
    cached kernel would keep the old loops. After editing ``cpu_decode_ir.py``, put this digest in
    ``cpu_decode_numba.IR_SOURCE_DIGEST``."""
    pytest.importorskip("numba")
    from kvpack.kernels import cpu_decode_numba

    digest = hashlib.sha256(Path(ir.__file__).read_bytes()).hexdigest()
    assert cpu_decode_numba.IR_SOURCE_DIGEST == digest, f"set cpu_decode_numba.IR_SOURCE_DIGEST = {digest!r}"


def test_integer_loops_are_valid_ir_for_every_isa() -> None:
    """The integer loops are LLVM IR text generated per code kind and instruction set, and this machine compiles
    only its own: every combination (VNNI, AVX-512 BW, portable) must parse and verify. Rows of one code per byte
    prefetch the block after next into L2 and the next one into L1 (locality 3); packed codes only the former.
    The value loop comes twice (one weight group per pass or several), except for 2-bit and fp8 codes."""
    from llvmlite import binding as llvm

    nbm = cpu_decode._nb()
    for kind in (nbm.S8, nbm.U8, nbm.U4, nbm.U2, nbm.E4M3, nbm.E5M2):
        for isa in ("vnni", "bw", "generic"):
            for gen in (ir._kdot_ir, ir._vdot_ir):
                text = gen(f"kvpack_test_{kind}_{isa}", kind, isa)
                llvm.parse_assembly(text).verify()
                one_per_byte = kind in (nbm.S8, nbm.U8, nbm.E4M3, nbm.E5M2)
                loops = 2 if (gen is ir._vdot_ir and kind in (nbm.S8, nbm.U8, nbm.U4)) else 1
                assert text.count("call void @llvm.prefetch.p0") == (2 if one_per_byte else 1) * loops
                assert (", i32 0, i32 3, i32 1)" in text) == one_per_byte


def test_key_loop_scores_match_numpy() -> None:
    """The generated key loop (int8 codes) gives each row's exact integer dot with the int16 query times the
    head's scale, for the rows asked for and no others, and each head's largest of them."""
    from numba import njit

    nbm = cpu_decode._nb()
    u64 = np.uint64

    @njit
    def scores(pay, q16, qinv, sc, mx, ngrp):
        nbm._kdot_int(nbm.S8, pay, u64(0), u64(128), ngrp, q16, 0, 4, qinv, 0, sc, 0, 64, 0, mx, 0, u64(0), u64(0))

    rng = np.random.default_rng(4)
    for ngrp in (16, 3):
        codes = rng.integers(-128, 128, (64, 128), dtype=np.int8)
        q16 = rng.integers(-32767, 32768, (4, 128), dtype=np.int16)
        qinv = rng.uniform(1e-5, 1e-3, 4).astype(np.float32)
        sc = np.full((4, 64), np.nan, np.float32)
        mx = np.full(5, np.nan, np.float32)
        scores(codes.view(np.uint8).ravel(), q16.ravel(), qinv, sc, mx, ngrp)
        rows = 4 * ngrp
        exact = q16.astype(np.int64) @ codes[:rows].T.astype(np.int64)  # [4, rows]
        want = (exact.astype(np.float32) * qinv[:, None]).astype(np.float32)
        np.testing.assert_allclose(sc[:, :rows], want, rtol=1e-6)
        assert np.isnan(sc[:, rows:]).all()  # nothing written past the rows asked for
        np.testing.assert_array_equal(mx[:4], sc[:, :rows].max(axis=1))  # each head's largest score, exactly
        assert np.isnan(mx[4])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_table_words_are_the_codes_values_on_a_12_bit_grid(dtype: torch.dtype) -> None:
    """The integer path's fp8 table: every finite code's word times the format's unit is its value within half
    a unit (the grid the tolerance is derived from), signs included; the largest code is the grid's top."""
    nbm = cpu_decode._nb()
    kind = nbm.E4M3 if dtype == torch.float8_e4m3fn else nbm.E5M2
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    table = ir._lut_table(kind)
    unit = ir._FP8_MAX[kind] / ir._LUT_MAX
    assert float(nbm._code_unit(kind)) == pytest.approx(unit, rel=1e-6)  # what the kernel multiplies by
    assert max(table) == ir._LUT_MAX and len(table) == 128
    for c in range(256):
        v = float(values[c])
        if not math.isfinite(v):
            continue
        assert ir._fp8_value(kind, c) == v
        word = -table[c & 127] if c & 128 else table[c & 127]
        assert abs(word * unit - v) <= 0.5 * unit * (1 + 1e-6), (c, v, word)


def test_next_block_rows_to_prefetch_into_l1() -> None:
    """Offset of the next block's rows (``_near_rows``): block id from the table times the pool's block stride
    (contiguous, or a larger page), 0 past the item's last block, for the null block and for rows
    under 128 bytes."""
    import numpy as np

    nbm = cpu_decode._nb()
    tables = np.array([[5, 9, 0, 7]], np.int32)
    kv_heads, h, bs, rs, t = 8, 3, 64, 128, 4
    p = np.zeros(nbm.N_PARAMS, np.int64)
    p[nbm.P_ROW], p[nbm.P_BST] = rs, kv_heads * bs * rs
    assert nbm._near_rows(tables, 0, 0, 4, p, h, bs, t) == ((9 * kv_heads + h) * bs + t) * rs
    page = kv_heads * bs * rs + 4096 + 64  # a block inside a larger page
    paged = p.copy()
    paged[nbm.P_BST] = page
    assert nbm._near_rows(tables, 0, 0, 4, paged, h, bs, t) == 9 * page + (h * bs + t) * rs
    assert nbm._near_rows(tables, 0, 0, 1, p, h, bs, t) == 0  # j + 1 is past the item
    assert nbm._near_rows(tables, 0, 1, 4, p, h, bs, t) == 0  # the next block is released
    short = p.copy()
    short[nbm.P_ROW] = 64
    assert nbm._near_rows(tables, 0, 0, 4, short, h, bs, t) == 0  # 64-byte rows: not worth it
