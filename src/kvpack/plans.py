"""Per-layer plans: one format for most layers, wider (or narrower) ones for the layers that need them.

Layer errors differ by 10-25x between layers of one model (``kvpack eval``'s sensitivity sweep), so the
fewest bits for a quality budget is rarely one format everywhere. A plan is written as a base format followed
by ``/FORMAT[LAYERS]`` overrides, layers 0-based, ranges inclusive::

    int4/int8[0,5-6]              int4 everywhere, int8 in layers 0, 5 and 6
    k4v2/int4[1-3]/int8[0]        k4v2, int4 in layers 1-3, int8 in layer 0
    int4/k=int8:channel,v=int4:g32:asym[0]   any format string works in an override

``cache_for`` (a layered cache: :class:`kvpack.cache.LayeredKVCache`), ``kvpack size``, ``kvpack eval --formats``
and the vLLM backend (formats sharing the base's block size and sink) take a plan string; ``kvpack eval --plan
KL_BUDGET`` proposes one. A plain format is a plan with no overrides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpack.errors import FormatError
from kvpack.formats import KVFormat, parse_format

__all__ = ["LayerPlan", "is_plan", "layer_formats", "parse_plan"]

_OVERRIDE = re.compile(r"^(?P<fmt>.+)\[(?P<layers>[^\[\]]*)\]$", re.S)


@dataclass(frozen=True)
class LayerPlan:
    """A base format and per-layer overrides.

    Attributes:
        base: the format of every layer not named in an override.
        overrides: ``(format, layers)`` pairs; the layer sets are disjoint and non-empty.
    """

    base: KVFormat
    overrides: tuple[tuple[KVFormat, frozenset[int]], ...] = ()

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for fmt, layers in self.overrides:
            if not layers:
                raise FormatError(f"an override of {fmt.name!r} names no layer")
            if any(i < 0 for i in layers):
                raise FormatError(f"layer indices are 0-based and non-negative, got {sorted(layers)}")
            twice = seen & layers
            if twice:
                raise FormatError(f"layer(s) {sorted(twice)} are given two formats; name each layer once")
            seen |= layers

    @property
    def name(self) -> str:
        """The canonical plan string (parses back to an equal plan)."""
        parts = [self.base.name]
        for fmt, layers in self.overrides:
            parts.append(f"{fmt.name}[{_ranges(layers)}]")
        return "/".join(parts)

    def spec_string(self) -> str:
        """The plan with every format spelled out (:meth:`KVFormat.spec_string`)."""
        parts = [self.base.spec_string()]
        for fmt, layers in self.overrides:
            parts.append(f"{fmt.spec_string()}[{_ranges(layers)}]")
        return "/".join(parts)

    @property
    def sink(self) -> int:
        """The base format's sink (overrides keep their own)."""
        return self.base.sink

    def reasons_invalid(self, head_dim: int) -> list[str]:
        """Why a format of the plan cannot store ``head_dim`` (empty list: every one can)."""
        out = list(self.base.reasons_invalid(head_dim))
        for fmt, _ in self.overrides:
            out += [f"{fmt.name}: {r}" for r in fmt.reasons_invalid(head_dim)]
        return out

    def layer_counts(self, num_layers: int) -> list[tuple[KVFormat, int]]:
        """Each distinct format of the plan and how many of the ``num_layers`` layers it stores."""
        counts: dict[KVFormat, int] = {}
        for f in self.formats(num_layers):
            counts[f] = counts.get(f, 0) + 1
        return list(counts.items())

    @property
    def distinct_formats(self) -> list[KVFormat]:
        """The plan's formats, each once, the base first."""
        return list(dict.fromkeys([self.base, *(fmt for fmt, _ in self.overrides)]))

    @property
    def is_uniform(self) -> bool:
        """True when every layer has the same format (no override, or overrides equal to the base)."""
        return all(fmt == self.base for fmt, _ in self.overrides)

    def formats(self, num_layers: int) -> list[KVFormat]:
        """One format per layer.

        Raises:
            FormatError: an override names a layer the model does not have.
        """
        out = [self.base] * num_layers
        for fmt, layers in self.overrides:
            extra = sorted(i for i in layers if i >= num_layers)
            if extra:
                raise FormatError(
                    f"plan {self.name!r} names layer(s) {extra} but the model has {num_layers} layers (0-{num_layers - 1})"
                )
            for i in layers:
                out[i] = fmt
        return out

    def bytes_per_token(self, kv_heads: int, head_dim: int, num_layers: int) -> float:
        """Stored bytes per token over all layers (scales and zero-points included; tails and sinks not)."""
        return sum(f.bytes_per_token(kv_heads, head_dim) for f in self.formats(num_layers))

    def bits_per_element(self, kv_heads: int, head_dim: int, num_layers: int) -> float:
        """Honest bits per stored element, averaged over the layers."""
        fmts = self.formats(num_layers)
        return sum(f.bits_per_element(kv_heads, head_dim) for f in fmts) / len(fmts)

    def check(self, head_dim: int) -> None:
        """Raise :class:`FormatError` unless every format of the plan can store ``head_dim``."""
        self.base.check(head_dim)
        for fmt, _ in self.overrides:
            fmt.check(head_dim)


def _ranges(layers: frozenset[int]) -> str:
    xs = sorted(layers)
    out, start = [], xs[0]
    for a, b in zip(xs, [*xs[1:], None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _layers(text: str, whole: str) -> frozenset[int]:
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"([0-9]+)(?:\s*-\s*([0-9]+))?", part)
        if not m:
            raise FormatError(f"{whole!r}: layers are 0-based numbers and ranges like [0,5-6], got {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise FormatError(f"{whole!r}: the range {part!r} runs backwards; write {hi}-{lo}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def is_plan(text: object) -> bool:
    """Whether ``text`` is a plan (a :class:`LayerPlan`, or a string with ``/FORMAT[LAYERS]`` overrides)."""
    return isinstance(text, LayerPlan) or (isinstance(text, str) and "/" in text)


def parse_plan(text: str | KVFormat | LayerPlan) -> LayerPlan:
    """Parse a plan string (module docstring); a plain format becomes a plan without overrides.

    Raises:
        FormatError: a format of the plan does not parse, a layer list is malformed, or a layer is named twice.
    """
    if isinstance(text, LayerPlan):
        return text
    if isinstance(text, KVFormat):
        return LayerPlan(text)
    if not isinstance(text, str) or not text.strip():
        raise FormatError("empty plan; write a format, optionally followed by /FORMAT[LAYERS] overrides")
    head, *rest = text.strip().split("/")
    if _OVERRIDE.match(head.strip()):
        raise FormatError(f"{text!r}: the first part is the base format of every other layer and takes no [layers]")
    overrides = []
    for part in rest:
        m = _OVERRIDE.match(part.strip())
        if not m:
            raise FormatError(
                f"{text!r}: each part after a '/' is FORMAT[LAYERS], e.g. 'int4/int8[0,5-6]'; got {part.strip()!r}"
            )
        overrides.append((parse_format(m.group("fmt").strip()), _layers(m.group("layers"), text)))
    return LayerPlan(parse_format(head.strip()), tuple(overrides))


def layer_formats(text: str | KVFormat | LayerPlan, num_layers: int) -> list[KVFormat]:
    """One format per layer for a format or a plan."""
    if isinstance(text, KVFormat):
        return [text] * num_layers
    return parse_plan(text).formats(num_layers)
