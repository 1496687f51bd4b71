"""The ``triton`` chunk backend: attention of ``T`` queries per sequence over the packed paged cache.

Chunked prefill, a question after a cached document, a prefix-cache hit's new suffix, draft verification:
the chunk's own tokens are already appended, query ``t`` sits at position ``seq_len - T + t`` and attends
causally (semantics of :func:`kvpack.kernels.reference.paged_attention_reference`). One program handles one
sequence, one kv head and a tile of ``BLOCK_M`` of its ``T x G`` query rows (``G = Hq / kv_heads``), a
FlashAttention-style loop over the sealed blocks with the codes unpacked in the load path, then the tail;
the jit code is in :mod:`kvpack.kernels.triton_chunk_kernels` and reuses the decode kernel's unpack and
dequantization helpers. Every format, outlier channel and sink the decode kernel takes, it takes; it reads
the view with :func:`kvpack.kernels.triton_decode.cache_args`, so block-strided pools work as in decode.

Keys stored rotated (``kv.key_rotation``) are read by the dispatcher with a rotated query and a view without
the rotation; called directly on such a view this backend raises. Triton is imported lazily.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from kvpack.errors import ShapeError, UnsupportedError
from kvpack.kernels import triton_decode as td
from kvpack.kernels.views import PagedKV, refuse_rotated

__all__ = [
    "build_launch",
    "chunk_attention",
    "default_block_m",
    "launch_config",
    "reasons_unsupported",
]

MAX_BLOCK_M = 64  # query rows per program: 64 x a 64-token block keeps sm_90 free of spills at head_dim <= 256


def _kernels() -> ModuleType:
    from kvpack.kernels import triton_chunk_kernels

    return triton_chunk_kernels


def reasons_unsupported(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """Why the Triton chunk kernel cannot run this case (empty list: it can): exactly the decode kernel's
    reasons (device, query and tail dtypes, head_dim, block_size, formats, window), as it reads the same codes."""
    return td.reasons_unsupported(q, kv, window)


def default_block_m(rows: int) -> int:
    """Query rows per tile for ``rows = T * G`` rows per kv head: a power of two, at least 16 (a dot operand's
    minimum), at most :data:`MAX_BLOCK_M`, no larger than the rows need."""
    return min(MAX_BLOCK_M, max(16, 1 << max(0, (rows - 1).bit_length())))


def launch_config(block_m: int, head_dim: int) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` for a ``block_m x head_dim`` query tile.

    8 warps for 64 x 128 tiles and larger: compiled for sm_90 (int8, int4, kivi2, fp8, fp16; block 64), 4 warps
    took 254-255 registers per thread and 1.6-1.7x the block-loop instructions of 8 warps (171-237 registers,
    no spills either way). Not yet timed on a GPU (``benchmarks/gpu_prefill.py`` does).
    """
    return {"num_warps": 8 if block_m * head_dim >= 64 * 128 else 4, "num_stages": 2}


def _check(q: torch.Tensor, kv: PagedKV, out: torch.Tensor | None) -> None:
    refuse_rotated(kv)
    batch, h, d = kv.batch, kv.kv_heads, kv.head_dim
    if q.dim() != 4 or q.shape[0] != batch or q.shape[3] != d or q.shape[2] % h:
        raise ShapeError(
            f"q must be [batch={batch}, T, Hq (a multiple of kv_heads={h}), head_dim={d}], got {tuple(q.shape)}"
        )
    td.check_cache(kv, q.device)
    td.check_out(q, out)


def build_launch(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    codes: str | None = None,
) -> tuple[td.Launch, torch.Tensor]:
    """Check the case and build the launch and the output tensor (nothing runs; ``td.compile_launch`` takes the
    launch to compile it for a GPU target). Arguments as :func:`chunk_attention`."""
    _check(q, kv, out)
    batch, t, hq, d = q.shape
    h, b = kv.kv_heads, kv.block_size
    group = hq // h
    q = q if q.stride(-1) == 1 else q.contiguous()
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    bm = default_block_m(t * group) if block_m is None else int(block_m)
    if bm < 16 or bm & (bm - 1):
        raise ShapeError(f"block_m must be a power of two of at least 16, got {bm}")
    result = torch.empty_like(q) if out is None else out
    consts = td.cache_constexprs(kv, q, codes)
    n_out = consts["N_OUT"]
    k = td._kernels()
    consts.update(
        BLOCK_O=max(16, td._next_pow2(n_out)),  # the residuals' dot needs 16 columns; those past N_OUT are 0
        O_DT=k.tl.float32 if consts["DOT"] == k.tl.float32 else k.tl.float16,  # residuals are float16
    )
    args = [
        q, q.stride(0), q.stride(1), q.stride(2),
        *td.cache_args(kv),
        result, result.stride(0), result.stride(1), result.stride(2),
        t, sm_scale * td._LOG2E, 0 if window is None else int(window),
    ]  # fmt: skip
    constexprs = {
        "GROUP": group,
        "BLOCK_M": bm,
        "HEAD_DIM": d,
        "BLOCK_SIZE": b,
        "HAS_WINDOW": window is not None,
        **consts,
    }
    cfg = launch_config(bm, d)
    cfg.update({n: v for n, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None})
    grid = (batch, h, max(1, math.ceil(t * group / bm)))
    return td.Launch(_kernels().paged_chunk_kernel, grid, args, constexprs, cfg), result


def chunk_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    codes: str | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``T`` positions of each sequence over its paged history, fused.

    Args:
        q: ``[batch, T, Hq, D]``, float16/bfloat16/float32; ``Hq`` a multiple of ``kv.kv_heads``. Query ``t``
            sits at position ``seq_len - T + t`` (the chunk's keys and values already appended; a sequence
            must hold at least ``T`` tokens: rows before position 0 would attend nothing and get zeros).
        kv: the layer's :class:`PagedKV` (without ``key_rotation``: the dispatcher rotates the query).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: a query at position ``p`` attends only positions ``> p - window``.
        out: optional ``[batch, T, Hq, D]`` buffer in ``q.dtype``, contiguous in its last axis.
        block_m: query rows per program (default :func:`default_block_m`).
        num_warps, num_stages: launch options (default :func:`launch_config`).
        codes: how integer codes and fp8 values become numbers, one of ``triton_decode.CODES``.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype``; positions before ``kv.start_pos`` are masked, and a row with
        nothing to attend gets zeros.

    Raises:
        UnsupportedError: the case is outside what the kernel runs (the reasons are listed), or the view
            stores rotated keys.
        ShapeError: a tensor has the wrong shape, dtype or device.
    """
    reasons = reasons_unsupported(q, kv, window)
    if reasons:
        raise UnsupportedError("the triton chunk backend cannot run this case: " + "; ".join(reasons), reasons)
    if q.dim() == 4 and q.shape[1] == 0:
        _check(q, kv, out)
        return torch.empty_like(q) if out is None else out
    launch, result = build_launch(
        q, kv, sm_scale, window, out, block_m=block_m, num_warps=num_warps, num_stages=num_stages, codes=codes
    )
    launch.run()
    return result
