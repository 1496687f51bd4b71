"""The open blocks of running requests: full-precision tails in a fixed pool, and each step's write plan.

vLLM writes a request's tokens into slots of its last block one step at a time, and only the backend knows that
a kvpack block can be quantized only once it is full. So a block that is not full yet (the *open* block, at most
one per running request) keeps its tokens in a full-precision tail; the step that writes its last slot seals it
into its page, and the tail is released. The tails live in a pool of ``capacity`` slots (``max_num_seqs``, since
each running request has at most one open block), and :class:`TailTable` maps a block id to the slot holding
its tail: the step's request ``i`` holds slot ``i``, so that the layers read the tails in place. A request
whose last block is full reads no tail position of its slot, so the pool needs no spare slot.

A tail is released when its block seals, when its block id starts over at position 0 (vLLM handed the block to a new
owner), or when the request that owns it finishes or is preempted (:meth:`TailTable.release_blocks`, called
from the model runner's state update, see :mod:`kvpack.integrations.vllm.hooks`). So a drained engine holds no
tail, whatever its requests did.

With speculative decoding (``spec_tokens`` draft tokens a step) a step's tokens after its first are drafts, and
vLLM rolls a request back to the first rejected one by writing there again the next time it runs. A block sealed
in a step with drafts may be written into again, so its tail is kept as a **reserve** (the tail's rows and the
step's new rows of the block, in a slot of a second bank of ``capacity``): when the request writes into the block
again, the reserve becomes its tail once more (the block is open, its page's sealed bytes are never read: a
kernel reads the block from the tail because the sequence ends inside it) and seals again when it fills; when the
request's next write starts past the block, or the request ends, the reserve is released. A step's first token
is never a draft (it is the token the last step sampled), so a block that ends there needs no reserve.

Everything here is numpy over the step's request table; no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpack.errors import KVPackError, PoolExhaustedError

__all__ = ["StepPlan", "TailError", "TailTable"]


class TailError(KVPackError):
    """A write vLLM scheduled cannot be served without corrupting a sealed block."""


@dataclass(frozen=True)
class StepPlan:
    """What one step writes, for every layer alike (``R`` requests, ``N`` tokens in the step).

    Attributes:
        tail_slot: ``[R]`` int64: the tail slot each request's attention reads: request ``i`` reads slot ``i``
            (no position of it when its last block is full after the step, ``seq_len % block_size == 0``).
        write_tok, write_slot, write_off: ``[M]`` int64: token ``write_tok`` (index into the step's tokens) goes
            to tail slot ``write_slot`` at offset ``write_off``.
        seal_block: ``[K]`` int64: block ids sealed by this step.
        seal_slot: ``[K]`` int64: the tail slot holding the block's first ``seal_from`` tokens (-1: none).
        seal_from: ``[K]`` int64: tokens of the block already in its tail; the rest are new.
        seal_tok: ``[K]`` int64: index of the block's first new token in the step's tokens.
        sink_tok, sink_block, sink_pos: ``[Q]`` int64: token ``sink_tok`` is position ``sink_pos < S`` of the
            sequence whose first block is ``sink_block``: its rows go to that page's sink region too.
        move_src, move_dst: ``[P]`` int64: before this step's writes, the tail in slot ``move_src`` moves to slot
            ``move_dst`` (all moves read the slots as they were: a permutation of the held tails).
        causal_start: ``[R]`` int64: position of each request's first token in this step.
        query_lens, seq_lens: ``[R]`` int64.
        query_start: ``[R + 1]`` int64: token offsets of the requests in the step.
        reserve_slot: ``[R]`` int64: the slot holding the reserve of the block request ``i`` sealed this step with a
            draft inside (all of the block's rows, full precision, after the step's writes), -1 for none: the
            tail of the request's queries in that block.
    """

    tail_slot: np.ndarray
    write_tok: np.ndarray
    write_slot: np.ndarray
    write_off: np.ndarray
    seal_block: np.ndarray
    seal_slot: np.ndarray
    seal_from: np.ndarray
    seal_tok: np.ndarray
    sink_tok: np.ndarray
    sink_block: np.ndarray
    sink_pos: np.ndarray
    move_src: np.ndarray
    move_dst: np.ndarray
    causal_start: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    query_start: np.ndarray
    reserve_slot: np.ndarray


def _i64(x: list[int]) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


class TailTable:
    """Block id -> tail slot, for ``capacity`` open blocks (slots ``0 .. capacity - 1``).

    A step's request ``i`` keeps its open block's tail in slot ``i``: the layers then read the tails of a step's
    requests as the first rows of their pools, in place, with no gather. When the rows move (a request finished,
    joined or was not scheduled this step), the plan says which tails move where (:attr:`StepPlan.move_src`,
    :attr:`StepPlan.move_dst`), and each layer moves its own before writing; a held tail whose request has no
    row this step keeps its slot unless a row needs it, and then moves to a slot no row uses."""

    def __init__(self, num_blocks: int, capacity: int, block_size: int, sink: int = 0, spec_tokens: int = 0) -> None:
        if capacity < 1 or num_blocks < 1:
            raise ValueError(f"need at least one block and one tail slot, got {num_blocks} / {capacity}")
        if not 0 <= spec_tokens < block_size:
            raise ValueError(f"draft tokens per step must be in [0, block_size={block_size}), got {spec_tokens}")
        self.block_size = block_size
        self.sink = sink
        self.capacity = capacity
        self.spec_tokens = spec_tokens
        # slots: one per running request, and with drafts one more per request for a reserve (the module docstring)
        self.slots = capacity * (2 if spec_tokens else 1)
        self.slot_of_block = np.full(num_blocks, -1, dtype=np.int64)
        self.reserved = np.zeros(num_blocks, dtype=bool)  # the block's slot holds a sealed block's reserve
        self.reopened = 0  # reserves written into again (drafts rejected inside a block they sealed), all steps

    @property
    def num_allocated(self) -> int:
        """Tails and reserves held now (zero once the engine has drained)."""
        return int(np.count_nonzero(self.slot_of_block >= 0))

    @property
    def num_reserved(self) -> int:
        """Reserves held now (sealed blocks that drafts may still write into)."""
        return int(np.count_nonzero(self.reserved))

    def ensure_blocks(self, num_blocks: int) -> None:
        """Grow the block map to ``num_blocks`` ids (vLLM sizes its pool after the builders exist)."""
        have = self.slot_of_block.shape[0]
        if num_blocks > have:
            grown = np.full(num_blocks, -1, dtype=np.int64)
            grown[:have] = self.slot_of_block
            self.slot_of_block = grown
            flags = np.zeros(num_blocks, dtype=bool)
            flags[:have] = self.reserved
            self.reserved = flags

    def release_blocks(self, block_ids, reserves_only: bool = False) -> int:
        """Release the tails of these blocks (a finished or preempted request's blocks), or with ``reserves_only``
        only their reserves; returns how many."""
        n = 0
        for bid in block_ids:
            bid = int(bid)
            if 0 <= bid < self.slot_of_block.shape[0] and self.slot_of_block[bid] >= 0:
                if reserves_only and not self.reserved[bid]:
                    continue
                self.slot_of_block[bid] = -1
                self.reserved[bid] = False
                n += 1
        return n

    def plan(self, query_start: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray) -> StepPlan:
        """Plan one step's writes and update the table (all or nothing: an error changes nothing).

        Args:
            query_start: ``[R + 1]`` token offsets of the requests in the step (vLLM's ``query_start_loc``).
            seq_lens: ``[R]`` tokens per request after the step.
            block_table: ``[R, W]`` block ids of each request, in order.

        Raises:
            TailError: a request writes into the middle of a block that has no tail (a sealed block).
            PoolExhaustedError: more requests or open blocks than tail slots (more running requests than
                ``max_num_seqs``).
        """
        b, cap = self.block_size, self.capacity
        qs = np.asarray(query_start, dtype=np.int64)
        sl = np.asarray(seq_lens, dtype=np.int64)
        r = sl.shape[0]
        if r > cap:
            raise PoolExhaustedError(
                f"this step has {r} requests but the backend holds {cap} tail slots: more running requests than it "
                "was sized for; keep --max-num-seqs at the value the engine started with"
            )
        ql = qs[1 : r + 1] - qs[:r]
        start = sl - ql
        w_tok: list[int] = []
        w_slot: list[int] = []
        w_off: list[int] = []
        s_blk: list[int] = []
        s_slot: list[int] = []
        s_from: list[int] = []
        s_tok: list[int] = []
        k_tok: list[int] = []
        k_blk: list[int] = []
        k_pos: list[int] = []
        released: list[int] = []  # blocks whose tail ends this step (sealed, or the id starts over)
        rows_of: dict[int, int] = {}  # block id -> the row whose open block it is after the step
        kept: dict[int, int] = {}  # block id -> the slot of its reserve: sealed this step, a draft inside
        kept_moves: list[tuple[int, int]] = []
        reserve_of = np.full(r, -1, dtype=np.int64)  # row -> the reserve slot of the block it sealed this step
        reopens = 0
        drafts = self.spec_tokens
        if drafts:  # a request writing past a reserved block will not write into it again: release the reserve
            for i in range(r):
                c = int(start[i])
                if sl[i] > c >= b:
                    prev = int(block_table[i, c // b - 1])
                    if prev and self.reserved[prev]:
                        released.append(prev)
        held = {int(x): int(self.slot_of_block[x]) for x in np.nonzero(self.slot_of_block >= 0)[0]}
        freed = set(released)
        # reserve slots: none a row of this step reads, none a tail or reserve held now holds
        free = iter(sorted(set(range(r, self.slots)) - {slot for x, slot in held.items() if x not in freed}))
        for i in range(r):
            c, n, q0 = int(start[i]), int(sl[i]), int(qs[i])
            if n <= c:
                continue
            # the last block this step seals keeps a reserve when a draft lies in it (positions after c)
            last = n // b - 1
            keep = last if drafts and ql[i] <= 1 + drafts and last >= c // b and (last + 1) * b > c + 1 else -1
            for j in range(c // b, (n - 1) // b + 1):
                bid = int(block_table[i, j])
                if bid == 0:  # vLLM's null block (dummy and padded rows): never stored, never read
                    continue
                s = c - j * b if j == c // b else 0
                e = min(n - j * b, b)
                tok0 = q0 + j * b + s - c
                have = int(self.slot_of_block[bid])
                reopens += s > 0 and have >= 0 and bool(self.reserved[bid])
                if s > 0 and have < 0:
                    raise TailError(
                        f"a request writes position {j * b + s} into block {bid}, which holds {s} tokens and no "
                        "tail: the block is sealed (quantized), and writing into it would corrupt it. This comes "
                        "from a partial prefix-cache hit or a KV transfer that the kvpack backend refuses; "
                        "disable it (see docs/vllm.md)"
                    )
                if e == b and j == keep:  # sealed, and its rows kept in a reserve slot
                    slot = have if have >= 0 and self.reserved[bid] else next(free, None)
                    if slot is None:
                        raise PoolExhaustedError(
                            f"no tail slot is free for the reserve of block {bid} (speculative decoding keeps one "
                            f"per request): more running requests than the {self.capacity} the backend was sized "
                            "for; keep --max-num-seqs at the value the engine started with"
                        )
                    kept[bid] = slot
                    reserve_of[i] = slot
                    if have >= 0 and have != slot:
                        kept_moves.append((have, slot))
                    s_blk.append(bid)
                    s_slot.append(have if s > 0 else -1)
                    s_from.append(s)
                    s_tok.append(tok0)
                    w_tok += range(tok0, tok0 + b - s)  # after the seal and the moves: the reserve's new rows
                    w_off += range(s, b)
                    w_slot += [slot] * (b - s)
                    continue
                if have >= 0 and (s == 0 or e == b):
                    released.append(bid)  # sealed now, or handed to a new owner (its old tail is garbage)
                if e == b:
                    s_blk.append(bid)
                    s_slot.append(have if s > 0 else -1)
                    s_from.append(s)
                    s_tok.append(tok0)
                else:
                    rows_of[bid] = i
                    w_tok += range(tok0, tok0 + e - s)
                    w_off += range(s, e)
                    w_slot += [i] * (e - s)
            if self.sink and c < self.sink:
                for p in range(c, min(n, self.sink)):
                    k_tok.append(q0 + p - c)
                    k_blk.append(int(block_table[i, 0]))
                    k_pos.append(p)
        # tails held by requests with no row this step keep their slot unless a row takes it
        gone = set(released)
        rowed = set(rows_of.values())
        parked = [bid for bid in held if bid not in rows_of and bid not in gone and bid not in kept]
        staying = {held[bid] for bid in parked} - rowed
        spare = iter(sorted(set(range(self.slots)) - rowed - staying - set(kept.values())))
        new_slot: dict[int, int] = dict(rows_of)
        for bid in parked:
            old = held[bid]
            if old in rowed:
                slot = next(spare, None)
                if slot is None:
                    raise PoolExhaustedError(
                        f"{len(parked)} requests without a row this step and {len(rowed)} with one hold more open "
                        f"blocks than the {self.slots} tail slots: more running requests than the backend was sized "
                        "for; keep --max-num-seqs at the value the engine started with"
                    )
                new_slot[bid] = slot
        moves = [(held[bid], slot) for bid, slot in new_slot.items()
                 if bid in held and held[bid] != slot and bid not in gone]  # fmt: skip
        moves += kept_moves
        # -- commit -------------------------------------------------------------------------------------
        for bid in gone:
            self.slot_of_block[bid] = -1
            self.reserved[bid] = False
        for bid, slot in new_slot.items():
            self.slot_of_block[bid] = slot
        for bid in rows_of:
            self.reserved[bid] = False  # a reserve written into again is the block's tail once more
        for bid, slot in kept.items():
            self.slot_of_block[bid] = slot
            self.reserved[bid] = True
        self.reopened += reopens
        return StepPlan(
            tail_slot=np.arange(r, dtype=np.int64),
            write_tok=_i64(w_tok),
            write_slot=_i64(w_slot),
            write_off=_i64(w_off),
            seal_block=_i64(s_blk),
            seal_slot=_i64(s_slot),
            seal_from=_i64(s_from),
            seal_tok=_i64(s_tok),
            sink_tok=_i64(k_tok),
            sink_block=_i64(k_blk),
            sink_pos=_i64(k_pos),
            move_src=_i64([m[0] for m in moves]),
            move_dst=_i64([m[1] for m in moves]),
            causal_start=start,
            query_lens=ql,
            seq_lens=sl,
            query_start=qs,
            reserve_slot=reserve_of,
        )
