"""The fused CPU chunk kernel (many queries per sequence) against the torch reference, on poisoned, shuffled
random paged caches, and the chunk dispatcher.

Tolerance: both paths read the same stored bytes. The kernel's scores keep float32 accuracy (keys and query
split into two bfloat16 parts, relative error ~2**-16), but it rounds the attention weights and the values
to bfloat16 once each (relative 2**-9 = 2.0e-3 per element, float32 sums). Where one position dominates a
row, an output element moves by up to ~2e-3 of its value (the weight's rounding cancels against the row sum,
the value's does not): ~9e-3 at |v| = 4.5, more for the sink rows (3x larger values on these caches); where
many positions mix, less (random signs). Measured over the preset cases: errors up to 2.7e-2 absolute, at
most 0.53 of the bound ``TOL`` = atol 1.2e-2 + rtol 1e-2 * |expected|. For comparison, the int8 cache's own
value error is max |v| / 254 per element (~1e-2 at |v| = 3).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import kvpack.kernels as K
from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import PRESETS
from kvpack.kernels import cpu_chunk, reference
from kvpack.testing import CPU_CHUNK_TOL, assert_close, random_paged_kv

pytest.importorskip("numba")

TOL = CPU_CHUNK_TOL
HALF_TOL = {torch.bfloat16: (3e-2, 2e-2), torch.float16: (1.5e-2, 1e-2)}


def _check(kv, q, *, window=None, sm_scale=None, tol=TOL, msg=""):
    """The kernel (through the dispatcher, forced to the CPU: rotated keys need it) into a NaN-poisoned buffer
    against the reference."""
    out = torch.full_like(q, float("nan"))
    res = K.chunk_attention(q, kv, sm_scale=sm_scale, window=window, backend="cpu", out=out)
    assert res is out
    ref = reference.paged_attention_reference(q, kv, sm_scale, window)
    assert_close(out, ref, *tol, msg=f"{kv.format.name} T={q.shape[1]} window={window} {msg}")
    return out, ref


def _q(kv, t, group, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kv.batch, t, kv.kv_heads * group, kv.head_dim, generator=g).to(dtype)


# Every preset (with its default sink of one position, and fp8's rotated keys, and the -o4 outlier channels)
# meets a block size, GQA ratio, head_dim and chunk length; histories end inside a block.
PRESET_CASES = [
    ("fp16", 16, 1, 64, 7),
    ("bf16", 32, 4, 128, 2),
    ("fp8", 64, 4, 128, 65),
    ("fp8-plain", 64, 8, 64, 7),
    ("fp8_e5m2", 16, 4, 128, 1),
    ("fp8-o4", 32, 1, 64, 64),
    ("int8", 16, 4, 64, 7),
    ("int8", 64, 1, 256, 65),
    ("int4", 32, 8, 128, 7),
    ("int4", 16, 4, 256, 2),
    ("int4-o4", 64, 4, 128, 7),
    ("k8v4", 64, 4, 128, 64),
    ("k4v2", 16, 8, 64, 7),
    ("kivi2", 32, 4, 64, 65),
    ("kivi2", 64, 1, 128, 7),
    ("int4-g32", 64, 4, 64, 7),
    # head_dims that g32 does not divide (Phi-2's 80, 120): narrower groups of whole 4-channel runs
    ("int4", 32, 4, 80, 7),
    ("int4-o4", 16, 2, 80, 65),
    ("kivi2", 16, 1, 120, 7),
    ("fp8", 32, 4, 80, 2),
]


@pytest.mark.parametrize("name,block,group,head_dim,t", PRESET_CASES)
def test_presets_match_reference(name: str, block: int, group: int, head_dim: int, t: int) -> None:
    fmt = PRESETS[name].with_block_size(block)
    lens = [t + 5, t + 2 * block + 3, 3 * block + t + block // 2 + 1]
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=head_dim, seed=block + group + t)
    assert (kv.k_outlier is not None) == name.endswith("-o4") and (kv.key_rotation is not None) == (name == "fp8")
    assert kv.sink == (0 if fmt.is_passthrough else 1)
    _check(kv, _q(kv, t, group, seed=t))


@pytest.mark.parametrize("name", ["int8", "int4,sink=0", "kivi2,sink=4"])
@pytest.mark.parametrize("t", [1, 2, 7, 64, 65])
def test_chunk_lengths(name: str, t: int) -> None:
    from kvpack.formats import parse_format

    fmt = parse_format(name)
    kv, _, _ = random_paged_kv(fmt, [t, t + 70, t + 199], kv_heads=2, head_dim=64, seed=t)
    _check(kv, _q(kv, t, 4, seed=t))


@pytest.mark.parametrize(
    "name,head_dim",
    [("k=int4:channel:asym:o6r,v=int4:g32:asym,sink=1", 64), ("k=int4:channel:o5r,v=int8:token,block=32", 80)],
)
def test_refined_outlier_channels_match_reference(name: str, head_dim: int) -> None:
    """Refinement codes (4 bits per kept element on its channel's scale step, two per byte, an odd count
    leaving half a byte) are read in the chunk kernel as the reference reads them, and they matter."""
    from kvpack.formats import parse_format

    fmt = parse_format(name)
    kv, _, _ = random_paged_kv(fmt, [9, 2 * fmt.block_size + 7, 150], kv_heads=2, head_dim=head_dim, seed=3)
    assert kv.k_outlier.dtype == torch.uint8 and kv.k_outlier.shape[-1] == (fmt.key.outliers + 1) // 2
    q = _q(kv, 7, 4, seed=7)
    _check(kv, q)
    plain = dataclasses.replace(kv, k_outlier=torch.full_like(kv.k_outlier, 0x88))  # zero residuals
    assert (reference.chunk_attention(q, plain) - reference.chunk_attention(q, kv)).abs().max() > 1e-2


def test_chunk_of_512_over_a_longer_history() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"], [512 + 77, 700], kv_heads=1, head_dim=64, seed=5)
    _check(kv, _q(kv, 512, 4))


@pytest.mark.parametrize("window", [1, 17, 64, 200])
def test_sliding_window(window: int) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(32), [9, 40, 130, 257], kv_heads=2, seed=window)
    _check(kv, _q(kv, 9, 4), window=window)


def test_window_over_released_blocks_reads_them_as_the_reference_does() -> None:
    """Blocks before the window of the chunk's first query are released (id 0, the poisoned null block):
    never read; the reference reads their positions as zeros, and only rows that attend none of them see no
    difference. Here the window keeps every row off them."""
    fmt = PRESETS["int8"].with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [150, 97], kv_heads=2, seed=3)
    t, window = 5, 30
    tables = kv.block_tables.clone()
    for b, n in enumerate(kv.seq_lens.tolist()):
        first = max(n - t - window + 1, 0) // 16  # the first block the chunk's first query attends
        tables[b, :first] = 0
    kv = dataclasses.replace(kv, block_tables=tables)
    _check(kv, _q(kv, t, 2), window=window)


def test_left_padding_and_fully_masked_rows() -> None:
    kv, _, _ = random_paged_kv(PRESETS["k8v4"].with_block_size(16), [40, 80, 75], kv_heads=2, seed=2)
    # sequence 1 starts 3 positions before its last: the chunk's first 4 queries attend nothing
    kv = dataclasses.replace(kv, start_pos=torch.tensor([0, 77, 20], dtype=torch.int32))
    out, _ = _check(kv, _q(kv, 7, 4))
    assert torch.equal(out[1, :4], torch.zeros_like(out[1, :4])) and out[1, 4:].abs().sum() > 0
    _check(kv, _q(kv, 7, 4), window=9, msg="window and start_pos together")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries(dtype: torch.dtype) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(32), [70, 100], kv_heads=2, head_dim=128, seed=9)
    q = _q(kv, 7, 4, dtype=dtype)
    out, _ = _check(kv, q, tol=HALF_TOL[dtype])
    assert out.dtype == dtype


def test_half_precision_tails_and_sm_scale() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int4"], [100, 150], kv_heads=2, tail_dtype=torch.float16, seed=4)
    _check(kv, _q(kv, 7, 2), sm_scale=0.3)


def test_strided_pools_give_the_contiguous_result() -> None:
    from test_kernel_cpu_strided import _strided

    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(32), [70, 129], kv_heads=2, head_dim=64, seed=6)
    skv, _ = _strided(kv)
    q = _q(kv, 7, 4)
    a = K.chunk_attention(q, kv, backend="cpu")
    b = K.chunk_attention(q, skv, backend="cpu")
    assert torch.equal(a, b)
    assert_close(b, reference.paged_attention_reference(q, kv), *TOL)


def test_bad_input_is_refused() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [10, 40], kv_heads=2, seed=0)
    with pytest.raises(ShapeError, match="append the chunk first"):
        cpu_chunk.chunk_attention(_q(kv, 11, 2), kv)
    with pytest.raises(ShapeError, match="q must be"):
        cpu_chunk.chunk_attention(torch.randn(2, 3, 3, 64), kv)
    with pytest.raises(ShapeError, match="out must be"):
        cpu_chunk.chunk_attention(_q(kv, 3, 2), kv, out=torch.empty(2, 3, 4, 32))
    # the contents are checked inside the compiled call, before it writes anything: out keeps its poison
    out = torch.full((2, 3, 4, 64), 7.0)
    bad = kv.block_tables.clone()
    bad[1, 0] = 10_000
    with pytest.raises(ShapeError, match="outside"):
        cpu_chunk.chunk_attention(_q(kv, 3, 2), dataclasses.replace(kv, block_tables=bad), out=out)
    bad[1, 0] = -1
    with pytest.raises(ShapeError, match="outside"):
        cpu_chunk.chunk_attention(_q(kv, 3, 2), dataclasses.replace(kv, block_tables=bad), out=out)
    with pytest.raises(ShapeError, match="too few for seq_len 40"):  # 40 tokens: 2 sealed blocks of 16, 1 column
        cpu_chunk.chunk_attention(_q(kv, 3, 2), dataclasses.replace(kv, block_tables=kv.block_tables[:, :1]), out=out)
    with pytest.raises(ShapeError, match="append the chunk first"):
        cpu_chunk.chunk_attention(_q(kv, 11, 2), kv, out=torch.full((2, 11, 4, 64), 7.0))
    assert bool((out == 7.0).all())
    rot = random_paged_kv(PRESETS["fp8"], [70], kv_heads=2, seed=0)[0]
    with pytest.raises(UnsupportedError, match="rotated"):
        cpu_chunk.chunk_attention(_q(rot, 3, 2), rot)


# ----------------------------------------------------------------------------------------------------
# The dispatcher


def test_auto_picks_the_cpu_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"], [80], kv_heads=2, seed=1)
    q = _q(kv, 5, 2)
    assert K.choose_backend(q, kv, None, "auto", chunk=True) == "cpu"
    calls = []
    real = cpu_chunk.chunk_attention
    monkeypatch.setattr(cpu_chunk, "chunk_attention", lambda *a: calls.append(1) or real(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.chunk_attention(q, kv)
    assert calls == [1]


def test_auto_falls_back_to_the_reference_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int4"], [80], kv_heads=2, seed=1)
    q = _q(kv, 5, 2)
    monkeypatch.setattr(cpu_chunk, "reasons_unsupported", lambda q, kv, window: ["a reason only this test has"])
    monkeypatch.setattr(K, "_warned", set())
    with pytest.warns(RuntimeWarning, match="a reason only this test has"):
        out = K.chunk_attention(q, kv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        again = K.chunk_attention(q, kv)
    ref = reference.paged_attention_reference(q, kv)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    with pytest.raises(UnsupportedError, match="a reason only this test has"):
        K.chunk_attention(q, kv, backend="cpu")


def test_missing_or_unknown_backends_give_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"], [80], kv_heads=2, seed=1)
    q = _q(kv, 5, 2)
    missing = dataclasses.replace(K.BACKENDS["triton"], chunk_module="kvpack.kernels.no_such_chunk_module")
    monkeypatch.setitem(K.BACKENDS, "triton", missing)
    reasons = K.backend_reasons("triton", q, kv, None, chunk=True)
    assert len(reasons) == 1 and "not installed" in reasons[0]
    with pytest.raises(UnsupportedError, match="not installed"):
        K.chunk_attention(q, kv, backend="triton")
    with pytest.raises(UnsupportedError, match="unknown backend"):
        K.chunk_attention(q, kv, backend="tpu")
    assert torch.equal(K.chunk_attention(q, kv, backend="reference"), reference.paged_attention_reference(q, kv))


def test_reference_backend_writes_into_out() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"], [80], kv_heads=2, seed=1)
    q = _q(kv, 5, 2)
    out = torch.full_like(q, float("nan"))
    assert reference.chunk_attention(q, kv, None, None, out) is out
    assert torch.equal(out, reference.paged_attention_reference(q, kv))


# The matrix product has three builds (the AMX tile unit, vdpbf16ps, float32 FMAs), chosen from numba's target
# features when the kernel compiles; this process runs the host's. The others run in a child process whose
# numba target drops the units (NUMBA_CPU_FEATURES), each against the reference on three presets.
_VARIANT_CHILD = """
import sys
import torch
from kvpack.formats import PRESETS
from kvpack.kernels import cpu_chunk, reference
from kvpack.testing import CPU_CHUNK_TOL, assert_close, random_paged_kv

print(cpu_chunk._nb().variant())
for name, t in (("int8", 65), ("int4", 7), ("fp8", 64)):
    fmt = PRESETS[name].with_block_size(32)
    kv, _, _ = random_paged_kv(fmt, [t + 3, t + 70], kv_heads=2, head_dim=128, seed=t)
    q = torch.randn(2, t, 8, 128, generator=torch.Generator().manual_seed(t))
    out = torch.full_like(q, float("nan"))
    from kvpack import kernels as K
    K.chunk_attention(q, kv, backend="cpu", out=out)
    assert_close(out, reference.paged_attention_reference(q, kv), *CPU_CHUNK_TOL, msg=name)
"""


def _without(feats: set[str], *units: str) -> str:
    return ",".join(sorted(f"-{f[1:]}" if f[1:] in units else f for f in feats if f))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "fma"])
def test_every_build_of_the_product_matches_reference(variant: str) -> None:
    import os
    import subprocess
    import sys

    nbm = cpu_chunk._nb()
    feats = nbm._features()
    if variant == nbm.variant():
        pytest.skip(f"{variant} is this process's build (covered by every other test here)")
    if variant == "bf16" and "+avx512bf16" not in feats:
        pytest.skip("this CPU has no vdpbf16ps")
    drop = ("amx-tile", "amx-bf16", "amx-int8") + (("avx512bf16",) if variant == "fma" else ())
    env = dict(os.environ, NUMBA_CPU_FEATURES=_without(feats, *drop))
    res = subprocess.run([sys.executable, "-c", _VARIANT_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[0] == variant
