"""Seal full blocks of an integer format on the CPU in one compiled call, straight into their byte rows.

The result is byte for byte what :func:`kvpack.quant.quantize` stores (``tests/test_cpu_seal.py`` holds the two
side by side); :func:`supports` says which specs take this path: int8/int4/int2 payloads with float16 scales
(and zero-points) chosen at seal time, no rotation, no outlier channels: every integer preset. Anything else,
and a CPU without numba, goes through :func:`kvpack.quant.quantize`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvpack.errors import ShapeError
from kvpack.formats import QuantSpec, ScaleDType

__all__ = ["gather_blocks", "seal_blocks", "supports"]


def supports(spec: QuantSpec) -> bool:
    """Whether :func:`seal_blocks` seals ``spec`` (else use :func:`kvpack.quant.quantize`)."""
    return (
        spec.dtype.is_int
        and spec.granularity is not None
        and spec.scale_dtype is ScaleDType.FP16
        and not (spec.static or spec.rotate or spec.has_outliers)
        and _numba() is not None
    )


@functools.cache
def _numba() -> Any:
    try:
        from kvpack.kernels import cpu_seal_numba
    except ImportError:  # pragma: no cover - numba is part of the cpu extra
        return None
    return cpu_seal_numba


@functools.cache
def _f16_table() -> np.ndarray:
    """``[65536]`` float32: every float16 bit pattern's value."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def gather_blocks(
    tail: torch.Tensor, new: torch.Tensor, slots: np.ndarray, froms: np.ndarray, toks: np.ndarray
) -> tuple[torch.Tensor, bool]:
    """The blocks a step fills, in one compiled pass (where a torch gather cost a ``cat`` per block, a ``stack``
    and a finiteness check: ~45 us per block in the vLLM backend).

    Args:
        tail: ``[capacity, H, T, D]`` float32, contiguous: the open blocks' rows (a tail slot per block).
        new: ``[N, H, D]`` float32: the step's rows.
        slots, froms, toks: ``[K]``: block ``i`` is slot ``slots[i]``'s first ``froms[i]`` rows, then ``new``'s
            rows from ``toks[i]`` on (``slots[i]`` unused, -1 in a step's plan, where ``froms[i]`` is 0).

    Returns:
        ``([K, H, T, D]`` float32 blocks, whether every value is finite).

    Raises:
        ShapeError: an index outside ``tail`` or ``new`` (nothing read).
    """
    k, (cap, h, t, d) = len(slots), tail.shape
    i64 = functools.partial(np.ascontiguousarray, dtype=np.int64)
    slots, froms, toks = i64(slots), i64(froms), i64(toks)
    if k and not (
        new.shape[1:] == (h, d)
        and ((slots >= 0) & (slots < cap) | (froms == 0)).all()  # a block with no tail rows has no slot
        and 0 <= froms.min() <= froms.max() <= t
        and toks.min() >= 0
        and (toks + t - froms).max() <= new.shape[0]
    ):  # the compiled loop does not check its indices
        raise ShapeError(f"gather_blocks: rows outside the tails {tuple(tail.shape)} or the step's {tuple(new.shape)}")
    out = np.empty((k, h, t, d), np.float32)
    ok = _numba().gather_blocks(tail.numpy(), new.contiguous().numpy(), slots, froms, toks, out)
    return torch.from_numpy(out), bool(ok)


def seal_blocks(
    x: torch.Tensor,
    spec: QuantSpec,
    ids: np.ndarray,
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> bool:
    """Quantize ``x`` and write each block's payload, scales and zero-points into row ``ids[k]``.

    Args:
        x: ``[K, H, T, D]`` the blocks, any float dtype, on the CPU.
        spec: a spec :func:`supports` accepts.
        ids: ``[K]`` int64 destination rows.
        data, scale, zero: ``[NB, n]`` uint8 rows (strided rows allowed): the payload bytes (``[H, T, packed]``
            per row), the float16 scales and zero-points (``[Hs, Ts, Cs]``); ``zero`` None for a symmetric spec.

    Returns:
        False, with nothing written, when ``x`` holds a NaN or inf (raise with
        :func:`kvpack.quant._raise_non_finite`).
    """
    nbm = _numba()
    h, t, d = x.shape[-3:]
    hs, ts, cs = spec.granularity.scale_shape(h, t, d)
    xf = x.detach().to(torch.float32).contiguous().numpy()
    dn, sn = data.numpy(), scale.numpy()
    zn = sn if zero is None else zero.numpy()
    err = nbm.seal_int(xf, hs, ts, cs, spec.bits, spec.has_zero, spec.qmin, spec.qmax, _f16_table(),
                       np.ascontiguousarray(ids, dtype=np.int64), dn, sn, zn)  # fmt: skip
    return err == 0
