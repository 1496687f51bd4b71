"""A cache with one format per layer: one :class:`PagedKVCache` per distinct format of a plan, one id space.

Each format's layers live in their own paged cache (its own pool, block size, scales and tails), so no layout
changes for anyone: the kernels see the same :class:`~kvpack.kernels.PagedKV` views. A sequence of the
layered cache is one sequence in every part, created, forked, cropped, reordered and freed in all of them
together; an operation that fails in one part leaves the others as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvpack.cache.memory import LayerMemory, MemoryReport
from kvpack.cache.paged import PagedKVCache
from kvpack.errors import CalibrationError, ConfigError, ShapeError
from kvpack.formats import KVFormat
from kvpack.kernels.views import PagedKV

__all__ = ["LayeredKVCache"]


class LayeredKVCache:
    """Paged storage for a per-layer plan (``kvpack.plans``).

    Args:
        formats: one :class:`KVFormat` per layer.
        kv_heads, head_dim: the model's geometry.
        blocks_for: ``blocks_for(fmt) -> num_blocks`` for each part's pool.
        window: per-layer sliding windows (``None`` entries: full attention), or ``None``.
        calibration: a :class:`~kvpack.calibration.Artifact` of the model: each part whose format needs one
            (``static`` specs, query-ranked outlier channels ``o<N>q``) takes its layers' rows
            (:meth:`~kvpack.calibration.Artifact.select_layers`); the other parts take none (outlier channels
            ranked by range stay chosen per block).
        **kw: passed to every :class:`PagedKVCache` (``tail_dtype``, ``device``).

    Raises:
        CalibrationError: ``calibration`` is not an artifact, or no format of the plan takes it (it would be
            ignored); a part's own checks (a static format without it, scales made for another spec).
    """

    def __init__(
        self,
        formats: Sequence[KVFormat],
        kv_heads: int,
        head_dim: int,
        blocks_for: Any,
        window: Sequence[int | None] | None = None,
        calibration: Any = None,
        **kw: Any,
    ) -> None:
        if not formats:
            raise ConfigError("a layered cache needs at least one layer")
        if calibration is not None:
            self.check_calibration(calibration, formats)
        self.formats = list(formats)
        self.num_layers = len(self.formats)
        windows = list(window) if window is not None else [None] * self.num_layers
        if len(windows) != self.num_layers:
            raise ShapeError(f"window must give one entry per layer ({self.num_layers}), got {len(windows)}")
        distinct: list[KVFormat] = []
        for f in self.formats:
            if f not in distinct:
                distinct.append(f)
        self.parts: list[PagedKVCache] = []
        self.where: list[tuple[int, int]] = [(0, 0)] * self.num_layers  # layer -> (part, layer in the part)
        for p, fmt in enumerate(distinct):
            layers = [i for i, f in enumerate(self.formats) if f == fmt]
            for local, i in enumerate(layers):
                self.where[i] = (p, local)
            cal = calibration.select_layers(layers) if calibration is not None and fmt.needs_artifact else None
            part = PagedKVCache(
                fmt,
                len(layers),
                kv_heads,
                head_dim,
                blocks_for(fmt),
                window=[windows[i] for i in layers],
                calibration=cal,
                **kw,
            )
            self.parts.append(part)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self._ids: dict[int, list[int]] = {}  # layered id -> the id in each part
        self._next = 0

    @staticmethod
    def check_calibration(calibration: Any, formats: Sequence[KVFormat]) -> None:
        """Refuse a ``calibration`` that is not an artifact, or that no format of ``formats`` takes."""
        from kvpack.calibration.artifact import Artifact

        if not isinstance(calibration, Artifact):
            raise CalibrationError(
                "a per-layer plan takes a calibration artifact (load_artifact(DIR)), whose rows each part takes "
                f"for its layers; got {type(calibration).__name__}"
            )
        if not any(f.needs_artifact for f in formats):
            raise CalibrationError(
                "no format of this plan takes a calibration artifact (static specs, or o<N>q outlier channels), "
                "so it would be ignored; drop it"
            )

    # -- sequences ------------------------------------------------------------------------------------
    def _part_ids(self, sid: int) -> list[int]:
        try:
            return self._ids[sid]
        except KeyError:
            raise ShapeError(f"unknown sequence id {sid!r}; live sequences are {sorted(self._ids)}") from None

    def _new(self, ids: list[int]) -> int:
        sid = self._next
        self._next += 1
        self._ids[sid] = ids
        return sid

    def _all_or_nothing(self, make) -> list[int]:
        made: list[int] = []
        try:
            for p, part in enumerate(self.parts):
                made.append(make(p, part))
        except Exception:
            for part, i in zip(self.parts, made):
                part.free(i)
            raise
        return made

    def add_sequence(self) -> int:
        """A new empty sequence in every part; its layered id."""
        return self._new(self._all_or_nothing(lambda _p, part: part.add_sequence()))

    def fork(self, sid: int) -> int:
        """A copy of ``sid`` sharing its sealed blocks in every part."""
        ids = self._part_ids(sid)
        return self._new(self._all_or_nothing(lambda p, part: part.fork(ids[p])))

    def free(self, sid: int) -> None:
        for part, i in zip(self.parts, self._ids.pop(sid)):
            part.free(i)

    def crop(self, sid: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``sid`` in every layer."""
        for part, i in zip(self.parts, self._part_ids(sid)):
            part.crop(i, n)

    def reorder(self, seq_ids: Sequence[int], src: Sequence[int] | torch.Tensor) -> None:
        """Beam reorder (:meth:`PagedKVCache.reorder`) in every part."""
        cols = [self._part_ids(s) for s in seq_ids]
        for p, part in enumerate(self.parts):
            part.reorder([c[p] for c in cols], src)

    # -- layers ---------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> tuple[PagedKVCache, int]:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        p, local = self.where[layer]
        return self.parts[p], local

    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``[batch, kv_heads, T, head_dim]`` keys and values to ``layer`` of each sequence."""
        part, local = self._layer(layer)
        p = self.where[layer][0]
        part.append(local, [self._part_ids(s)[p] for s in seq_ids], k, v)

    def seq_len(self, sid: int, layer: int = 0) -> int:
        part, local = self._layer(layer)
        return part.seq_len(self._part_ids(sid)[self.where[layer][0]], layer=local)

    def view(self, layer: int, seq_ids: Sequence[int]) -> PagedKV:
        """The kernel-facing view of one layer (its part's format) for ``seq_ids``."""
        part, local = self._layer(layer)
        p = self.where[layer][0]
        return part.view(local, [self._part_ids(s)[p] for s in seq_ids])

    # -- reporting ------------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """The parts' reports merged: layers in model order, totals and block counts summed."""
        reports = [part.memory_report() for part in self.parts]
        layers = [reports[p].layers[local] for p, local in self.where]
        total = LayerMemory(
            **{f.name: sum(getattr(r.total, f.name) for r in reports) for f in dataclasses.fields(LayerMemory)}
        )
        notes = [n for r in reports for n in r.notes]
        return MemoryReport(
            format="/".join(r.format for r in reports),
            layers=layers,
            total=total,
            num_blocks=sum(r.num_blocks for r in reports),
            used_blocks=sum(r.used_blocks for r in reports),
            cached_blocks=sum(r.cached_blocks for r in reports),
            free_blocks=sum(r.free_blocks for r in reports),
            host_blocks=sum(r.host_blocks for r in reports),
            sequences=len(self._ids),
            notes=notes,
        )

    def problems(self) -> list[str]:
        """Every part's consistency problems, prefixed with its format."""
        return [f"{part.format.name}: {p}" for part in self.parts for p in part.problems()]
