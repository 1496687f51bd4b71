"""One lowering of a :class:`~kvpack.formats.QuantSpec` to the integer codes every kernel backend uses.

The CPU kernels (:mod:`kvpack.kernels.cpu_decode_numba`, :mod:`kvpack.kernels.cpu_chunk_numba`) and the Triton kernels
(:mod:`kvpack.kernels.triton_kernels`) compare these codes as compile-time constants. The numba modules keep
literal copies of the enums (numba folds module-level ints, not enum members); ``tests/test_lowering.py`` checks
that they equal these. Pure Python: importing it pulls in neither numba, triton nor torch's CUDA.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpack.formats import DType, QuantSpec, ScaleDType

__all__ = [
    "FloatKind",
    "Lowered",
    "PayloadKind",
    "ScaleKind",
    "TritonKind",
    "TritonScale",
    "lower",
    "scale_kind",
]


class PayloadKind(enum.IntEnum):
    """How a payload byte (or element) is decoded by the CPU kernels."""

    S8 = 0  # signed int8 codes
    U8 = 1  # unsigned int8 codes (asymmetric, with a zero-point)
    U4 = 2  # two 4-bit codes per byte (offset binary, or unsigned with a zero-point)
    U2 = 3  # four 2-bit codes per byte
    E4M3 = 4
    E5M2 = 5
    FLT = 6  # a passthrough float row (see FloatKind)


class FloatKind(enum.IntEnum):
    """The float type of passthrough rows (``PayloadKind.FLT``: fp16/bf16/fp32 formats and the tails)."""

    F16 = 0
    BF16 = 1
    F32 = 2


class ScaleKind(enum.IntEnum):
    """How a scale or zero-point is stored (every backend: CPU kernels, the Triton seal kernel)."""

    NONE = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    E8M0 = 4


class TritonKind(enum.IntEnum):
    """The Triton kernels' ``KIND``: how codes become values."""

    FLOAT = 0  # passthrough
    SYM = 1  # symmetric int (offset binary below 8 bits)
    ASYM = 2  # unsigned int codes plus a float zero-point
    FP8 = 3
    FP8_ASYM = 4  # fp8 codes plus a zero-point


class TritonScale(enum.IntEnum):
    """The Triton kernels' ``SCALE``: which axes of a block the scales vary along."""

    NONE = 0
    SCALAR = 1  # one per block and head (tensor / head granularity)
    CHANNEL = 2
    TOKEN = 3
    GROUP = 4  # per token and channel group


_SCALE = {ScaleDType.FP32: ScaleKind.F32, ScaleDType.FP16: ScaleKind.F16, ScaleDType.BF16: ScaleKind.BF16,
          ScaleDType.E8M0: ScaleKind.E8M0}  # fmt: skip
_FLOAT = {DType.FP16: FloatKind.F16, DType.BF16: FloatKind.BF16, DType.FP32: FloatKind.F32}
_INT = {DType.INT4: PayloadKind.U4, DType.INT2: PayloadKind.U2}


@dataclass(frozen=True)
class Lowered:
    """A spec's codes for a cache of ``kv_heads`` heads, ``block_size`` tokens per block, ``head_dim`` channels.

    ``scale_shape`` is ``(HS, TS, CS)`` per block, ``(1, 1, 1)`` for a passthrough spec; ``cgroup`` the channels
    per scale (``head_dim // CS``).
    """

    kind: PayloadKind
    float_kind: FloatKind  # passthrough rows only (F16 otherwise)
    per: int  # codes per payload byte
    offset: int  # subtracted from offset-binary packed codes (0 for the others)
    scale_kind: ScaleKind
    zero_kind: ScaleKind
    scale_shape: tuple[int, int, int]
    row: int  # payload elements per row (packed head_dim)
    triton_kind: TritonKind
    triton_scale: TritonScale
    cgroup: int
    e8m0: bool


def scale_kind(dtype: ScaleDType) -> ScaleKind:
    """The :class:`ScaleKind` of a stored scale dtype."""
    return _SCALE[dtype]


def lower(spec: QuantSpec, kv_heads: int, block_size: int, head_dim: int) -> Lowered:
    """``spec``'s codes for blocks ``[kv_heads, block_size, head_dim]``."""
    if spec.is_passthrough:
        return Lowered(PayloadKind.FLT, _FLOAT[spec.dtype], 1, 0, ScaleKind.NONE, ScaleKind.NONE, (1, 1, 1), head_dim,
                       TritonKind.FLOAT, TritonScale.NONE, head_dim, False)  # fmt: skip
    per, offset = 1, 0
    if spec.dtype.is_fp8:
        kind = PayloadKind.E4M3 if spec.dtype is DType.FP8_E4M3 else PayloadKind.E5M2
        tkind = TritonKind.FP8 if spec.symmetric else TritonKind.FP8_ASYM
    else:
        tkind = TritonKind.SYM if spec.symmetric else TritonKind.ASYM
        if spec.dtype is DType.INT8:
            kind = PayloadKind.S8 if spec.symmetric else PayloadKind.U8
        else:
            kind, per = _INT[spec.dtype], 8 // spec.bits
            offset = 0 if spec.has_zero else 2 ** (spec.bits - 1)
    hs, ts, cs = spec.scale_shape(kv_heads, block_size, head_dim)
    tscale = {(False, False): TritonScale.SCALAR, (False, True): TritonScale.CHANNEL, (True, False): TritonScale.TOKEN,
              (True, True): TritonScale.GROUP}[(ts > 1, cs > 1)]  # fmt: skip
    return Lowered(
        kind=kind,
        float_kind=FloatKind.F16,
        per=per,
        offset=offset,
        scale_kind=_SCALE[spec.scale_dtype],
        zero_kind=_SCALE[spec.zero_dtype] if spec.has_zero else ScaleKind.NONE,
        scale_shape=(hs, ts, cs),
        row=spec.packed_head_dim(head_dim),
        triton_kind=tkind,
        triton_scale=tscale,
        cgroup=head_dim // cs,
        e8m0=spec.scale_dtype is ScaleDType.E8M0,
    )
