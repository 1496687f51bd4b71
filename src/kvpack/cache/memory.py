"""Memory accounting of a :class:`~kvpack.cache.PagedKVCache`, and its consistency checks.

Every byte the cache allocated on its device falls in exactly one bucket per layer:
``payload + scale + outlier + tail + sink + cached + unused == allocated``. ``shared`` is not a bucket: it is
what sharing saved (blocks referenced by several sequences counted once). The identity the tests check, for
quantized formats: ``payload + scale + outlier + tail + sink + host == theoretical - shared``, where ``theoretical`` sums
:meth:`kvpack.formats.KVFormat.bytes_for_tokens` over the sequences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from kvpack.cache.config import CacheConfig
from kvpack.cache.offload import HostTier
from kvpack.cache.pool import BlockPool
from kvpack.cache.sink import PrefixSinks
from kvpack.cache.slots import SlotTable
from kvpack.cache.storage import BlockStorage
from kvpack.calibration.static import ClipMonitor

__all__ = ["LayerMemory", "MemoryReport", "memory_report", "problems"]


@dataclass
class LayerMemory:
    """Bytes of one layer (or the total over layers).

    Attributes:
        payload_bytes: packed K/V of blocks in use (reference count > 0).
        scale_bytes: scales and zero-points of blocks in use.
        outlier_bytes: outlier key channels of blocks in use (fp16 residuals and channel indices).
        tail_bytes: full-precision tails of live sequences.
        sink_bytes: full-precision sink buffers of live sequences (a format with ``sink > 0``).
        cached_bytes: unreferenced blocks kept for prefix reuse (evictable: available to allocations), plus
            the sink rows kept beside registered first blocks for prefix reuse (a format with a sink).
        unused_bytes: allocated but holding nothing: free blocks, the null block, empty tail and sink slots.
        shared_bytes: saved by sharing: ``(references - 1) x block bytes`` summed over blocks in use.
        host_bytes: blocks offloaded to the host tier (not on the device).
        live_tokens: tokens held by live sequences (positions released by a sliding window excluded).
        theoretical_bytes: ``KVFormat.bytes_for_tokens`` summed over live sequences.
    """

    payload_bytes: int = 0
    scale_bytes: int = 0
    outlier_bytes: int = 0
    tail_bytes: int = 0
    sink_bytes: int = 0
    cached_bytes: int = 0
    unused_bytes: int = 0
    shared_bytes: int = 0
    host_bytes: int = 0
    live_tokens: int = 0
    theoretical_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        """Device bytes holding live data: payload, scales, outlier channels, tails and sink buffers."""
        return self.payload_bytes + self.scale_bytes + self.outlier_bytes + self.tail_bytes + self.sink_bytes

    @property
    def allocated_bytes(self) -> int:
        """Every device byte of the layer's pools and tails."""
        return self.used_bytes + self.cached_bytes + self.unused_bytes

    def __add__(self, other: LayerMemory) -> LayerMemory:
        return LayerMemory(**{k: getattr(self, k) + getattr(other, k) for k in asdict(self)})

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "used_bytes": self.used_bytes, "allocated_bytes": self.allocated_bytes}


@dataclass
class MemoryReport:
    """Per-layer and total memory of a cache, plus pool occupancy.

    ``clipped`` is the health of static (calibrated) sealing, ``cache.clip_monitor.report()``:
    ``{"clipped": [per layer], "sealed": [per layer], "fraction": [per layer], "threshold": t,
    "layers_over_threshold": [...]}``; ``None`` when the format has no ``static`` spec.
    """

    format: str
    layers: list[LayerMemory]
    total: LayerMemory
    num_blocks: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int
    host_blocks: int
    sequences: int
    notes: list[str] = field(default_factory=list)
    clipped: dict | None = None

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("layers", "total")}
        d["layers"] = [m.as_dict() for m in self.layers]
        d["total"] = self.total.as_dict()
        return d

    def __str__(self) -> str:
        t = self.total
        mib = 1 / 2**20
        lines = [
            f"format {self.format}: {self.sequences} sequences, {t.live_tokens} live tokens over {len(self.layers)} layers",
            f"blocks: {self.used_blocks} used, {self.cached_blocks} cached, {self.free_blocks} free of {self.num_blocks - 1}"
            f" ({self.host_blocks} on the host)",
            f"used {t.used_bytes * mib:.2f} MiB (payload {t.payload_bytes * mib:.2f}, scales {t.scale_bytes * mib:.2f}, "
            + (f"outliers {t.outlier_bytes * mib:.2f}, " if t.outlier_bytes else "")
            + f"tails {t.tail_bytes * mib:.2f}); theoretical {t.theoretical_bytes * mib:.2f} MiB; "
            f"shared saves {t.shared_bytes * mib:.2f} MiB",
            f"allocated {t.allocated_bytes * mib:.2f} MiB (cached {t.cached_bytes * mib:.2f}, unused {t.unused_bytes * mib:.2f});"
            f" host {t.host_bytes * mib:.2f} MiB",
        ]
        if t.sink_bytes:
            lines.append(
                f"sinks {t.sink_bytes:,} bytes ({t.sink_bytes * mib:.4f} MiB, in used): each sequence's first "
                "positions kept in full precision (KVFormat.sink_bytes per sequence and layer)"
            )
        if self.clipped is not None:
            c = self.clipped
            lines.append(
                f"static scales: {sum(c['clipped'])} of {sum(c['sealed'])} sealed values clipped; layers over the "
                f"{c['threshold']:.2%} threshold: {c['layers_over_threshold'] or 'none'}"
            )
        return "\n".join(lines + self.notes)


def memory_report(
    config: CacheConfig,
    table: SlotTable,
    pool: BlockPool,
    storage: BlockStorage,
    host: HostTier,
    prefix_sinks: PrefixSinks,
    clip_monitor: ClipMonitor,
) -> MemoryReport:
    """The memory of a cache, from its parts. See :meth:`kvpack.cache.PagedKVCache.memory_report`."""
    refs = pool.ref_counts()
    used = sum(1 for r in refs if r > 0)
    shared_refs = sum(r - 1 for r in refs if r > 1)
    cached, free = pool.num_cached, pool.num_free
    payload, scale, outlier = storage.block_nbytes()
    block = payload + scale + outlier
    h, b, d = config.kv_heads, config.block_size, config.head_dim
    elem = table.tail_k.element_size()
    tail_slot = 2 * h * b * d * elem
    slots = table.num_slots
    nseq = len(table.seqs)
    host_blocks = host.num_blocks()
    host_per_layer = host_blocks * block
    sink_slot = 2 * h * config.sink * d * elem
    sink_kept = prefix_sinks.nbytes() // config.num_layers if config.sink else 0
    layers = []
    for layer in range(config.num_layers):
        live = theory = 0
        for seq in table.seqs.values():
            held = int(table.lens_np[layer, seq.slot]) - seq.released * b
            live += held
            theory += config.format.bytes_for_tokens(held, h, d, tail_element_bytes=elem)
        layers.append(
            LayerMemory(
                payload_bytes=used * payload,
                scale_bytes=used * scale,
                outlier_bytes=used * outlier,
                tail_bytes=nseq * tail_slot,
                sink_bytes=nseq * sink_slot,
                cached_bytes=cached * block + sink_kept,
                unused_bytes=(free + 1) * block + (slots - nseq) * (tail_slot + sink_slot),
                shared_bytes=shared_refs * block,
                host_bytes=host_per_layer,
                live_tokens=live,
                theoretical_bytes=theory,
            )
        )
    total = LayerMemory()
    for m in layers:
        total = total + m
    notes = []
    if config.format.is_passthrough:
        notes.append("passthrough format: the formula rounds up to whole blocks, the cache keeps a tail instead")
    return MemoryReport(
        format=config.format.name,
        layers=layers,
        total=total,
        num_blocks=pool.num_blocks,
        used_blocks=used,
        cached_blocks=cached,
        free_blocks=free,
        host_blocks=host_blocks,
        sequences=nseq,
        notes=notes,
        clipped=None if config.calibration is None else clip_monitor.report(),
    )


def problems(table: SlotTable, pool: BlockPool, host: HostTier) -> list[str]:
    """Consistency of a cache's parts (empty when consistent). See :meth:`kvpack.cache.PagedKVCache.problems`."""
    out = list(pool.problems())
    held: Counter[int] = Counter()
    slots = set()
    b = table.block_size
    for seq in table.seqs.values():
        if seq.slot in slots:
            out.append(f"sequence {seq.sid} shares tail slot {seq.slot}")
        slots.add(seq.slot)
        held.update(blk for blk in seq.blocks if blk)
        lens = table.lens_np[:, seq.slot]
        if len(seq.blocks) < int(lens.max()) // b:
            out.append(f"sequence {seq.sid} holds {int(lens.max())} tokens but only {len(seq.blocks)} blocks")
        if any(seq.blocks[j] for j in range(seq.released)):
            out.append(f"sequence {seq.sid} still references a block released by the window")
        row = table.tables_np[seq.slot]
        if list(row[: len(seq.blocks)]) != seq.blocks or row[len(seq.blocks) :].any():
            out.append(f"block table row of sequence {seq.sid} does not mirror its blocks")
        if seq.offloaded != (seq.sid in host):
            out.append(f"sequence {seq.sid} offload flag disagrees with the host tier")
    refs = pool.ref_counts()
    for blk in range(1, pool.num_blocks):
        if refs[blk] != held[blk]:
            out.append(f"block {blk} has reference count {refs[blk]} but {held[blk]} references")
    free_slots = set(table.free_slots)
    if free_slots & slots or len(free_slots | slots) != table.num_slots:
        out.append("tail slots leaked or double-booked")
    return out
