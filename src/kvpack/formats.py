"""Cache formats as data: what is stored, at which granularity, and exactly how many bytes it costs.

A :class:`QuantSpec` describes one tensor (keys or values); a :class:`KVFormat` pairs a key spec with a
value spec and a block size. Sizes count every payload, scale, zero-point and padding byte, so
``bits_per_element`` is the honest figure, not the nominal one.

Scales are block-local: a granularity says which axes of one ``[kv_heads, block_size, head_dim]`` block
share a scale. The scale array of a block always has the 3-D shape ``[Hs, Ts, Cs]`` (broadcastable against
the block), which is also the layout of the scale pools in the paged cache.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from dataclasses import dataclass, field

from kvpack.errors import FormatError

__all__ = [
    "PEER_PRESETS",
    "PRESETS",
    "DType",
    "Granularity",
    "KVFormat",
    "PerChannel",
    "PerGroup",
    "PerHead",
    "PerTensor",
    "PerToken",
    "QuantSpec",
    "ScaleDType",
    "parse_format",
    "preset",
    "split_formats",
]


class DType(enum.Enum):
    """Storage dtype of a cached element."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT4 = "int4"
    INT2 = "int2"

    @property
    def bits(self) -> int:
        return _DTYPE_BITS[self]

    @property
    def is_passthrough(self) -> bool:
        """Stored as a plain float tensor, no scales."""
        return self in (DType.FP32, DType.FP16, DType.BF16)

    @property
    def is_fp8(self) -> bool:
        return self in (DType.FP8_E4M3, DType.FP8_E5M2)

    @property
    def is_int(self) -> bool:
        return self in (DType.INT8, DType.INT4, DType.INT2)

    @property
    def fp8_max(self) -> float:
        """Largest finite value of an fp8 dtype."""
        return {DType.FP8_E4M3: 448.0, DType.FP8_E5M2: 57344.0}[self]


_DTYPE_BITS = {
    DType.FP32: 32,
    DType.FP16: 16,
    DType.BF16: 16,
    DType.INT8: 8,
    DType.FP8_E4M3: 8,
    DType.FP8_E5M2: 8,
    DType.INT4: 4,
    DType.INT2: 2,
}


class ScaleDType(enum.Enum):
    """How a scale (and a zero-point) is stored.

    ``E8M0`` is the 8-bit power-of-two scale of the OCP microscaling formats: the scale is rounded *up*
    to a power of two, so nothing clips, at the cost of up to one bit of resolution. Zero-points of an
    ``E8M0`` spec are stored in fp16 (a power of two cannot hold an offset).
    """

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    E8M0 = "e8m0"

    @property
    def bytes(self) -> int:
        return {ScaleDType.FP32: 4, ScaleDType.FP16: 2, ScaleDType.BF16: 2, ScaleDType.E8M0: 1}[self]


# ----------------------------------------------------------------------------------------------------
# Granularity: which axes of a [kv_heads, block_size, head_dim] block share one scale.


@dataclass(frozen=True)
class Granularity:
    """Base class; subclasses give the per-block scale shape ``[Hs, Ts, Cs]``."""

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        raise NotImplementedError

    def reasons_invalid(self, head_dim: int) -> list[str]:
        return []

    @property
    def name(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole block (all heads, tokens and channels)."""

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        return (1, 1, 1)

    @property
    def name(self) -> str:
        return "tensor"


@dataclass(frozen=True)
class PerHead(Granularity):
    """One scale per kv head per block."""

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        return (kv_heads, 1, 1)

    @property
    def name(self) -> str:
        return "head"


@dataclass(frozen=True)
class PerChannel(Granularity):
    """One scale per kv head and channel, shared by the block's tokens (the key axis)."""

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        return (kv_heads, 1, head_dim)

    @property
    def name(self) -> str:
        return "channel"


@dataclass(frozen=True)
class PerToken(Granularity):
    """One scale per kv head and token, over the whole head_dim (the value axis)."""

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        return (kv_heads, block_size, 1)

    @property
    def name(self) -> str:
        return "token"


@functools.cache  # scale shapes are asked for on every seal of a step: the search runs once per shape
def _fit_groups(head_dim: int, size: int) -> int:
    """The fewest equal groups of at most ``size`` channels along ``head_dim``, whole 4-channel runs if any fit."""
    if head_dim % size == 0:
        return head_dim // size
    whole = [n for n in range(-(-head_dim // size), head_dim + 1) if head_dim % n == 0]
    return next((n for n in whole if (head_dim // n) % 4 == 0), whole[0])


@dataclass(frozen=True)
class PerGroup(Granularity):
    """One scale per kv head, token and group of at most ``size`` consecutive channels.

    ``head_dim`` is split into the fewest equal groups of at most ``size`` channels, each a whole number of
    4-channel runs (so 2- and 4-bit codes of one group fill whole bytes) where ``head_dim`` allows it. Where
    ``size`` divides ``head_dim`` (64, 128, 256 with ``g32``) the groups are exactly ``size`` wide; elsewhere they
    are narrower, never wider, so a format keeps at least the precision its name promises and pays the extra
    scales in its bytes (``g32`` at Phi-2's head_dim 80: four groups of 20; at 120: five of 24).
    :meth:`width` gives the channels per group.

    ``exact=True`` (other systems' layouts, :data:`PEER_PRESETS`): groups exactly ``size`` wide, as the system the
    layout stands for requires; a head_dim that ``size`` does not divide is invalid. It never changes a valid
    format's bytes, so it takes no part in equality.
    """

    size: int = 32
    exact: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise FormatError(f"group size must be a positive integer, got {self.size!r}")

    def groups(self, head_dim: int) -> int:
        """Number of groups along ``head_dim`` (``head_dim`` > 0)."""
        return _fit_groups(head_dim, self.size)

    def reasons_invalid(self, head_dim: int) -> list[str]:
        if self.exact and head_dim % self.size:
            return [
                f"head_dim {head_dim} is not divisible by the group size {self.size}, which this layout keeps exactly "
                "(the system it stands for requires it)"
            ]
        return []

    def width(self, head_dim: int) -> int:
        """Channels per group at ``head_dim``: ``size`` where it divides ``head_dim``, else the widest narrower fit."""
        return head_dim // self.groups(head_dim)

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
        return (kv_heads, block_size, self.groups(head_dim))

    @property
    def name(self) -> str:
        return f"g{self.size}"


# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor (keys or values) is stored.

    Dequantization, per element (``s`` and ``z`` broadcast from the ``[Hs, Ts, Cs]`` scale arrays):
    symmetric int ``x = q * s`` (q signed); asymmetric int ``x = q * s + z`` (q unsigned, ``z`` a float
    offset, the group minimum); fp8 ``x = float(q) * s``; asymmetric fp8 ``x = float(q) * s + z`` (``z`` the
    midpoint of the group's range, so a constant offset, such as a key bias, costs no precision);
    passthrough ``x = q``.

    ``static=True`` means the scales come from a calibration artifact (:mod:`kvpack.calibration`) instead
    of being chosen at seal time; :func:`kvpack.quant.choose_qparams` refuses such a spec, so a missing
    artifact can never silently become a block-local (or default) scale. Static scales are per channel,
    head or tensor: a per-token scale only exists once its token does. Storage is unchanged (each block
    still carries its scale slot), so byte counts do not depend on this flag.

    ``outliers=k`` (keys only) keeps ``k`` key channels per kv head in full precision: each sealed block
    stores, next to its payload and scales, the fp16 residual ``x - dequantize(payload)`` at the kept
    channels (``[kv_heads, block_size, k]``) and the ascending channel indices (``[kv_heads, k]``, uint8, or
    int16 when head_dim > 256). The channels are the block's ``k`` largest by abs-max, chosen at seal time,
    or a calibration artifact's top-k per layer and head (copied into each block). ``0 < k < head_dim``.

    ``query_ranked=True`` (``o<k>q``) ranks a block's channels by ``E[q_c^2] * spread_c^2`` instead: the
    queries' mean energy in channel ``c`` (per layer and kv head, from a calibration artifact's query
    statistics) times the channel's squared spread in the block (its range for an asymmetric spec, twice its
    abs-max for a symmetric one). A key channel's error reaches the score through the query, so this keeps the
    channels whose error the queries would read. Same bytes and kernels as ``o<k>``; needs the artifact.

    ``refined=True`` (``o<k>r``, ``o<k>qr``) stores each kept element as a 4-bit *refinement* of its own
    payload code instead of an fp16 residual: with block-local per-channel scales a kept channel is quantized
    under its own scale ``s`` like every other channel, so its residual lies within ``s / 2``, and a code ``u``
    of it on a grid of ``s / 16`` (residual ``(u - 7.5) * s / 16``) gives the channel four more bits (int4 keys:
    int8 precision) for a quarter of the fp16 residual's bytes. The codes are packed two channels per byte
    (``[kv_heads, block_size, ceil(k / 2)]`` uint8, channel ``j`` in byte ``j // 2``, low nibble first). Integer
    dtypes with per-channel, block-local scales only.

    ``rotate=True`` (keys only) stores keys multiplied by a fixed orthogonal matrix ``R`` (a random-sign
    Hadamard, :func:`kvpack.rotation.key_rotation`; block-diagonal where head_dim is not a power of two): ``k @ R`` spreads a few
    outlier channels over all of them, so per-head scales and fp8's relative error treat every channel
    alike. Scores are unchanged (``q . k = (q @ R) . (k @ R)``): kernels read the stored keys with a rotated
    query. Costs no bytes; not combinable with ``static`` scales or ``outliers`` (both are chosen per
    channel of the unrotated keys).
    """

    dtype: DType
    granularity: Granularity | None = None
    symmetric: bool = True
    scale_dtype: ScaleDType = ScaleDType.FP16
    static: bool = False
    outliers: int = 0
    rotate: bool = False
    query_ranked: bool = False
    refined: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise FormatError(f"dtype must be a DType, got {self.dtype!r}")
        if isinstance(self.outliers, bool) or not isinstance(self.outliers, int) or self.outliers < 0:
            raise FormatError(
                f"outliers (key channels kept per kv head) must be an integer >= 0, got {self.outliers!r}"
            )
        if not isinstance(self.query_ranked, bool):
            raise FormatError(f"query_ranked must be a bool, got {self.query_ranked!r}")
        if self.query_ranked and not self.outliers:
            raise FormatError(
                "query_ranked ranks outlier channels by the queries, and this spec keeps none: give o<N>q (N > 0)"
            )
        if not isinstance(self.refined, bool):
            raise FormatError(f"refined must be a bool, got {self.refined!r}")
        if self.refined:
            self._check_refined()
        if self.dtype.is_passthrough:
            if self.outliers:
                raise FormatError(
                    f"{self.dtype.value} is stored as is: every channel is already full precision; drop 'o{self.outliers}'"
                )
            if self.granularity is not None:
                raise FormatError(f"{self.dtype.value} is stored as is and takes no granularity")
            if self.static:
                raise FormatError(f"{self.dtype.value} is stored as is and has no scales to calibrate; drop 'static'")
            if self.rotate:
                raise FormatError(f"{self.dtype.value} is stored as is: a rotation would change nothing; drop 'rot'")
            return
        if self.rotate and (self.static or self.outliers):
            raise FormatError(
                "'rot' cannot be combined with "
                + ("'static' scales" if self.static else f"'o{self.outliers}' outlier channels")
                + ": both are chosen per channel of the unrotated keys; rotation is the other answer to the same "
                "outliers, so pick one"
            )
        if not isinstance(self.granularity, Granularity):
            raise FormatError(f"{self.dtype.value} needs a granularity: one of tensor, head, channel, token, g<N>")
        if self.dtype.is_fp8 and not self.symmetric and self.static:
            raise FormatError(
                f"asymmetric {self.dtype.value} centres each block on its own midpoint, which a calibration "
                "cannot give; drop 'static' or 'asym'"
            )
        if self.static and isinstance(self.granularity, (PerToken, PerGroup)):
            raise FormatError(
                f"static (calibrated) scales are per channel, head or tensor, not per {self.granularity.name}: "
                "a per-token scale is always computed when its token is sealed; drop 'static' or use 'channel'"
            )

    def _check_refined(self) -> None:
        """A refinement code is a residual on a grid of the kept channel's own scale step: it needs kept
        channels, an integer dtype and per-channel scales chosen per block (a calibrated scale can clip a kept
        element by more than one step)."""
        if not self.outliers:
            raise FormatError(
                "refined stores kept outlier channels as 4-bit codes, and this spec keeps none: give o<N>r"
            )
        if not self.dtype.is_int or not isinstance(self.granularity, PerChannel) or self.static:
            raise FormatError(
                f"'o{self.outliers}{'q' if self.query_ranked else ''}r' refines a kept channel on a grid of its own "
                "block-local scale step, which needs an integer dtype with 'channel' scales and no 'static'; got "
                f"{self.dtype.value}:{self.granularity.name if self.granularity else 'none'}"
                + (":static" if self.static else "")
                + f": use 'o{self.outliers}{'q' if self.query_ranked else ''}' (fp16 residuals) instead"
            )

    # -- derived facts ------------------------------------------------------------------------------
    @property
    def is_passthrough(self) -> bool:
        return self.dtype.is_passthrough

    @property
    def bits(self) -> int:
        return self.dtype.bits

    @property
    def has_outliers(self) -> bool:
        return self.outliers > 0

    @property
    def has_zero(self) -> bool:
        return not (self.symmetric or self.dtype.is_passthrough)

    @property
    def zero_dtype(self) -> ScaleDType:
        """Storage of the zero-point: the scale dtype, or fp16 for E8M0 scales."""
        return ScaleDType.FP16 if self.scale_dtype is ScaleDType.E8M0 else self.scale_dtype

    @property
    def qmin(self) -> int:
        """Smallest integer code (integer dtypes only)."""
        b = self.bits
        return -(2 ** (b - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        """Largest integer code (integer dtypes only)."""
        b = self.bits
        return 2 ** (b - 1) - 1 if self.symmetric else 2**b - 1

    def packed_head_dim(self, head_dim: int) -> int:
        """Last-axis length of the payload array: elements for >= 8 bits, bytes for int4/int2."""
        if self.bits >= 8:
            return head_dim
        return math.ceil(head_dim * self.bits / 8)

    def payload_bytes(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        """Payload bytes of one block, padding included."""
        per_row = self.packed_head_dim(head_dim) * max(self.bits, 8) // 8
        return kv_heads * block_size * per_row

    def scale_shape(self, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int] | None:
        if self.granularity is None:
            return None
        return self.granularity.scale_shape(kv_heads, block_size, head_dim)

    def scale_bytes(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        """Scale plus zero-point bytes of one block."""
        shape = self.scale_shape(kv_heads, block_size, head_dim)
        if shape is None:
            return 0
        n = math.prod(shape)
        return n * self.scale_dtype.bytes + (n * self.zero_dtype.bytes if self.has_zero else 0)

    @staticmethod
    def outlier_index_bytes(head_dim: int) -> int:
        """Bytes of one stored outlier channel index: uint8 up to head_dim 256, int16 past it."""
        return 1 if head_dim <= 256 else 2

    @property
    def residual_width(self) -> int:
        """Last-axis length of the stored residuals ``[kv_heads, block_size, w]``: ``k`` fp16 residuals, or
        ``ceil(k / 2)`` bytes of packed 4-bit refinement codes (``refined``); 0 without outliers."""
        return (self.outliers + 1) // 2 if self.refined else self.outliers

    @property
    def residual_itemsize(self) -> int:
        """Bytes of one stored residual element: 2 (fp16), or 1 (uint8, two refinement codes)."""
        return 1 if self.refined else 2

    def outlier_bytes(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        """Outlier bytes of one block: residuals ``[kv_heads, block_size, residual_width]`` (fp16, or packed 4-bit
        codes when ``refined``) plus indices ``[kv_heads, k]``."""
        k = self.outliers
        residual = kv_heads * block_size * self.residual_width * self.residual_itemsize
        return residual + kv_heads * k * self.outlier_index_bytes(head_dim)

    def block_bytes(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        return (
            self.payload_bytes(kv_heads, block_size, head_dim)
            + self.scale_bytes(kv_heads, block_size, head_dim)
            + self.outlier_bytes(kv_heads, block_size, head_dim)
        )

    def reasons_invalid(self, head_dim: int) -> list[str]:
        """Why this spec cannot store vectors of ``head_dim`` (empty when it can)."""
        reasons = []
        if head_dim <= 0:
            reasons.append(f"head_dim must be positive, got {head_dim}")
        else:
            if self.granularity is not None:
                reasons += self.granularity.reasons_invalid(head_dim)
            if self.outliers and self.outliers >= head_dim:
                reasons.append(
                    f"{self.outliers} outlier channels leave nothing to quantize at head_dim {head_dim}; "
                    f"keep fewer than {head_dim} (o1..o{head_dim - 1})"
                )
        return reasons

    def __str__(self) -> str:
        if self.is_passthrough:
            return self.dtype.value
        parts = [self.dtype.value, self.granularity.name]
        if self.dtype.is_int:
            parts.append("sym" if self.symmetric else "asym")
        elif not self.symmetric:
            parts.append("asym")
        parts.append(self.scale_dtype.value)
        if self.static:
            parts.append("static")
        if self.outliers:
            parts.append(f"o{self.outliers}" + ("q" if self.query_ranked else "") + ("r" if self.refined else ""))
        if self.rotate:
            parts.append("rot")
        return ":".join(parts)


# Largest block (and tail) size: a tail of one block per sequence and layer is kept in full precision.
MAX_BLOCK_SIZE = 4096


@dataclass(frozen=True)
class KVFormat:
    """A key spec, a value spec and the block size (the tail holds one block).

    ``sink = S``: positions ``[0, S)`` of every sequence (the attention sink) are *also* kept in full
    precision (the tail dtype) in a per-sequence side buffer, and read from there instead of their sealed
    block rows. Block 0 stays a normal sealed block, so a reader that ignores the sink reads a valid cache.
    ``0 <= S <= block_size``; a passthrough format has nothing to keep (``S > 0`` is a :class:`FormatError`).

    ``tail``: the dtype of the full-precision parts (the tail and the sink rows), one of ``fp32``, ``fp16``,
    ``bf16``; ``None`` (the default): the model's own activation dtype, whatever a cache is given. A float32
    model's tails in ``fp16`` cost half the bytes (what counts where many requests each keep an open block, as
    in vLLM) for a rounding of 2**-11 relative, several times less than an int8 block's; fp16 holds magnitudes
    up to 65504, and a larger key or value is refused when written (``bf16`` keeps float32's range).
    """

    key: QuantSpec
    value: QuantSpec
    block_size: int = 64
    name: str = field(default="", compare=False)
    sink: int = 0
    tail: DType | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 0 < self.block_size <= MAX_BLOCK_SIZE:
            raise FormatError(
                f"block_size must be a positive integer, at most {MAX_BLOCK_SIZE} (the tail holds one block per sequence "
                f"and layer in full precision; 16 to 256 is usual), got {self.block_size!r}"
            )
        if not isinstance(self.sink, int) or isinstance(self.sink, bool) or not 0 <= self.sink <= self.block_size:
            raise FormatError(
                f"sink must be an integer in [0, block_size={self.block_size}] (positions kept in full precision "
                f"at the start of each sequence), got {self.sink!r}"
            )
        if self.sink and self.key.is_passthrough and self.value.is_passthrough:
            raise FormatError(
                f"sink={self.sink} on a format stored in full precision ({self.key}/{self.value}) keeps nothing: "
                "drop 'sink=' or pick a quantized format"
            )
        if self.tail is not None:
            if not isinstance(self.tail, DType) or not self.tail.is_passthrough:
                raise FormatError(
                    f"tail must be fp32, fp16 or bf16 (the full-precision tail's dtype), got {self.tail!r}"
                )
            if self.key.is_passthrough and self.value.is_passthrough:
                raise FormatError(
                    f"tail={self.tail.value} on a format stored in full precision ({self.key}/{self.value}): its "
                    "blocks are the tokens as given; drop 'tail=' or pick a quantized format"
                )
        if self.value.rotate:
            raise FormatError(
                "'rot' rotates keys only (values carry no outlier channels worth spreading, and their per-token "
                "scales already adapt); move 'rot' to the key spec"
            )
        if self.value.outliers:
            raise FormatError(
                f"outlier channels are kept for keys only (a value spec with o{self.value.outliers}): key channels "
                "carry persistent outliers that per-token value scales do not suffer from; move 'o<N>' to the key spec"
            )
        if not self.name:
            object.__setattr__(self, "name", self.spec_string())

    @property
    def is_passthrough(self) -> bool:
        return self.key.is_passthrough and self.value.is_passthrough

    @property
    def is_static(self) -> bool:
        """True when keys or values take calibrated scales (a calibration artifact is required)."""
        return self.key.static or self.value.static

    def spec_string(self) -> str:
        """Canonical string; ``parse_format(f.spec_string()) == f``."""
        sink = f",sink={self.sink}" if self.sink else ""
        tail = f",tail={self.tail.value}" if self.tail is not None else ""
        return f"k={self.key},v={self.value},block={self.block_size}{sink}{tail}"

    def reasons_invalid(self, head_dim: int) -> list[str]:
        return [f"keys: {r}" for r in self.key.reasons_invalid(head_dim)] + [
            f"values: {r}" for r in self.value.reasons_invalid(head_dim)
        ]

    def check(self, head_dim: int) -> None:
        """Raise :class:`FormatError` if this format cannot store vectors of ``head_dim``."""
        reasons = self.reasons_invalid(head_dim)
        if reasons:
            raise FormatError(f"format {self.name!r} cannot be used with head_dim {head_dim}: " + "; ".join(reasons))

    # -- sizes (one layer unless a ``layers`` argument says otherwise) --------------------------------
    def block_bytes(self, kv_heads: int, head_dim: int) -> int:
        """Bytes of one sealed block of one layer, keys and values, scales and padding included."""
        b = self.block_size
        return self.key.block_bytes(kv_heads, b, head_dim) + self.value.block_bytes(kv_heads, b, head_dim)

    def payload_bytes(self, kv_heads: int, head_dim: int) -> int:
        b = self.block_size
        return self.key.payload_bytes(kv_heads, b, head_dim) + self.value.payload_bytes(kv_heads, b, head_dim)

    def scale_bytes(self, kv_heads: int, head_dim: int) -> int:
        b = self.block_size
        return self.key.scale_bytes(kv_heads, b, head_dim) + self.value.scale_bytes(kv_heads, b, head_dim)

    def outlier_bytes(self, kv_heads: int, head_dim: int) -> int:
        """Outlier residual and index bytes of one block (keys only; 0 without outliers)."""
        return self.key.outlier_bytes(kv_heads, self.block_size, head_dim)

    @property
    def has_outliers(self) -> bool:
        return self.key.has_outliers

    @property
    def query_ranked(self) -> bool:
        """The key spec ranks its outlier channels by the queries (``o<N>q``): a calibration artifact must hold
        query statistics."""
        return self.key.query_ranked

    @property
    def needs_artifact(self) -> bool:
        """A cache of this format cannot be built without a calibration artifact: static scales, or outlier
        channels ranked by the queries."""
        return self.is_static or self.query_ranked

    def bytes_per_token(self, kv_heads: int, head_dim: int, layers: int = 1) -> float:
        """Sealed bytes per token over ``layers`` layers (a block's bytes divided by its tokens)."""
        return layers * self.block_bytes(kv_heads, head_dim) / self.block_size

    def bits_per_element(self, kv_heads: int, head_dim: int) -> float:
        """Honest bits per cached element: every stored bit divided by the K and V elements it holds."""
        return 8 * self.block_bytes(kv_heads, head_dim) / (2 * kv_heads * self.block_size * head_dim)

    def tail_element_bytes(self, act_bytes: int = 2) -> int:
        """Bytes of one element of the tail and sink rows: the format's ``tail`` dtype, else the model's
        activations' ``act_bytes``."""
        return act_bytes if self.tail is None else self.tail.bits // 8

    def tail_bytes(self, kv_heads: int, head_dim: int, tail_element_bytes: int = 2) -> int:
        """Bytes of one sequence's full-precision tail in one layer (one block of K and V); elements of
        ``tail_element_bytes`` (the model's activations) unless the format names its ``tail`` dtype."""
        return 2 * kv_heads * self.block_size * head_dim * self.tail_element_bytes(tail_element_bytes)

    def sink_bytes(self, kv_heads: int, head_dim: int, tail_element_bytes: int = 2) -> int:
        """Bytes of one sequence's sink buffer in one layer: ``S`` positions of K and V in the tail dtype
        (0 without a sink)."""
        return 2 * kv_heads * self.sink * head_dim * self.tail_element_bytes(tail_element_bytes)

    def bytes_for_tokens(
        self, tokens: int, kv_heads: int, head_dim: int, layers: int = 1, tail_element_bytes: int = 2
    ) -> int:
        """Bytes one sequence of ``tokens`` occupies: its sealed blocks plus its one-block tail and its sink
        buffer (both per sequence, counted whatever its length)."""
        if self.is_passthrough:
            return math.ceil(tokens / self.block_size) * self.block_bytes(kv_heads, head_dim) * layers
        sealed = tokens // self.block_size
        return layers * (
            sealed * self.block_bytes(kv_heads, head_dim)
            + self.tail_bytes(kv_heads, head_dim, tail_element_bytes)
            + self.sink_bytes(kv_heads, head_dim, tail_element_bytes)
        )

    def _derived_name(self, base: KVFormat | None, block_size: int, sink: int, tail: DType | None) -> str:
        """``preset[,block=N][,sink=N][,tail=T]`` when this format is a preset with other fields, else ``""``
        (the spec string)."""
        if base is None:
            return ""
        name = base.name
        if block_size != base.block_size:
            name += f",block={block_size}"
        name += f",sink={sink}" if sink != base.sink else ""
        return name + (f",tail={tail.value}" if tail is not None else "")

    def _preset_base(self) -> KVFormat | None:
        head = self.name.split(",")[0]
        p = PRESETS.get(head) or PEER_PRESETS.get(head)
        return p if p is not None and (p.key, p.value) == (self.key, self.value) else None

    def with_block_size(self, block_size: int) -> KVFormat:
        """The same specs (sink and tail dtype) with another block size (and tail size)."""
        name = self._derived_name(self._preset_base(), block_size, self.sink, self.tail)
        return KVFormat(self.key, self.value, block_size, name=name, sink=self.sink, tail=self.tail)

    def with_sink(self, sink: int) -> KVFormat:
        """The same format keeping its first ``sink`` positions in full precision (0: no sink)."""
        name = self._derived_name(self._preset_base(), self.block_size, sink, self.tail)
        return KVFormat(self.key, self.value, self.block_size, name=name, sink=sink, tail=self.tail)

    def with_tail(self, tail: DType | None) -> KVFormat:
        """The same format with its tail and sink rows in ``tail`` (fp32, fp16, bf16; None: the model's dtype)."""
        name = self._derived_name(self._preset_base(), self.block_size, self.sink, tail)
        return KVFormat(self.key, self.value, self.block_size, name=name, sink=self.sink, tail=tail)

    def as_static(self) -> KVFormat:
        """The same format with calibrated (static) scales wherever a spec can take them (named
        ``<name>@static``): per-channel, per-head and per-tensor specs become ``static``; per-token and
        per-group specs keep scales computed at seal time. Rotated keys become plain (calibrated ranges are of
        keys as they come, which is also what serving engines store): ``fp8@static`` is plain static e4m3.

        Raises:
            FormatError: neither keys nor values can take static scales.
        """
        key, value = (_static_spec(s) for s in (self.key, self.value))
        if key == self.key and value == self.value and not self.is_static:
            raise FormatError(
                f"format {self.name!r} has no spec that can take calibrated scales (per-channel, per-head or "
                "per-tensor); '@static' would change nothing"
            )
        return KVFormat(key, value, self.block_size, name=f"{self.name}@static", sink=self.sink, tail=self.tail)


def _static_spec(spec: QuantSpec) -> QuantSpec:
    if spec.is_passthrough or not isinstance(spec.granularity, (PerChannel, PerHead, PerTensor)):
        return spec
    if spec.refined:  # refinement codes need the block-local scale step: the spec keeps its own scales
        return spec
    if spec.dtype.is_fp8 and not spec.symmetric:
        # a midpoint is block-local by nature; the calibrated form is what serving engines store: one e4m3
        # scale per head, symmetric (so `fp8@static` is plain static e4m3 whatever the block-local fp8 is)
        return dataclasses.replace(spec, static=True, rotate=False, symmetric=True, granularity=PerHead())
    # calibrated scales are of keys as they come (what a serving engine stores): a rotated spec becomes plain
    return dataclasses.replace(spec, static=True, rotate=False)


# ----------------------------------------------------------------------------------------------------
# Presets

_FP16 = ScaleDType.FP16


def _spec(
    dtype: DType, gran: Granularity | None = None, sym: bool = True, outliers: int = 0, rotate: bool = False
) -> QuantSpec:
    return QuantSpec(dtype, gran, sym, _FP16, outliers=outliers, rotate=rotate)


def _same(spec: QuantSpec, name: str) -> KVFormat:
    return KVFormat(spec, spec, 64, name=name)


# The presets' layouts; PRESETS (below) adds the attention sink to the quantized ones.
_LAYOUTS: dict[str, KVFormat] = {
    "fp16": _same(_spec(DType.FP16), "fp16"),
    "bf16": _same(_spec(DType.BF16), "bf16"),
    # fp8 (e4m3) keys centred per channel and block on the midpoint of their range, then stored rotated by a
    # random-sign Hadamard (kvpack.rotation); values e4m3 with one scale per head and block. Centring takes
    # the constant offsets of biased keys (k_proj bias, outlier channels) out before e4m3's relative error
    # sees them, and the rotation spreads what is left: never worse than plain e4m3 (docs/quality.md).
    # +0.5 bits on keys for the per-channel scale and midpoint of each 64-token block.
    "fp8": KVFormat(
        _spec(DType.FP8_E4M3, PerChannel(), sym=False, rotate=True), _spec(DType.FP8_E4M3, PerHead()), 64, name="fp8"
    ),
    # plain e4m3 keys and values, one scale per head and block: what serving engines store
    "fp8-plain": _same(_spec(DType.FP8_E4M3, PerHead()), "fp8-plain"),
    "fp8_e5m2": _same(_spec(DType.FP8_E5M2, PerHead()), "fp8_e5m2"),
    # fp8 with the 4 largest key channels per head kept as fp16 residuals (chosen per block at seal time)
    "fp8-o4": KVFormat(
        _spec(DType.FP8_E4M3, PerHead(), outliers=4), _spec(DType.FP8_E4M3, PerHead()), 64, name="fp8-o4"
    ),
    # int8 keys per channel with a zero-point per channel and block: keys carry per-channel offsets (a k_proj
    # bias, RoPE's low-frequency pairs), on which symmetric codes spend up to half their range (+0.25 bits on
    # keys); values per token with a zero-point per token: some families' value rows carry an offset too
    # (Gemma 3: KL 1.1e-3 -> 6.3e-4), +16 bits per token. 8.375 bits at 8 kv heads x 128, 8.5 at 3 x 64
    # (docs/quality.md).
    "int8": KVFormat(
        _spec(DType.INT8, PerChannel(), sym=False), _spec(DType.INT8, PerToken(), sym=False), 64, name="int8"
    ),
    "int4": KVFormat(
        _spec(DType.INT4, PerChannel(), sym=False), _spec(DType.INT4, PerGroup(32), sym=False), 64, name="int4"
    ),
    # int4 with the 4 largest key channels per head kept as fp16 residuals (+0.5 bits at head_dim 64)
    "int4-o4": KVFormat(
        _spec(DType.INT4, PerChannel(), sym=False, outliers=4),
        _spec(DType.INT4, PerGroup(32), sym=False),
        64,
        name="int4-o4",
    ),
    "k8v4": KVFormat(_spec(DType.INT8, PerChannel()), _spec(DType.INT4, PerGroup(32), sym=False), 64, name="k8v4"),
    "k4v2": KVFormat(
        _spec(DType.INT4, PerChannel(), sym=False), _spec(DType.INT2, PerGroup(32), sym=False), 64, name="k4v2"
    ),
    "kivi2": KVFormat(
        _spec(DType.INT2, PerChannel(), sym=False), _spec(DType.INT2, PerGroup(32), sym=False), 64, name="kivi2"
    ),
    # The naive layout kept as a comparison point: per-token groups of 32 for keys too.
    "int4-g32": _same(_spec(DType.INT4, PerGroup(32), sym=False), "int4-g32"),
}

# Every quantized preset keeps each sequence's first position (the attention sink: every query attends it,
# its keys are the largest) in full precision as well, for 4 * kv_heads * head_dim bytes per sequence and
# layer. Measured on the embedded model it cuts mean KL by 19-32% (int8, int4, 2-bit; fp8 5%) and keeps the
# needle plain int4 lost at 4k (docs/quality.md). Block 0 is sealed exactly as without it; `<preset>,sink=0`
# opts out.
DEFAULT_SINK = 1
PRESETS: dict[str, KVFormat] = {
    n: f if f.is_passthrough else KVFormat(f.key, f.value, f.block_size, n, DEFAULT_SINK) for n, f in _LAYOUTS.items()
}


# ----------------------------------------------------------------------------------------------------
# Other systems' layouts: what llama.cpp, vLLM and transformers' quanto cache store, in kvpack's spec language,
# so they are evaluated (and sized) like kvpack's presets. None gets a kvpack default the peer does not have:
# no sink, no rotation unless the peer rotates. kvpack still keeps its full-precision tail (one block), so the
# block size is the smallest the kernels run well at (16) where the peer quantizes every token at once, and
# quanto's residual length (128) for quanto. Where each comes from, and where the mapping is not exact:
# docs/formats.md, "Other systems' layouts".


def _peer(name: str, key: QuantSpec, value: QuantSpec | None = None, block: int = 16) -> KVFormat:
    return KVFormat(key, key if value is None else value, block, name=name)


_FP32 = ScaleDType.FP32
PEER_PRESETS: dict[str, KVFormat] = {
    # GGML_TYPE_Q8_0 for the K and V cache (--cache-type-k/-v q8_0): blocks of 32 along head_dim, 32 int8 codes
    # and one fp16 scale (34 bytes per 32 elements): 8.5 bits
    "llamacpp-q8_0": _peer("llamacpp-q8_0", QuantSpec(DType.INT8, PerGroup(32, exact=True), True, _FP16)),
    # GGML_TYPE_Q4_0: 32 4-bit codes and one fp16 scale per 32 elements (18 bytes): 4.5 bits
    "llamacpp-q4_0": _peer("llamacpp-q4_0", QuantSpec(DType.INT4, PerGroup(32, exact=True), True, _FP16)),
    # kv_cache_dtype="int8_per_token_head": one fp32 scale per token and kv head (8.25 bits at head_dim 128)
    "vllm-int8": _peer("vllm-int8", QuantSpec(DType.INT8, PerToken(), True, _FP32)),
    # kv_cache_dtype="fp8_per_token_head": e4m3, one fp32 scale per token and kv head
    "vllm-fp8": _peer("vllm-fp8", QuantSpec(DType.FP8_E4M3, PerToken(), True, _FP32)),
    # kv_cache_dtype="int4_per_token_head": keys and values Hadamard-rotated, asymmetric int4 per token and
    # kv head, one 32-bit word holding the scale and the zero-point (here an fp16 scale + an fp16 zero: the same
    # 32 bits); kvpack rotates keys only
    "vllm-int4": _peer(
        "vllm-int4",
        QuantSpec(DType.INT4, PerToken(), False, _FP16, rotate=True),
        QuantSpec(DType.INT4, PerToken(), False, _FP16),
    ),
    # kv_cache_dtype="fp8" with a checkpoint's (calibrated) k_scale / v_scale: e4m3, one fp32 scale per tensor;
    # static, so it needs a calibration artifact like any '@static' format
    "vllm-fp8-static": _peer("vllm-fp8-static", QuantSpec(DType.FP8_E4M3, PerTensor(), True, _FP32, static=True)),
    # transformers' QuantizedCache(backend="quanto", nbits=4): per-token groups of 64 channels, scale and shift
    # in the model dtype (fp16 here), a residual of 128 full-precision tokens
    "quanto-int4": _peer("quanto-int4", QuantSpec(DType.INT4, PerGroup(64, exact=True), False, _FP16), block=128),
    "quanto-int2": _peer("quanto-int2", QuantSpec(DType.INT2, PerGroup(64, exact=True), False, _FP16), block=128),
}


def preset(name: str) -> KVFormat:
    """The preset called ``name`` (kvpack's own or another system's layout); :class:`FormatError` listing the
    presets otherwise."""
    found = PRESETS.get(name) or PEER_PRESETS.get(name)
    if found is None:
        raise FormatError(
            f"unknown format preset {name!r}; presets are: {', '.join(PRESETS)}; other systems' layouts: "
            f"{', '.join(PEER_PRESETS)}"
        )
    return found


# ----------------------------------------------------------------------------------------------------
# String syntax:  PRESET[,block=N][,sink=N][,tail=T]   or   k=SPEC,v=SPEC[,block=N][,sink=N][,tail=T]   or
#                 kv=SPEC[,...]
# SPEC = DTYPE[:FIELD...]; FIELD = tensor|head|channel|token|g<N> | sym|asym | fp32|fp16|bf16|e8m0|fp8 | static
#        | o<N> (keys only: N outlier channels per kv head kept in full precision) | o<N>q (ranked by the queries)
#        | o<N>r, o<N>qr (kept channels stored as 4-bit refinements of their own codes)

_DTYPE_NAMES = {d.value: d for d in DType} | {"fp8": DType.FP8_E4M3, "e4m3": DType.FP8_E4M3, "e5m2": DType.FP8_E5M2}
_GRAN_NAMES = {"tensor": PerTensor(), "head": PerHead(), "channel": PerChannel(), "token": PerToken()}
_SCALE_NAMES = {s.value: s for s in ScaleDType} | {"fp8": ScaleDType.E8M0}
# tail=: the passthrough dtypes' own names, and torch's
_TAIL_NAMES = {n: d for n, d in _DTYPE_NAMES.items() if d.is_passthrough} | {
    "float32": DType.FP32, "float16": DType.FP16, "bfloat16": DType.BF16}  # fmt: skip

# '<format>@static': the format with calibrated scales wherever a spec can take them (KVFormat.as_static)
STATIC_SUFFIX = "@static"

SYNTAX_HELP = (
    "a format is a preset name ({presets}), optionally followed by ',block=N', ',sink=N' and ',tail=T'; or a "
    "custom 'k=SPEC,v=SPEC[,block=N][,sink=N][,tail=T]' (or 'kv=SPEC'), where SPEC is DTYPE[:FIELD...] with DTYPE in "
    "{dtypes} and FIELDs from: granularity tensor|head|channel|token|g<N>, sym|asym, scale dtype "
    "fp32|fp16|bf16|e8m0 (alias fp8), 'static' for calibrated scales (needs a calibration artifact), and "
    "'o<N>' (keys only) to keep N key channels per kv head in full precision as fp16 residuals ('o<N>q' ranks "
    "them by the queries' energy, from a calibration artifact; a trailing 'r', as in 'o6qr', stores each kept "
    "element as a 4-bit refinement of its own code instead: int8 precision for a quarter of the bytes, integer "
    "'channel' keys only), and 'rot' "
    "(keys only) to store keys rotated by a fixed Hadamard matrix. "
    "'sink=N' keeps the first N positions of every sequence (the attention sink) also in full precision "
    "(0 <= N <= block; 2 x kv_heads x N x head_dim tail-dtype bytes per sequence and layer). "
    "'tail=fp32|fp16|bf16' stores the full-precision tail and sink rows in that dtype (default: the model's). "
    "Append '@static' to a format for calibrated scales wherever a spec can take them ('fp8@static'). "
    "Examples: 'k=int4:channel:asym,v=int2:g32:asym:fp16,block=64', 'k=fp8:head:o4,v=fp8:head', 'int4,sink=1'"
)


def _help() -> str:
    return SYNTAX_HELP.format(presets=", ".join([*PRESETS, *PEER_PRESETS]), dtypes="|".join(d.value for d in DType))


def _field_kind(field: str, is_group: bool) -> str | None:
    if field == "static":
        return "static"
    if field in ("rot", "rotate"):
        return "rotation"
    if re.fullmatch(r"o(?:utliers)?[0-9]+q?r?", field):
        return "outliers"
    if field in _GRAN_NAMES or is_group:
        return "granularity"
    if field in ("sym", "asym"):
        return "symmetry"
    return "scale dtype" if field in _SCALE_NAMES else None


def _parse_spec(text: str, role: str) -> QuantSpec:
    parts = [p.strip().lower() for p in text.split(":") if p.strip()]
    if not parts:
        raise FormatError(f"empty {role} spec; {_help()}")
    dtype = _DTYPE_NAMES.get(parts[0])
    if dtype is None:
        raise FormatError(f"unknown {role} dtype {parts[0]!r}; valid dtypes: {', '.join(d.value for d in DType)}")
    if dtype.is_passthrough:
        if len(parts) > 1:
            raise FormatError(f"{dtype.value} is stored as is and takes no fields, got {':'.join(parts[1:])!r}")
        return QuantSpec(dtype)
    gran: Granularity | None = None
    sym: bool | None = None
    scale = ScaleDType.FP16
    static = False
    outliers = 0
    query_ranked = False
    refined = False
    rotate = False
    seen: dict[str, str] = {}  # field kind -> the field that set it: a second one is a contradiction
    for p in parts[1:]:
        group = re.fullmatch(r"g(?:roup)?([0-9]+)", p)
        kind = _field_kind(p, group is not None)
        if kind is None:
            raise FormatError(
                f"unknown field {p!r} in {role} spec {text!r}; fields are granularity "
                "(tensor, head, channel, token, g<N>), sym|asym, scale dtype (fp32, fp16, bf16, e8m0), static, "
                "o<N> or o<N>q (outlier key channels, ranked by range or by the queries; o<N>r, o<N>qr refined), "
                "rot (rotated keys)"
            )
        if kind in seen:
            raise FormatError(f"{role} spec {text!r} gives the {kind} twice ({seen[kind]!r} and {p!r}); keep one")
        seen[kind] = p
        if p == "static":
            static = True
        elif kind == "rotation":
            if role != "key":
                raise FormatError(f"{p!r} in the {role} spec {text!r}: keys only; move it to the k= spec")
            rotate = True
        elif kind == "outliers":
            if role != "key":
                raise FormatError(
                    f"{p!r} in the {role} spec {text!r}: outlier channels are kept for keys only; "
                    "move it to the k= spec (with kv=, give k= and v= separately)"
                )
            outliers = int(re.sub(r"[^0-9]", "", p))
            refined = p.endswith("r")
            query_ranked = p.rstrip("r").endswith("q")
            if outliers <= 0:
                raise FormatError(f"{p!r} in the {role} spec {text!r}: o<N> keeps N > 0 channels; drop it for none")
        elif group:
            gran = PerGroup(int(group.group(1)))
        elif p in _GRAN_NAMES:
            gran = _GRAN_NAMES[p]
        elif p in ("sym", "asym"):
            sym = p == "sym"
        else:
            scale = _SCALE_NAMES[p]
    if gran is None:  # the defaults DESIGN agreed on: keys per channel, values per token
        gran = PerHead() if dtype.is_fp8 else (PerChannel() if role == "key" else PerToken())
    if sym is None:
        sym = dtype.is_fp8 or dtype is DType.INT8
    return QuantSpec(dtype, gran, sym, scale, static, outliers, rotate, query_ranked, refined)


def parse_format(text: str | KVFormat) -> KVFormat:
    """Parse a preset name or a custom format string (see :data:`SYNTAX_HELP`)."""
    if isinstance(text, KVFormat):
        return text
    if not isinstance(text, str) or not text.strip():
        raise FormatError(f"empty format; {_help()}")
    if text.strip().lower().endswith(STATIC_SUFFIX):  # a format with calibrated scales where it can take them
        rest = text.strip()[: -len(STATIC_SUFFIX)]
        if "@" in rest:
            raise FormatError(f"{text!r}: '@static' is a suffix given once, at the end (e.g. 'fp8@static')")
        return parse_format(rest).as_static()
    if "@" in text:
        raise FormatError(f"{text!r}: the only '@' suffix is '@static', at the end (e.g. 'fp8@static')")
    fields = [f.strip() for f in text.strip().split(",") if f.strip()]
    base: KVFormat | None = None
    key = value = None
    block: int | None = None
    sink: int | None = None
    tail: DType | None = None
    seen: set[str] = set()
    for f in fields:
        name, eq, arg = f.partition("=")
        name = name.strip().lower()
        if eq:  # a field given twice (k= twice, k= and kv=, block= twice, ...) is a mistake, not an override
            slot = {"key": "k", "keys": "k", "value": "v", "values": "v", "block_size": "block"}.get(name, name)
            slots = {"k", "v"} if slot == "kv" else {slot}
            if slots & seen:
                raise FormatError(f"{text!r}: {name}= is given twice (or both k=/v= and kv=); give each field once")
            seen |= slots
        if not eq:
            if base is not None or key is not None:
                raise FormatError(f"{f!r}: only one preset per format; {_help()}")
            base = preset(name)
            continue
        if name in ("k", "key", "keys"):
            key = _parse_spec(arg, "key")
        elif name in ("v", "value", "values"):
            value = _parse_spec(arg, "value")
        elif name == "kv":
            key, value = _parse_spec(arg, "key"), _parse_spec(arg, "value")
        elif name in ("block", "block_size"):
            if not re.fullmatch(r"[0-9]+", arg.strip()) or not 0 < int(arg) <= MAX_BLOCK_SIZE:
                raise FormatError(
                    f"block must be a positive integer, at most {MAX_BLOCK_SIZE} (16 to 256 is usual), got {arg!r}"
                )
            block = int(arg)
        elif name == "sink":
            if not re.fullmatch(r"[0-9]+", arg.strip()):
                raise FormatError(
                    f"sink must be a non-negative integer (positions kept in full precision), got {arg!r}"
                )
            sink = int(arg)
        elif name == "tail":
            tail = _TAIL_NAMES.get(arg.strip().lower())
            if tail is None:
                raise FormatError(
                    f"tail must be fp32, fp16 or bf16 (the dtype of the full-precision tail and sink rows), got {arg!r}"
                )
        else:
            raise FormatError(f"unknown field {name!r}; {_help()}")
    if base is not None:
        if key is not None or value is not None:
            raise FormatError(f"{text!r}: give either a preset or k=/v= specs, not both")
        fmt = base if block is None or block == base.block_size else base.with_block_size(block)
        fmt = fmt if sink is None or sink == fmt.sink else fmt.with_sink(sink)
        return fmt if tail is None else fmt.with_tail(tail)
    if key is None or value is None:
        raise FormatError(f"{text!r}: a custom format needs both k= and v= (or kv=); {_help()}")
    fmt = KVFormat(key, value, block or 64, sink=sink or 0)
    for p in (*PRESETS.values(), *PEER_PRESETS.values()):  # a custom string that spells a preset gets its name
        if p == fmt:
            return p if tail is None else p.with_tail(tail)
    return fmt if tail is None else KVFormat(key, value, block or 64, sink=sink or 0, tail=tail)


_ATTACH_FIELDS = ("block", "block_size", "sink", "tail")  # fields that always belong to the format before them
_KEY_FIELDS = ("k", "key", "keys", "kv")
_VALUE_FIELDS = ("v", "value", "values")


def split_formats(text: str) -> list[str]:
    """Split a list of formats written on one line into one string per format.

    ``;`` separates formats when present (``k=int8,v=int4;int8``). Otherwise commas do, and the pieces
    that are fields of the format before them are joined back to it: ``block=``/``sink=`` always, a ``v=``
    after a ``k=``; ``int4,sink=1,int8,k=int8,v=int4:g32`` is ``["int4,sink=1", "int8", "k=int8,v=int4:g32"]``.
    The pieces are not parsed here (:func:`parse_format` does that, with its error messages). A per-layer
    plan (:mod:`kvpack.plans`) is one piece: commas inside its ``[layers]`` and in the formats of its
    overrides stay with it (``int4/int8[0,5-6],int8`` is ``["int4/int8[0,5-6]", "int8"]``).
    """
    if ";" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    groups: list[list[str]] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        last = piece.rsplit("/", 1)[-1]  # a plan's override: its own fields follow
        name = last.partition("=")[0].strip().lower() if "=" in last else ""
        cur = groups[-1] if groups else None
        cur_last = [] if cur is None else [c.rsplit("/", 1)[-1] for c in cur]
        cur_names = [c.partition("=")[0].strip().lower() for c in cur_last if "=" in c]
        open_bracket = cur is not None and ",".join(cur).count("[") > ",".join(cur).count("]")
        attach = cur is not None and (
            open_bracket
            or name in _ATTACH_FIELDS
            or (
                name in _VALUE_FIELDS
                and any(n in _KEY_FIELDS for n in cur_names)
                and not any(n in _VALUE_FIELDS or n == "kv" for n in cur_names)
            )
        )
        if attach:
            cur.append(piece)
        else:
            groups.append([piece])
    return [",".join(g) for g in groups]
