"""The fused CPU kernel over caches with full-precision sink positions (``PagedKV.sink_k``).

The expected output is :func:`kvpack.testing.sink_attention_oracle`, independent of how the reference implements
sinks: the dequantized history with the first ``min(S, n_sealed)`` rows replaced by the sink rows, masked by
``start_pos`` and the window, then a float64 softmax. The sink rows differ from the block rows they stand
for, so a kernel that read the block rows (or skipped the sink) fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpack.errors import ShapeError
from kvpack.formats import parse_format
from kvpack.kernels import cpu_decode, decode_attention
from kvpack.testing import INT_PATH_TOL, assert_close, cpu_kernel_tolerance, random_paged_kv, sink_attention_oracle

pytest.importorskip("numba")

TOL = INT_PATH_TOL  # the integer path's tolerance (tests/test_kernel_cpu.py derives it); float path is tighter


def _tol(kv) -> tuple[float, float]:
    """:data:`TOL`, or wider where the integer path reads fp8 codes."""
    return cpu_kernel_tolerance(kv, TOL)


@pytest.fixture(params=["int", "float"])
def path(request, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(cpu_decode, "INT_DOT", request.param == "int")
    return request.param


def _with_sink(kv, s: int, seed: int = 1, start_pos=None):
    g = torch.Generator().manual_seed(seed)
    shape = (kv.batch, kv.kv_heads, s, kv.head_dim)
    sk = (torch.randn(shape, generator=g) * 3).to(kv.tail_k.dtype)  # unlike the block rows: large and fresh
    sv = torch.randn(shape, generator=g).to(kv.tail_v.dtype)
    return dataclasses.replace(kv, sink_k=sk, sink_v=sv, start_pos=start_pos)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8-plain", "fp8-o4", "kivi2"])
@pytest.mark.parametrize("sink", [1, 16])
def test_sink_rows_replace_their_block_rows(path: str, fmt: str, sink: int) -> None:
    f = parse_format(fmt).with_block_size(16)
    seq_lens = [15, 16, 53, 1, 40]  # no sealed block, exactly one, several, a lone token, tail
    kv, _, _ = random_paged_kv(f, seq_lens, kv_heads=2, head_dim=64, seed=3)
    kv = _with_sink(kv, sink)
    q = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(5))
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, backend="cpu", out=out)
    assert_close(out, sink_attention_oracle(q, kv, None), *_tol(kv))
    # the sink really is read: the same cache without it gives another answer where a block is sealed
    plain = decode_attention(q, dataclasses.replace(kv, sink_k=None, sink_v=None), backend="cpu")
    sealed = torch.tensor([n >= 16 for n in seq_lens])
    assert (out[sealed] - plain[sealed]).abs().amax() > 1e-2
    assert torch.equal(out[~sealed], plain[~sealed])


@pytest.mark.parametrize("window", [None, 40, 20])
def test_sink_with_window_and_left_padding(path: str, window: int | None) -> None:
    f = parse_format("int4").with_block_size(16)
    seq_lens = [70, 64, 33]
    kv, _, _ = random_paged_kv(f, seq_lens, kv_heads=3, head_dim=64, seed=7)
    kv = _with_sink(kv, 4, start_pos=torch.tensor([0, 2, 5], dtype=torch.int32))
    q = torch.randn(3, 3, 64, generator=torch.Generator().manual_seed(8))  # GQA 1
    assert_close(decode_attention(q, kv, backend="cpu", window=window), sink_attention_oracle(q, kv, window), *_tol(kv))


def test_long_sequence_split_into_chunks_keeps_one_sink() -> None:
    # long enough that the kernel splits the sequence across work items: the sink is merged once
    f = parse_format("int8")
    kv, _, _ = random_paged_kv(f, [64 * 40 + 7], kv_heads=1, head_dim=128, seed=11)
    kv = _with_sink(kv, 2)
    q = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(12)) * 2
    assert_close(decode_attention(q, kv, backend="cpu"), sink_attention_oracle(q, kv, None), *_tol(kv))


def test_bad_sink_rows_are_refused() -> None:
    kv, _, _ = random_paged_kv(parse_format("int8").with_block_size(16), [20], kv_heads=2, head_dim=64)
    q = torch.randn(1, 2, 64)
    good = _with_sink(kv, 2)
    with pytest.raises(ShapeError, match="sink_k and sink_v"):
        cpu_decode.decode_attention(q, dataclasses.replace(good, sink_v=None))
    with pytest.raises(ShapeError, match="S <= block_size"):
        cpu_decode.decode_attention(q, _with_sink(kv, 17))
    with pytest.raises(ShapeError, match="the tail dtype"):
        cpu_decode.decode_attention(q, dataclasses.replace(good, sink_k=good.sink_k.half(), sink_v=good.sink_v.half()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sink_rows_and_output_in_the_models_dtype(dtype: torch.dtype) -> None:
    """A 16-bit model (its tails and sink rows in its dtype): the kernel reads its 16-bit sink rows and writes its
    16-bit output itself; the output is the float32 computation over the same (exactly widened) rows, rounded once
    to the model's dtype."""
    f = parse_format("int8").with_block_size(16)
    seq_lens = [15, 16, 53, 40]
    kv, _, _ = random_paged_kv(f, seq_lens, kv_heads=2, head_dim=64, seed=3)
    kv = _with_sink(kv, 1)
    low = dataclasses.replace(kv, **{n: getattr(kv, n).to(dtype) for n in ("tail_k", "tail_v", "sink_k", "sink_v")})
    wide = dataclasses.replace(kv, **{n: getattr(low, n).float() for n in ("tail_k", "tail_v", "sink_k", "sink_v")})
    q = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = decode_attention(q.float(), wide, backend="cpu")  # float32 all through, the same rows
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, low, backend="cpu", out=out)
    assert got is out and got.dtype == dtype
    assert torch.equal(got, want.to(dtype))
    fresh = decode_attention(q, low, backend="cpu")  # no out: a new tensor in q's dtype, the same values
    assert fresh.dtype == dtype and torch.equal(fresh, got)
    strided = torch.full((len(seq_lens), 16, 64), float("nan"), dtype=dtype)[:, ::2]  # out not contiguous
    assert torch.equal(decode_attention(q, low, backend="cpu", out=strided), got) and torch.equal(strided, got)
