"""The per-sequence state of a cache: sequences, their slots, and the slot-indexed arrays of all layers.

A live sequence owns one **slot**: a row of every slot-indexed array, in every layer. :class:`SlotTable`
holds those arrays (tails, sink rows, lengths, block tables) and the sequences (:class:`SeqState`), and
resolves a batch of sequence ids to slots (:class:`Batch`). It is the state that
:class:`~kvpack.cache.PagedKVCache`, the write path, the offload tier and the memory report share; the
block pool and the packed pools live beside it (:mod:`kvpack.cache.pool`, :mod:`kvpack.cache.storage`).

The arrays are replaced when the table grows (more slots, wider block tables), and every change of which
sequence sits where, or of a block table, bumps :attr:`SlotTable.version`: read them through the table
each time, and key anything derived from them by that version.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpack.errors import SequenceError, ShapeError

__all__ = ["Batch", "SeqState", "SlotTable", "batch_key"]

_MAX_BATCHES = 256  # cached batch resolutions before the cache is cleared


@dataclass
class SeqState:
    """Host-side state of one sequence (its lengths live in :attr:`SlotTable.lens`)."""

    sid: int
    slot: int
    blocks: list[int] = field(default_factory=list)  # logical block -> block id (0: released by the window)
    tokens: list[int] = field(default_factory=list)  # recorded token ids (may run ahead of the cache)
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the first len(keys) blocks
    impure: set[int] = field(default_factory=set)  # blocks re-sealed from crop-returned values
    released: int = 0  # leading blocks released by the sliding window
    prefix_len: int = 0  # tokens reused from cached blocks at add_sequence
    offloaded: bool = False


@dataclass
class Batch:
    """A batch of sequences resolved to slots (cached per id tuple until the table's version changes).

    Attributes:
        version: the :attr:`SlotTable.version` it was resolved at.
        seqs: the sequences, in batch order.
        slots: ``[batch]`` int64 numpy, their slots.
        slots_t: ``[batch]`` int64 torch on the table's device, the same.
        start: the first slot when the slots are consecutive (views are then slices, not copies), else None.
    """

    version: int
    seqs: list[SeqState]
    slots: np.ndarray
    slots_t: torch.Tensor
    start: int | None


def batch_key(seq_ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """``seq_ids`` as a tuple of ids (:class:`ShapeError` for a bare id)."""
    if isinstance(seq_ids, torch.Tensor):
        return tuple(seq_ids.tolist())
    if isinstance(seq_ids, (int, np.integer)):
        raise ShapeError("seq_ids must be a sequence of ids (wrap a single id in a list)")
    return tuple(seq_ids)


class SlotTable:
    """Sequences and the slot-indexed arrays of all ``L`` layers.

    Attributes (``S`` slots, ``H`` kv_heads, ``B`` block_size, ``D`` head_dim):
        tail_k, tail_v: ``[L, S, H, B, D]`` in the tail dtype, on the device: the full-precision tails
            (keys as stored: rotated when the key spec rotates).
        sink_k, sink_v: ``[L, S, H, sink, D]`` in the tail dtype, on the device: each sequence's first ``sink``
            positions as they entered the tail; ``None`` without a sink.
        lens: ``[L, S]`` int32 on the host: tokens per layer and slot (sealed plus tail, released included).
        lens_np: the numpy view of ``lens`` (the same memory).
        tables: ``[S, W]`` int32 on the host: block tables (logical block -> block id, 0 past the end).
        tables_np: the numpy view of ``tables``.
        seqs: live sequences by id, in creation order.
        version: bumped by every layout change (see the module docstring).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        *,
        sink: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_slots: int = 8,
    ) -> None:
        device = torch.device(device)
        shape = (num_layers, num_slots, kv_heads, block_size, head_dim)
        self.tail_k = torch.zeros(shape, dtype=dtype, device=device)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        if sink:
            shape = (num_layers, num_slots, kv_heads, sink, head_dim)
            self.sink_k = torch.zeros(shape, dtype=dtype, device=device)
            self.sink_v = torch.zeros_like(self.sink_k)
        self.block_size, self.device = block_size, device
        self.lens = torch.zeros(num_layers, num_slots, dtype=torch.int32)
        self.lens_np = self.lens.numpy()
        self.tables = torch.zeros(num_slots, 4, dtype=torch.int32)
        self.tables_np = self.tables.numpy()
        self.free_slots = list(range(num_slots))  # a heap: the lowest free slot is taken first
        self.seqs: dict[int, SeqState] = {}
        self.next_id = 0
        self.version = 0
        self._batches: dict[tuple[int, ...], Batch] = {}

    @property
    def num_slots(self) -> int:
        return self.lens.shape[1]

    def buffers(self) -> list[torch.Tensor]:
        """The per-sequence buffers ``[L, S, ...]`` a slot owns on the device: tails, and sinks when kept."""
        return [t for t in (self.tail_k, self.tail_v, self.sink_k, self.sink_v) if t is not None]

    def changed(self) -> None:
        """Record a layout change: cached batches (and anything keyed by :attr:`version`) are stale."""
        self.version += 1
        if len(self._batches) > _MAX_BATCHES:
            self._batches.clear()

    # -- sequences ------------------------------------------------------------------------------------
    def seq(self, sid: int, allow_offloaded: bool = False) -> SeqState:
        """The live sequence ``sid`` (:class:`SequenceError` when unknown, freed, or offloaded unless allowed)."""
        seq = self.seqs.get(sid) if isinstance(sid, (int, np.integer)) else None
        if seq is None:
            if isinstance(sid, (int, np.integer)) and 0 <= sid < self.next_id:
                raise SequenceError(f"sequence {sid} was already freed")
            raise SequenceError(f"unknown sequence id {sid!r}; live ids are {list(self.seqs)}")
        if seq.offloaded and not allow_offloaded:
            raise SequenceError(f"sequence {sid} is offloaded to the host tier; call cache.restore({sid}) first")
        return seq

    def add(self, blocks: list[int], tokens: list[int], keys: list[bytes]) -> SeqState:
        """A new sequence in the lowest free slot (grown when none is free), holding ``blocks``: its lengths
        are ``len(blocks) * B`` in every layer, its block table row mirrors ``blocks``."""
        seq = SeqState(self.next_id, self.take_slot(), list(blocks), tokens, keys)
        seq.prefix_len = len(blocks) * self.block_size
        self.next_id += 1
        self.seqs[seq.sid] = seq
        self.lens_np[:, seq.slot] = seq.prefix_len
        self.ensure_width(len(seq.blocks))
        self.tables_np[seq.slot, : len(seq.blocks)] = seq.blocks
        self.changed()
        return seq

    def fork(self, src: SeqState) -> SeqState:
        """A new sequence with a copy of ``src``'s slot (buffers, lengths, block table) and host state
        (block references are the caller's to count)."""
        slot = self.take_slot()
        self.copy_slots(np.array([slot]), np.array([src.slot]))
        seq = SeqState(self.next_id, slot, list(src.blocks), list(src.tokens), list(src.keys), set(src.impure))
        seq.released, seq.prefix_len = src.released, src.prefix_len
        self.next_id += 1
        self.seqs[seq.sid] = seq
        self.changed()
        return seq

    def remove(self, seq: SeqState) -> None:
        """Drop a sequence and free its slot (block references are the caller's to release)."""
        self.lens_np[:, seq.slot] = 0
        self.tables_np[seq.slot] = 0
        heapq.heappush(self.free_slots, seq.slot)
        del self.seqs[seq.sid]
        self.changed()

    def copy_slots(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Slots ``dst`` become copies of slots ``src`` (``[n]`` int64 each): buffers, lengths, block tables."""
        dst_t, src_t = (torch.from_numpy(np.asarray(s, dtype=np.int64)).to(self.device) for s in (dst, src))
        for t in self.buffers():
            t[:, dst_t] = t[:, src_t]
        self.lens_np[:, dst] = self.lens_np[:, src]
        self.tables_np[dst] = self.tables_np[src]

    def batch(self, seq_ids: Sequence[int] | torch.Tensor) -> Batch:
        """The live, not offloaded, distinct sequences ``seq_ids`` resolved to slots (cached)."""
        key = batch_key(seq_ids)
        hit = self._batches.get(key)
        if hit is not None and hit.version == self.version:
            return hit
        if not key:
            raise ShapeError("seq_ids is empty; pass at least one sequence id")
        if len(set(key)) != len(key):
            raise SequenceError(f"seq_ids holds a sequence twice: {list(key)}")
        seqs = [self.seq(s) for s in key]
        slots = np.array([s.slot for s in seqs], dtype=np.int64)
        start = int(slots[0]) if np.array_equal(slots, np.arange(slots[0], slots[0] + len(slots))) else None
        batch = Batch(self.version, seqs, slots, torch.from_numpy(slots).to(self.device), start)
        self._batches[key] = batch
        return batch

    # -- growth ---------------------------------------------------------------------------------------
    def take_slot(self) -> int:
        """The lowest free slot, taken (the table doubles when none is free)."""
        if not self.free_slots:
            self.grow(2 * self.num_slots)
        return heapq.heappop(self.free_slots)

    def grow(self, n: int) -> None:
        """Grow to ``n`` slots (new slots zeroed and free)."""
        old = self.num_slots

        def grown(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = n
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, old).copy_(t)
            return out

        self.tail_k, self.tail_v = grown(self.tail_k, 1), grown(self.tail_v, 1)
        if self.sink_k is not None:
            self.sink_k, self.sink_v = grown(self.sink_k, 1), grown(self.sink_v, 1)
        self.lens = grown(self.lens, 1)
        self.lens_np = self.lens.numpy()
        self.tables = grown(self.tables, 0)
        self.tables_np = self.tables.numpy()
        for s in range(old, n):
            heapq.heappush(self.free_slots, s)
        self.changed()

    def ensure_width(self, width: int) -> None:
        """Make the block tables at least ``width`` entries wide (doubling)."""
        cur = self.tables.shape[1]
        if width <= cur:
            return
        new = max(width, 2 * cur)
        t = torch.zeros(self.tables.shape[0], new, dtype=torch.int32)
        t[:, :cur] = self.tables
        self.tables, self.tables_np = t, t.numpy()
        self.changed()
