"""The host tier: an idle sequence's sealed blocks leave the pool and come back bit-identical.

Blocks move quantized (payload, scales, zero-points as stored), so what crosses the link is the packed
size, 2-4x less than fp16 would be. Only blocks the sequence owns alone (reference count 1) move; blocks
shared with other sequences or the prefix cache's users stay, and so does the full-precision tail (one
block, kept in its slot, and the sink rows of a format with a sink, likewise). Restored blocks get new ids;
their bytes are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpack.cache.pool import BlockPool
from kvpack.cache.prefix import PrefixIndex
from kvpack.cache.slots import SlotTable
from kvpack.cache.storage import BlockStorage
from kvpack.errors import SequenceError

__all__ = ["HostTier", "offload", "restore"]


@dataclass
class _Record:
    logical: list[int]  # the sequence's logical block indices that moved
    parts: dict[str, torch.Tensor]  # pool name -> [L, n, ...] on the host

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class HostTier:
    """Offloaded blocks per sequence, in host memory (pinned when the cache lives on a GPU)."""

    def __init__(self) -> None:
        self._records: dict[int, _Record] = {}

    def __contains__(self, sid: int) -> bool:
        return sid in self._records

    def put(self, sid: int, record: _Record) -> None:
        self._records[sid] = record

    def get(self, sid: int) -> _Record:
        return self._records[sid]

    def take(self, sid: int) -> _Record:
        return self._records.pop(sid)

    def drop(self, sid: int) -> None:
        self._records.pop(sid, None)

    def nbytes(self, sid: int | None = None) -> int:
        """Bytes held for one sequence, or for all."""
        if sid is not None:
            return self._records[sid].nbytes if sid in self._records else 0
        return sum(r.nbytes for r in self._records.values())

    def num_blocks(self) -> int:
        return sum(len(r.logical) for r in self._records.values())


def offload(table: SlotTable, pool: BlockPool, storage: BlockStorage, host: HostTier, sid: int) -> int:
    """Move sequence ``sid``'s exclusively owned sealed blocks from ``pool`` and ``storage`` to ``host``;
    returns bytes moved. See :meth:`kvpack.cache.PagedKVCache.offload`."""
    seq = table.seq(sid, allow_offloaded=True)
    if seq.offloaded:
        raise SequenceError(f"sequence {sid} is already offloaded; call cache.restore({sid}) to bring it back")
    lens = table.lens_np[:, seq.slot]
    if lens.min() != lens.max():
        raise SequenceError(
            f"sequence {sid} is mid-step (layers hold {int(lens.min())}..{int(lens.max())} tokens); append every "
            "layer before offloading it"
        )
    logical = [j for j, blk in enumerate(seq.blocks) if blk and pool.ref_count(blk) == 1]
    ids = torch.tensor([seq.blocks[j] for j in logical], dtype=torch.int64, device=table.device)
    parts = storage.gather(ids)  # copies: [L, n, ...]
    if table.device.type != "cpu":
        parts = {n: t.to("cpu").pin_memory() if torch.cuda.is_available() else t.to("cpu") for n, t in parts.items()}
    record = _Record(logical, parts)
    host.put(sid, record)
    for j in logical:
        pool.release(seq.blocks[j])
        seq.blocks[j] = 0
        table.tables_np[seq.slot, j] = 0
    seq.offloaded = True
    table.changed()
    return record.nbytes


def restore(
    table: SlotTable, pool: BlockPool, storage: BlockStorage, host: HostTier, prefix: PrefixIndex, sid: int
) -> int:
    """Bring sequence ``sid``'s blocks back from ``host`` into new blocks of ``pool`` and ``storage`` (their
    prefix keys registered again through ``prefix``); returns bytes moved. See
    :meth:`kvpack.cache.PagedKVCache.restore`."""
    seq = table.seq(sid, allow_offloaded=True)
    if not seq.offloaded:
        raise SequenceError(f"sequence {sid} is not offloaded; nothing to restore")
    pool.require(len(host.get(sid).logical), f"restoring sequence {sid}")
    record = host.take(sid)
    new = [pool.allocate() for _ in record.logical]
    storage.scatter(torch.tensor(new, dtype=torch.int64, device=table.device), record.parts)
    for j, blk in zip(record.logical, new):
        seq.blocks[j] = blk
        if j < len(seq.keys) and j not in seq.impure:
            pool.register(blk, seq.keys[j])  # no-op when another block holds the key meanwhile
            if j == 0:
                prefix.keep_sink(table, seq)
    table.tables_np[seq.slot, : len(seq.blocks)] = np.asarray(seq.blocks, dtype=np.int32)
    seq.offloaded = False
    table.changed()
    return record.nbytes
