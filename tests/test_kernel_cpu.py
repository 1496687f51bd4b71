"""The fused CPU decode kernel against the torch reference, on poisoned, shuffled random paged caches.

Tolerances: both paths read the same stored bytes and accumulate in float32, so they differ only by
summation order: float32 queries get atol 2e-4 / rtol 2e-3; half-precision queries and outputs get the
rounding of that dtype on top (atol/rtol 2e-2 for bf16, 5e-3 for fp16).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import kvpack.kernels as K
from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import PRESETS, ScaleDType, parse_format
from kvpack.kernels import cpu, reference
from kvpack.testing import assert_close, random_paged_kv

TOL = {torch.float32: (2e-4, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def _lengths(b: int) -> list[int]:
    """The odd lengths that matter for block size ``b``: 1, b - 1, b + 1 and several blocks plus a tail."""
    return [1, b - 1, b + 1, 3 * b + 5]


def _check(kv, q, *, window=None, sm_scale=None, tol=None):
    """Run the kernel into a NaN-poisoned buffer and compare with the reference."""
    out = torch.full_like(q, float("nan"))
    res = cpu.decode_attention(q, kv, sm_scale, window, out)
    assert res is out
    ref = reference.decode_attention(q, kv, sm_scale, window)
    atol, rtol = tol or TOL[q.dtype]
    assert_close(out, ref, atol, rtol, msg=f"{kv.format.name} window={window}")
    return out, ref


# Pairwise rather than cartesian: every preset meets every block size, GQA ratio and head_dim at least once.
PRESET_CASES = [
    ("fp16", 16, 1, 64),
    ("bf16", 32, 4, 128),
    ("fp8", 64, 8, 64),
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
]


@pytest.mark.parametrize("name,block,group,head_dim", PRESET_CASES)
def test_presets_match_reference(name: str, block: int, group: int, head_dim: int) -> None:
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
]


@pytest.mark.parametrize("spec", CUSTOM)
def test_custom_formats_match_reference(spec: str) -> None:
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
def test_sliding_window(name: str, window: int) -> None:
    fmt = PRESETS[name].with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [3, 40, 130, 257], kv_heads=2, head_dim=64, seed=window)
    q = torch.randn(kv.batch, 4, 64)
    _check(kv, q, window=window)


def test_window_with_released_blocks() -> None:
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


def test_left_padding_start_pos() -> None:
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
    monkeypatch.setattr(cpu, "MIN_CHUNK_TOKENS", 64)
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [3001], kv_heads=1, head_dim=64, seed=2)
    items, first = cpu._nb().plan(kv.seq_lens.numpy(), torch.zeros(1, dtype=torch.int32).numpy(), -1, 16, 1, 8, 4)
    assert len(items) > 1 and first[-1] == len(items)
    q = torch.randn(1, 4, 64)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(kv, q)
    finally:
        torch.set_num_threads(old)


def test_sm_scale_and_fresh_output() -> None:
    kv, _, _ = random_paged_kv(PRESETS["fp8"].with_block_size(32), [45, 64], kv_heads=1, head_dim=128, seed=9)
    q = torch.randn(2, 2, 128)
    _check(kv, q, sm_scale=0.3)
    fresh = cpu.decode_attention(q, kv)  # no out buffer: a new tensor in q.dtype
    assert fresh.shape == q.shape and fresh.dtype == q.dtype
    assert_close(fresh, reference.decode_attention(q, kv), *TOL[torch.float32])


# ----------------------------------------------------------------------------------------------------
# Capabilities, dispatch and bad input


def test_reasons_unsupported_lists_why() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [20], kv_heads=1, head_dim=64)
    assert cpu.reasons_unsupported(torch.randn(1, 2, 64), kv) == []
    reasons = cpu.reasons_unsupported(torch.randn(1, 2, 64, dtype=torch.float64), kv)
    assert any("float64" in r for r in reasons)
    per_channel_int4_values = parse_format("k=int8,v=int4:channel:asym").with_block_size(16)
    kv4, _, _ = random_paged_kv(per_channel_int4_values, [20], kv_heads=1, head_dim=64)
    reasons = cpu.reasons_unsupported(torch.randn(1, 2, 64), kv4)
    assert len(reasons) == 1 and "values" in reasons[0] and "g16" in reasons[0]


def test_auto_backend_picks_cpu_without_warning() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(16), [20, 33], kv_heads=2, head_dim=64)
    q = torch.randn(2, 4, 64)
    assert K.choose_backend(q, kv) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = K.decode_attention(q, kv)
    assert_close(out, reference.decode_attention(q, kv), *TOL[torch.float32])


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
        cpu.decode_attention(torch.randn(2, 3, 64), kv)
    with pytest.raises(ShapeError, match="out must be"):
        cpu.decode_attention(q, kv, out=torch.empty(2, 4, 64, dtype=torch.float64))
    bad_tables = kv.block_tables.clone()
    bad_tables[0, 0] = kv.k_data.shape[0]
    with pytest.raises(ShapeError, match="outside"):
        cpu.decode_attention(q, dataclasses.replace(kv, block_tables=bad_tables))
    with pytest.raises(ShapeError, match="at least one token"):
        cpu.decode_attention(q, dataclasses.replace(kv, seq_lens=torch.tensor([0, 40], dtype=torch.int32)))
    with pytest.raises(ShapeError, match="payload dtype"):
        cpu.decode_attention(q, dataclasses.replace(kv, k_data=kv.k_data.view(torch.uint8)))
    with pytest.raises(ShapeError, match="key scale"):
        cpu.decode_attention(q, dataclasses.replace(kv, k_scale=None))


def test_kind_tables_match_the_compiled_module() -> None:
    nbm = cpu._nb()
    assert cpu._SCALE_KIND[ScaleDType.FP32] == nbm.SC_F32
    assert cpu._SCALE_KIND[ScaleDType.FP16] == nbm.SC_F16
    assert cpu._SCALE_KIND[ScaleDType.BF16] == nbm.SC_BF16
    assert cpu._SCALE_KIND[ScaleDType.E8M0] == nbm.SC_E8M0
    assert cpu._FLOAT_KIND == {torch.float16: nbm.FK_F16, torch.bfloat16: nbm.FK_BF16, torch.float32: nbm.FK_F32}
