"""The fused CPU chunk backend: many queries per sequence (a prefill chunk, the question after a cached
document, prefix-cache hits, draft verification) over the paged cache, without dequantizing the history.

The compiled loops live in :mod:`kvpack.kernels.cpu_chunk_numba` (imported on first use, so ``import kvpack``
never pulls in numba). The view is checked and turned into numba arguments by the decode backend's
preparation (:mod:`kvpack.kernels.cpu_decode`: the same checks, spec vectors, block-strided pools read in place,
outlier pools), so both backends accept exactly the same views. Every format the decode backend takes is
covered, on one float path (bfloat16 products with float32 sums, on the AMX tile unit where the CPU has one,
see the numba module); there is no integer path here.

Threads: numba's (``prange`` over sequence x kv head x row tile), as many as ``torch.get_num_threads()``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvpack.errors import ShapeError
from kvpack.kernels import cpu_decode
from kvpack.kernels.views import PagedKV, refuse_rotated

__all__ = [
    "ROWS_PER_TILE",
    "STEP_TOKENS",
    "chunk_attention",
    "reasons_unsupported",
    "scratch_bytes",
]

_LOG2E = 1.4426950408889634
# Query rows (t * G + g) per work item: each sealed block is dequantized once per item, so more rows share
# one dequantization (a 512-token chunk over 4k, 32 q / 8 kv heads: 384 rows took 1.3x the time of 1024, 192 rows
# 1.7x); fewer leave more items for the threads. Rows are padded to the product's row tile (6, or 32 on AMX).
ROWS_PER_TILE = 1024
# Positions per softmax step (whole blocks, at least one): one rescale per step; the scores and weights are held
# for one register tile of rows at a time, so 1024 rows x 256 positions need ~1.8 MiB of scratch per thread.
STEP_TOKENS = 256


@lru_cache(maxsize=1)
def _nb() -> Any:
    cpu_decode.passive_pool()
    from kvpack.kernels import cpu_chunk_numba

    return cpu_chunk_numba


def reasons_unsupported(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """Why the CPU chunk kernel cannot run this case (empty list: it can): those of the decode backend
    (:func:`kvpack.kernels.cpu_decode.reasons_unsupported`: numba, devices, dtypes, packed int4/int2 layouts)."""
    reasons = cpu_decode.reasons_unsupported(q, kv, window)
    if not reasons:
        nbm = _nb()
        if nbm.target_has_amx() and not nbm.amx_permitted():
            reasons.append(
                "the CPU has AMX but the OS refused this process the tile registers (Linux 5.16+ grants them); "
                "set NUMBA_CPU_FEATURES without +amx-tile to run the chunk kernel on AVX-512"
            )
    return reasons


def spec_vector(p: np.ndarray) -> np.ndarray:
    """The chunk kernel's spec vector (``cpu_chunk_numba.C_*``) from the decode kernel's (``cpu_decode_numba.P_*``). Both
    kernels use :mod:`kvpack.kernels.lowering`'s codes (checked by ``tests/test_lowering.py``), so the fields are
    copied as they are."""
    d, c = cpu_decode._nb(), _nb()
    out = np.zeros(c.N_SPEC, np.int64)
    for src, dst in ((d.P_KIND, c.C_KIND), (d.P_FK, c.C_FK), (d.P_SKIND, c.C_SKIND), (d.P_ZKIND, c.C_ZKIND),
                     (d.P_OFF, c.C_OFF), (d.P_PER, c.C_PER), (d.P_HS, c.C_HS), (d.P_TS, c.C_TS), (d.P_CS, c.C_CS),
                     (d.P_ROW, c.C_ROW), (d.P_BST, c.C_BST), (d.P_SBST, c.C_SBST), (d.P_ZBST, c.C_ZBST),
                     (d.P_NOUT, c.C_NOUT), (d.P_IDX16, c.C_IDX16), (d.P_OBST, c.C_OBST),
                     (d.P_IBST, c.C_IBST), (d.P_REF, c.C_REF)):  # fmt: skip
        out[dst] = p[src]
    return out


def _step_blocks(block_size: int) -> int:
    return max(1, STEP_TOKENS // block_size)


def scratch_bytes(kv: PagedKV, t: int, group: int, threads: int | None = None) -> int:
    """Bytes of scratch the kernel allocates at most at once for ``t`` queries of ``group`` heads per kv
    head: one work item's tiles per thread (queries and accumulators of its rows, the scores and weights of one
    register tile of rows, the step's keys and values in float32 and as bfloat16 words), independent of the
    history's length."""
    nbm = _nb()
    threads = threads or max(1, torch.get_num_threads())
    rows = min(ROWS_PER_TILE, t * group)
    mr = nbm.AMX_MR if nbm.variant() == "amx" else nbm.MR
    rp = -(-rows // mr) * mr
    dp = -(-kv.head_dim // nbm.NL) * nbm.NL
    nkp = -(-(_step_blocks(kv.block_size) * kv.block_size) // nbm.NL) * nbm.NL
    words = rp * 3 * dp // 2 + mr * nkp // 2 + 3 * dp // 2 * nkp + nkp // 2 * dp  # uint32 tiles
    floats = mr * nkp + rp * dp + 2 * rp + 2 * nkp * dp
    return threads * 4 * (words + floats + rp * 4)


def _check_call(q: torch.Tensor, kv: PagedKV, out: torch.Tensor | None) -> None:
    h, d = kv.kv_heads, kv.head_dim
    if q.dim() != 4 or q.shape[0] != kv.batch or q.shape[3] != d or q.shape[2] % h or q.shape[1] < 1:
        raise ShapeError(f"q must be [batch={kv.batch}, T >= 1, Hq (a multiple of {h}), D={d}], got {tuple(q.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ShapeError(f"out must be {tuple(q.shape)} {q.dtype} like q, got {tuple(out.shape)} {out.dtype}")


def _raise_contents(err: int, kv: PagedKV, t: int) -> None:
    """The :class:`ShapeError` for the compiled call's content check (lengths and block ids, checked on every call
    before anything is written: :func:`kvpack.kernels.cpu_chunk_numba.check_contents`)."""
    lens = kv.seq_lens
    if err == 1:
        raise ShapeError(
            f"every sequence must hold the chunk's {t} tokens (append the chunk first), got seq_lens {lens.tolist()}"
        )
    if err == 2:
        raise ShapeError(f"block_tables has {kv.block_tables.shape[1]} columns, too few for seq_len {int(lens.max())}")
    num_blocks = kv.k_data.shape[0]
    raise ShapeError(f"block_tables hold ids outside [0, {num_blocks}); the pools have {num_blocks} blocks")


_EMPTY4 = np.zeros((0, 1, 1, 1), np.float32)
_NO_START = np.zeros(0, np.int32)


def chunk_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused attention of the last ``T`` positions of each sequence over its paged history, on the CPU.

    Same semantics as :func:`kvpack.kernels.reference.paged_attention_reference`: the chunk's own tokens are
    already in the cache, query ``i`` sits at position ``seq_len - T + i`` and attends causally, positions
    before ``kv.start_pos`` are masked, a row with nothing to attend returns zeros.

    Args:
        q: ``[batch, T, Hq, D]``, float32/float16/bfloat16; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's paged cache.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: a query at position ``p`` attends only positions ``> p - window``; ``None`` for all.
        out: optional ``[batch, T, Hq, D]`` buffer, dtype of ``q``.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ShapeError: inconsistent shapes or dtypes, a block id outside the pools, a sequence shorter than ``T``.
        UnsupportedError: a view of rotated keys: go through :func:`kvpack.kernels.chunk_attention`.
    """
    refuse_rotated(kv)
    prep = cpu_decode._prepare(kv)
    _check_call(q, kv, out)
    if kv.k_outlier is not None:
        cpu_decode._check_outlier_channels(kv)
    nbm = _nb()
    d = kv.head_dim
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    qf = cpu_decode.query_f32(q)  # numpy's widening and copy: fewer torch calls (~10 us each, the caches cold)
    q_lo = q.dtype != torch.bfloat16  # a bfloat16 query is its own high part: its scores need no low part
    ks, kz, vs, vz, ko, ki = (
        v if v is not None else cpu_decode._views(t)
        for v, t in zip(prep.views, (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, kv.k_outlier, kv.k_outlier_idx))
    )
    tables = prep.tables if prep.tables is not None else kv.block_tables.contiguous().numpy()
    seq_lens = prep.seq_lens if prep.seq_lens is not None else kv.seq_lens.contiguous().numpy()
    start = _NO_START if kv.start_pos is None else kv.start_pos.contiguous().numpy()
    if prep.chunk_rows is None:
        prep.chunk_rows = tuple(map(_live_f32, (kv.tail_k, kv.tail_v, kv.sink_k, kv.sink_v)))
    tk, tv, sk, sv = (
        a if a is not None else _EMPTY4 if t is None else t.detach().float().contiguous().numpy()
        for a, t in zip(prep.chunk_rows, (kv.tail_k, kv.tail_v, kv.sink_k, kv.sink_v))
    )
    group = q.shape[2] // kv.kv_heads
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    res = out.numpy() if direct else np.empty(qf.shape, np.float32)
    _set_threads()
    err = nbm.chunk(
        qf, prep.k_data or cpu_decode._views(kv.k_data), ks, kz, spec_vector(prep.kp),
        prep.v_data or cpu_decode._views(kv.v_data), vs, vz, spec_vector(prep.vp), ko, ki, tk, tv, sk, sv,
        tables, seq_lens, start, -1 if window is None else int(window), group, np.float32(sm * _LOG2E), q_lo, ROWS_PER_TILE,
        _step_blocks(kv.block_size), kv.k_data.shape[0], res,
    )  # fmt: skip
    if err:
        _raise_contents(err, kv, q.shape[1])
    if direct:
        return out
    result = torch.from_numpy(res)
    if out is not None:
        return out.copy_(result)
    return result.to(q.dtype)


def _live_f32(t: torch.Tensor | None) -> np.ndarray | None:
    """A contiguous float32 tensor's numpy view, which the view's state keeps (the tensor is the view's for its
    life, its contents the caller's); None for anything else: converted on every call."""
    return cpu_decode._live_array(t.detach()) if t is not None and t.dtype == torch.float32 else None


def _set_threads() -> None:
    import numba

    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
