"""Several positions of a sequence as query heads of one CPU decode call (``tail_cut``): a token and its drafts read
the sealed blocks once, each position its own history; every head equals the reference at its own position, and
bad cuts are refused before anything runs."""

import dataclasses

import pytest
import torch

from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import parse_format
from kvpack.kernels import decode_positions, run_backend
from kvpack.kernels import reference as ref
from kvpack.testing import assert_close, cpu_kernel_tolerance, random_paged_kv

pytest.importorskip("numba")

H, G, D, T = 2, 3, 64, 4
LENS = [40, 20, 70, 5, 33, 16]  # tails of 8, 4, 6, 5 (no sealed block), 1 and 0 rows at block 16


def _cuts(lens: list[int], block: int) -> torch.Tensor:
    """``[batch, T]``: position ``t`` is ``T - 1 - t`` places before the last, as far as the tail (and the
    sequence) reaches."""
    return torch.tensor([[min(T - 1 - t, n % block, n - 1) for t in range(T)] for n in lens], dtype=torch.int32)


@pytest.mark.parametrize(
    ("name", "tail_dtype"),
    [("int8", torch.float32), ("int4", torch.bfloat16), ("fp8", torch.float32), ("k4v2", torch.float32),
     ("int4-o4", torch.float32), ("kv=fp16", torch.float16), ("int8,sink=0", torch.float32)],
)  # fmt: skip
def test_positions_as_heads_match_the_reference_at_each_position(name, tail_dtype):
    fmt = parse_format(name).with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, LENS, kv_heads=H, head_dim=D, tail_dtype=tail_dtype, seed=4)
    cut = _cuts(LENS, 16)
    q = torch.randn(len(LENS), T, H * G, D, generator=torch.Generator().manual_seed(1))
    got = decode_positions(q, kv, cut)  # [batch, T, H * G, D]: the positions as heads of one call
    for t in range(T):
        at = dataclasses.replace(kv, seq_lens=kv.seq_lens - cut[:, t])
        expected = ref.decode_attention(q[:, t], at, None, None, None)
        assert_close(got[:, t], expected, *cpu_kernel_tolerance(kv), f"{name} t={t}")


def test_cuts_that_reach_past_the_tail_or_do_not_fit_are_refused():
    fmt = parse_format("int8").with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, LENS, kv_heads=H, head_dim=D, seed=4)
    q = torch.randn(len(LENS), H * 2 * G, D)
    ok = torch.zeros(len(LENS), 2 * G, dtype=torch.int32)
    run_backend("cpu", q, kv, tail_cut=ok)
    past = ok.clone()
    past[0, 0] = 9  # 40 tokens: 8 tail rows; 9 places back is in a sealed block
    with pytest.raises(ShapeError, match="tail_cut must lie"):
        run_backend("cpu", q, kv, tail_cut=past)
    before_start = ok.clone()
    before_start[3, 1] = 5  # 5 tokens: 5 places before the last is no position
    with pytest.raises(ShapeError, match="tail_cut must lie"):
        run_backend("cpu", q, kv, tail_cut=before_start)
    with pytest.raises(ShapeError, match="tail_cut must be"):
        run_backend("cpu", q, kv, tail_cut=ok[:, :G])
    with pytest.raises(ShapeError, match="tail_cut must be"):
        run_backend("cpu", q, kv, tail_cut=ok.long())
    with pytest.raises(ShapeError, match="window"):
        run_backend("cpu", q, kv, window=8, tail_cut=ok)
    with pytest.raises(UnsupportedError, match="CPU kernel option"):
        run_backend("reference", q, kv, tail_cut=ok)
    with pytest.raises(ShapeError, match="decode_positions takes"):
        decode_positions(q.view(len(LENS), 2, H * G, D), kv, ok)  # cut [batch, T * G] for T = 2
