"""The Triton decode kernel over caches with full-precision sink positions (``PagedKV.sink_k`` / ``sink_v``).

Under the Triton interpreter (conftest.py). The expected output is built here, independent of whether the
reference knows sinks yet: the dequantized history (``reference.dense_history`` of the view without its
sink) with the first ``min(S, n_sealed)`` rows replaced by the sink rows, masked by ``start_pos`` and the
window, then a float64 softmax. Sink rows are fresh random rows (large keys, like a real attention sink),
unlike the block rows they stand for; the block copies of those rows are scrambled as well (payload bytes
of int formats, outlier residuals), so a kernel that read them, or skipped the sink, fails. Sink rows of a
sequence without a sealed block are NaN (never read), and every tensor sits in a poisoned guard region.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _triton_interpreter import fixed_interpreter
from kvpack.errors import ShapeError
from kvpack.formats import DType, parse_format
from kvpack.kernels import backend_reasons, reference
from kvpack.kernels import decode_attention as dispatch_decode
from kvpack.kernels import triton_decode as td
from kvpack.kernels.views import PagedKV
from kvpack.testing import assert_close, random_paged_kv, sink_attention_oracle
from test_kernel_triton import TOL, _guard_all, _guarded

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreter_fixes():
    with fixed_interpreter():
        yield


def _with_sink(kv: PagedKV, s: int, seed: int) -> PagedKV:
    """``kv`` with ``S = s`` random sink rows ``[batch, H, s, D]`` (NaN for sequences without a sealed block),
    and the block rows they replace scrambled (int payload bytes; outlier residuals)."""
    g = torch.Generator().manual_seed(seed)
    shape = (kv.batch, kv.kv_heads, s, kv.head_dim)
    sk = torch.randn(shape, generator=g) * 3
    sv = torch.randn(shape, generator=g) + 1
    short = kv.seq_lens < kv.block_size
    sk[short], sv[short] = float("nan"), float("nan")
    dt = kv.tail_k.dtype
    kv = replace(kv, sink_k=sk.to(dt), sink_v=sv.to(dt))
    first = kv.block_tables[~short, 0].long()  # block 0 of each sequence with a sealed block
    changes = {}
    for role, spec in (("k", kv.format.key), ("v", kv.format.value)):
        data = getattr(kv, f"{role}_data")
        if spec.dtype in (DType.INT8, DType.INT4, DType.INT2) and len(first):  # any byte is a finite code
            data = data.clone()
            rows = data[first, :, :s]
            data[first, :, :s] = torch.randint(0, 256, rows.shape, generator=g, dtype=torch.uint8).view(rows.dtype)
            changes[f"{role}_data"] = data
    if kv.k_outlier is not None and len(first):
        res = kv.k_outlier.clone()
        res[first, :, :s] = 300.0
        changes["k_outlier"] = res
    return replace(kv, **changes)


def _run(
    fmt_name: str,
    seq_lens: list[int],
    sink: int,
    *,
    group: int = 4,
    window: int | None = None,
    start_pos: list[int] | None = None,
    num_splits: int | None = None,
    q_dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> None:
    fmt = parse_format(f"{fmt_name},block=16")
    kv, _, _ = random_paged_kv(fmt, seq_lens, kv_heads=2, head_dim=64, tail_dtype=q_dtype, seed=seed)
    if start_pos is not None:
        kv = replace(kv, start_pos=torch.tensor(start_pos, dtype=torch.int32))
    kv = _guard_all(_with_sink(kv, sink, seed + 7))
    g = torch.Generator().manual_seed(seed + 1)
    q = _guarded(torch.randn(len(seq_lens), 2 * group, 64, generator=g).to(q_dtype))
    out = _guarded(torch.full_like(q, float("nan")))
    got = td.decode_attention(q, kv, window=window, out=out, num_splits=num_splits)
    expected = sink_attention_oracle(q.float(), kv, window)
    msg = f"{fmt_name} {seq_lens} S={sink} window={window} start={start_pos} splits={num_splits}"
    assert_close(got.float(), expected, *TOL[q_dtype], msg=msg)
    base, start = out._base, out.storage_offset()
    assert base[:start].isnan().all() and base[start + out.numel() :].isnan().all(), "a write outside the output"
    # the sink is really attended: without it, sequences whose sink positions are attended get another answer
    plain = td.decode_attention(q, replace(kv, sink_k=None, sink_v=None), window=window, num_splits=num_splits)
    lo = torch.zeros(len(seq_lens)) if start_pos is None else torch.tensor(start_pos).float()
    if window is not None:
        lo = torch.maximum(lo, torch.tensor(seq_lens).float() - window)
    used = (torch.tensor(seq_lens) >= 16) & (lo < sink)
    assert ((got.float() - plain.float()).abs().flatten(1).amax(1)[used] > 1e-2).all(), msg
    assert torch.equal(got[~used], plain[~used]), msg  # sink unused (short, or masked): the same bytes out


# ---- lengths: < B (no sealed block), exactly B, B + 1, several blocks; S = 1, a few, S = B


@pytest.mark.parametrize("sink", [1, 5, 16])
def test_sink_rows_replace_their_block_rows(sink):
    _run("int4", [15, 16, 17, 50], sink)


@pytest.mark.parametrize(("name", "sink"), [("fp8-plain", 3), ("fp8-o4", 1), ("fp8-o4", 16), ("kivi2", 2), ("int8", 4)])
def test_formats_with_a_sink(name, sink):
    _run(name, [16, 40, 9], sink, num_splits=2)


@pytest.mark.parametrize("sink", [2, 16])
def test_split_context_attends_the_sink_once(sink):
    _run("int4", [83, 16, 33], sink, num_splits=3)


def test_a_full_block_sink_never_reads_its_block():
    # S = B: block 0 is all sink, so the kernel skips it; NaN in its payload and scales would show otherwise
    kv, _, _ = random_paged_kv(parse_format("fp8-plain,block=16"), [40, 16], head_dim=64, tail_dtype=torch.float16)
    kv = _with_sink(kv, 16, seed=4)
    first = kv.block_tables[:, 0].long()
    changes = {}
    for name in ("k_data", "v_data", "k_scale", "v_scale"):
        t = getattr(kv, name).clone()
        t[first] = float("nan")
        changes[name] = t
    kv = replace(kv, **changes)
    q = torch.randn(2, 8, 64).half()
    expected = sink_attention_oracle(q.float(), kv, None)  # block 0's rows, NaN now, are all replaced by the sink rows
    assert expected.isfinite().all()
    for splits in (1, 2):
        assert_close(td.decode_attention(q, kv, num_splits=splits).float(), expected, *TOL[torch.float16])


# ---- masks by position: a window that excludes all or part of the sink, start_pos, both; GQA 1 and 8


@pytest.mark.parametrize("window", [20, 49, 64])
def test_window_masks_sink_positions(window):
    # window 20: no sink position of either sequence; 49: position 0 of the first one out, 1.. in; 64: all
    _run("int8", [50, 33], 4, window=window, num_splits=2)


@pytest.mark.parametrize(("start_pos", "window"), [([2, 0, 40], None), ([1, 30, 0], 40)])
def test_start_pos_masks_sink_positions(start_pos, window):
    # [2, 0, 40]: positions 2, 3 of the sink; all of it; nothing at all (start past the query: zeros)
    _run("int4", [50, 33, 40], 4, start_pos=start_pos, window=window, num_splits=2)


@pytest.mark.parametrize("group", [1, 8])
def test_gqa_with_a_sink(group):
    _run("int4", [37, 16], 3, group=group, num_splits=1)


def test_float32_queries_and_tail():
    _run("k4v2", [20, 65], 2, q_dtype=torch.float32, num_splits=2)


# ---- the dispatcher and bad input


def test_dispatcher_runs_the_triton_backend_on_a_sink():
    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [5, 40], head_dim=32)
    kv = _with_sink(kv, 2, seed=3)
    q = torch.randn(2, 4, 32)
    assert backend_reasons("triton", q, kv) == []
    assert_close(dispatch_decode(q, kv, backend="triton"), sink_attention_oracle(q, kv, None), *TOL[torch.float32])


def test_rotated_keys_with_a_sink_match_the_reference():
    # sink keys are stored rotated like the tail; the dispatcher rotates the query for the kernel
    fmt = parse_format("fp8,block=16,sink=3")
    kv, _, _ = random_paged_kv(fmt, [40, 7, 16], head_dim=64, tail_dtype=torch.float32, seed=5)
    assert kv.sink == 3 and kv.key_rotation is not None
    q = torch.randn(3, 4, 64)
    want = reference.decode_attention(q, kv, window=30)
    assert_close(dispatch_decode(q, kv, window=30, backend="triton"), want, *TOL[torch.float32])


def test_bad_sink_rows_raise_before_launch():
    kv, _, _ = random_paged_kv(parse_format("int8,block=16"), [20], head_dim=32)
    q = torch.randn(1, 4, 32)
    good = _with_sink(kv, 2, seed=3)
    with pytest.raises(ShapeError, match="both"):
        td.decode_attention(q, replace(good, sink_v=None))
    with pytest.raises(ShapeError, match="the tail dtype"):
        td.decode_attention(q, replace(good, sink_k=good.sink_k.half(), sink_v=good.sink_v.half()))
    with pytest.raises(ShapeError, match="sink_v must be"):
        td.decode_attention(q, replace(good, sink_v=good.sink_v[:, :, :1].contiguous()))
    with pytest.raises(ShapeError, match="at most one block"):
        td.decode_attention(q, _with_sink(kv, 17, seed=3))
