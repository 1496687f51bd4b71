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

from kvpack.errors import CalibrationError, ShapeError
from kvpack.formats import QuantSpec, ScaleDType

__all__ = [
    "ROW_DTYPES",
    "StepWrites",
    "available",
    "gather_blocks",
    "row_arrays",
    "seal_blocks",
    "seal_step",
    "supports",
    "write_rows",
]


def supports(spec: QuantSpec) -> bool:
    """Whether :func:`seal_blocks` seals ``spec`` (else use :func:`kvpack.quant.quantize`). A spec whose kept
    channels are refined (``o<k>r``) is sealed as without them (each kept channel is its own scale group and keeps
    its own code): :func:`refine_blocks` then writes its codes and indices."""
    return (
        spec.dtype.is_int
        and spec.granularity is not None
        and spec.scale_dtype is ScaleDType.FP16
        and not (spec.static or spec.rotate or (spec.has_outliers and not spec.refined))
        and _numba() is not None
    )


def refine_blocks(
    x: torch.Tensor | np.ndarray,
    spec: QuantSpec,
    ids: np.ndarray,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    out: tuple[torch.Tensor, torch.Tensor],
    energy: torch.Tensor | None = None,
    channels: torch.Tensor | None = None,
) -> None:
    """Write the refinement codes and channel indices of a refined key spec's blocks (``o<k>r``, ``o<k>qr``) once
    :func:`seal_blocks` (or a step's compiled seal) has written their payload and scales: the bytes
    :func:`kvpack.cache.write.seal_outliers` gives.

    Args:
        x: ``[K, H, T, D]`` float32 (a tensor, or the compiled step's scratch), the blocks as sealed.
        spec: a refined spec :func:`supports` accepts.
        ids: ``[K]`` int64 rows. rows: ``(data, scale, zero)`` as :func:`seal_blocks` wrote them.
        out: ``(residual, idx)`` ``[NB, n]`` uint8 rows: ``[H, T, ceil(k / 2)]`` codes and ``[H, k]`` indices.
        energy: ``[H, D]`` float32, the layer's query statistics (a query-ranked spec needs them).
        channels: ``[H, k]`` channels to keep in every block (a calibration artifact's, for a spec ranked by range).

    Raises:
        CalibrationError: a query-ranked spec without ``energy``.
    """
    d = x.shape[3]
    if spec.query_ranked:
        if energy is None:
            raise CalibrationError(
                f"{spec} ranks its outlier channels by the queries, and no query statistics were given"
            )
        ranked, fixed = (1 if spec.has_zero else 2), _NO_CHANNELS
        en = energy.detach().to(torch.float32).contiguous().numpy()
    else:
        ranked, en = 0, _NO_ENERGY
        fixed = _NO_CHANNELS if channels is None else channels.to(torch.int64).contiguous().numpy()
    xf = x if isinstance(x, np.ndarray) else x.detach().to(torch.float32).contiguous().numpy()
    data, scale, zero = rows
    zn = scale.numpy() if zero is None else zero.numpy()
    _numba().refine_into(xf, spec.outliers, ranked, en, fixed, spec.bits, spec.has_zero, _f16_table(),
                         np.ascontiguousarray(ids, dtype=np.int64), data.numpy(), scale.numpy(), zn, out[0].numpy(),
                         out[1].numpy(), d > 256)  # fmt: skip


_NO_ENERGY = np.zeros((1, 1), np.float32)
_NO_CHANNELS = np.zeros((0, 1), np.int64)


def available() -> bool:
    """Whether the compiled loops can run (numba is installed)."""
    return _numba() is not None


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


# the tails' dtypes the compiled step takes, and their element kind in cpu_seal_numba (F32, BF16, F16)
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rows_np(t: torch.Tensor) -> np.ndarray:
    """float32 as is, bfloat16 / float16 as their uint16 bits (numpy has no bfloat16)."""
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


def _int64(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Index arrays as the compiled loops take them (contiguous int64; no copy when they already are)."""
    return tuple(np.ascontiguousarray(x, dtype=np.int64) for x in xs)


def gather_blocks(
    tail: torch.Tensor, new: torch.Tensor, slots: np.ndarray, froms: np.ndarray, toks: np.ndarray
) -> tuple[torch.Tensor, bool]:
    """The blocks a step fills, in one compiled pass (where a torch gather cost a ``cat`` per block, a ``stack``
    and a finiteness check: ~45 us per block in the vLLM backend).

    Args:
        tail: ``[capacity, H, T, D]`` float32, bfloat16 or float16 (:data:`ROW_DTYPES`): the open blocks' rows (a
            tail slot per block). new: ``[N, H, D]``, the same dtype: the step's rows.
        slots, froms, toks: ``[K]``: block ``i`` is slot ``slots[i]``'s first ``froms[i]`` rows, then ``new``'s
            rows from ``toks[i]`` on (``slots[i]`` unused, -1 in a step's plan, where ``froms[i]`` is 0).

    Returns:
        ``([K, H, T, D]`` float32 blocks, whether every value is finite).

    Raises:
        ShapeError: an index outside ``tail`` or ``new`` (nothing read).
    """
    slots, froms, toks = _int64(slots, froms, toks)
    rows = tuple(map(_rows_np, (tail, new)))
    if not _numba().rows_inside(*rows, slots, froms, toks):
        raise ShapeError(f"gather_blocks: rows outside the tails {tuple(tail.shape)} or the step's {tuple(new.shape)}")
    k, (_, h, t, d) = len(slots), tail.shape
    out = np.empty((k, h, t, d), np.float32)
    ok = _numba().gather_into(*rows, ROW_DTYPES[tail.dtype], _f16_table(), slots, froms, toks, out)
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


def _spec_args(spec: QuantSpec, h: int, t: int, d: int) -> tuple:
    return (*spec.granularity.scale_shape(h, t, d), spec.bits, spec.has_zero, spec.qmin, spec.qmax)


def seal_step(
    tails: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    slots: np.ndarray,
    froms: np.ndarray,
    toks: np.ndarray,
    ids: np.ndarray,
    specs: tuple[QuantSpec, QuantSpec],
    rows: tuple[tuple, tuple],
) -> bool:
    """Gather and seal a step's filled blocks, keys and values, in one compiled call: what :func:`gather_blocks`
    then :func:`seal_blocks` for each do, with tails in any of :data:`ROW_DTYPES` (bfloat16 and float16 widened
    exactly, as :func:`kvpack.quant.quantize` does). A :class:`StepWrites` made for this one call (a caller that
    seals into the same pools step after step keeps its own).

    Args:
        tails: ``[capacity, H, T, D]`` the key and value tails; new: ``[N, H, D]`` the step's rows (strided
            views allowed, as vLLM hands them over), the tails' dtype. slots, froms, toks: as in
            :func:`gather_blocks`; ids: ``[K]`` destination rows.
        specs: the key and value specs (:func:`supports` both). rows: ``(data, scale, zero)`` for each, as in
            :func:`seal_blocks`.

    Returns:
        False, with nothing written, when a key or value is not finite (raise with
        :func:`kvpack.quant._raise_non_finite` on :func:`gather_blocks`' result).

    Raises:
        ShapeError: an index outside the tails or the step's rows (nothing read).
    """
    return StepWrites(tails, rows, specs)(row_arrays(*new), *_int64(slots, froms, toks, ids))


_NO_ROWS = np.zeros(0, np.int64)


class StepWrites:
    """One layer's compiled writes of a step into the same tails and pages step after step, prepared once:
    :meth:`__call__` seals the blocks the step fills and writes the other rows to their tails in one compiled call
    (``cpu_seal_numba.write_step``). Inside a serving engine each Python step around a compiled call costs several
    microseconds, its caches cold: made per call, the arrays, scale shapes and scratch of :func:`seal_step` cost
    ~50 us of its ~80 in the vLLM backend.

    Args:
        tails: ``[capacity, H, T, D]`` the key and value tails (one of :data:`ROW_DTYPES`).
        rows: ``(data, scale, zero)`` for keys and for values, as :func:`seal_blocks` takes them.
        specs: the key and value specs (:func:`supports` both).
    """

    def __init__(
        self, tails: tuple[torch.Tensor, torch.Tensor], rows: tuple[tuple, tuple], specs: tuple[QuantSpec, QuantSpec]
    ) -> None:
        _, h, t, d = tails[0].shape
        self.shape = tuple(tails[0].shape)
        self.kind = ROW_DTYPES[tails[0].dtype]
        self.arrays = seal_arrays(tails, rows)
        self.kq, self.vq = (_spec_args(s, h, t, d) for s in specs)
        self.f16 = _f16_table()
        self.scratch = self._scratch(8)
        self.fn = _numba().write_step

    def _scratch(self, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.empty((blocks, *self.shape[1:]), np.float32) for _ in range(2))

    def __call__(
        self,
        new: tuple[np.ndarray, np.ndarray],
        slots: np.ndarray,
        froms: np.ndarray,
        toks: np.ndarray,
        ids: np.ndarray,
        wtok: np.ndarray = _NO_ROWS,
        wslot: np.ndarray = _NO_ROWS,
        woff: np.ndarray = _NO_ROWS,
    ) -> bool:
        """Seal blocks ``ids`` (as :func:`seal_step`), then write rows ``wtok`` to tail slots ``wslot`` at
        ``woff`` (as :func:`write_rows`).

        Args:
            new: :func:`row_arrays` of the step's rows ``[N, H, D]`` (the tails' dtype). slots ... woff: ``[K]`` and
                ``[M]`` contiguous int64 (a :class:`~kvpack.integrations.vllm.tails.StepPlan`'s arrays).

        Returns:
            False, with nothing written, when a key or value of a sealed block is not finite (raise with
            :func:`kvpack.quant._raise_non_finite` on :func:`gather_blocks`' result).

        Raises:
            ShapeError: an index outside the tails or the step's rows (nothing written).
        """
        if len(slots) > len(self.scratch[0]):
            self.scratch = self._scratch(max(len(slots), 2 * len(self.scratch[0])))
        tk, tv, kd, ks, kz, vd, vs, vz = self.arrays
        err = self.fn(tk, tv, new[0], new[1], self.kind, self.f16, slots, froms, toks, ids, *self.scratch, self.kq,
                      kd, ks, kz, self.vq, vd, vs, vz, wtok, wslot, woff)  # fmt: skip
        if err >= 2:
            raise ShapeError(
                f"write_step: {'sealed blocks' if err == 2 else 'tail rows'} outside the tails {self.shape} or the "
                f"step's rows {tuple(new[0].shape)}"
            )
        return err == 0


def seal_arrays(tails: tuple[torch.Tensor, torch.Tensor], rows: tuple[tuple, tuple]) -> tuple[np.ndarray, ...]:
    """The numpy arrays :func:`seal_step` reads ``tails`` and writes ``rows`` as (``(tail_k, tail_v, k_data, k_scale,
    k_zero, v_data, v_scale, v_zero)``, sharing memory; a missing zero-point pool stands in as its scale pool, never
    written): a caller that seals into the same pools step after step makes them once."""
    (kd, ks, kz), (vd, vs, vz) = rows
    return (*row_arrays(*tails), kd.numpy(), ks.numpy(), (ks if kz is None else kz).numpy(), vd.numpy(), vs.numpy(),
            (vs if vz is None else vz).numpy())  # fmt: skip


def row_arrays(*ts: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The numpy arrays the compiled loops read ``ts`` as (float32 as is, 16-bit as their bits), sharing memory:
    a caller that writes into the same tensors step after step makes them once (see :func:`write_rows`)."""
    return tuple(map(_rows_np, ts))


def write_rows(
    tails: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    toks: np.ndarray,
    slots: np.ndarray,
    offs: np.ndarray,
    tail_arrays: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """``tail[slots[i], :, offs[i]] = new[toks[i]]`` for keys and values in one compiled call (in the vLLM backend
    ~23 us a layer and step, where the two torch scatters it replaces and their index tensors took ~60 us).

    Args:
        tails: ``[capacity, H, T, D]``; new: ``[N, H, D]`` (strided views allowed), the same dtype (one of
            :data:`ROW_DTYPES`). toks, slots, offs: ``[M]`` int64. tail_arrays: :func:`row_arrays` of ``tails``
            (None: made here).

    Raises:
        ShapeError: an index outside the tails or the rows (nothing written).
    """
    arrays = (*(tail_arrays or map(_rows_np, tails)), *map(_rows_np, new))
    if _numba().write_rows(*arrays, toks, slots, offs):
        raise ShapeError(
            f"write_rows: rows outside the tails {tuple(tails[0].shape)} or the step's {tuple(new[0].shape)}"
        )
