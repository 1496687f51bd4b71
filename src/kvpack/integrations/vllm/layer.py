"""One attention layer over kvpack blocks in vLLM pages, without vLLM: writes, seals, attends.

:class:`PagedLayer` is what the vLLM impl calls each step (and what the tests drive with a simulated scheduler).
Given the step's :class:`~kvpack.integrations.vllm.tails.StepPlan` it

1. seals the blocks this step fills: their tail rows and new tokens quantized into the block's page
   (block-local scales, computed once; the page never changes again), integer formats on the CPU gathered and
   sealed, keys and values, in a compiled call, others with torch and :func:`kvpack.quant.quantize`;
2. writes the other new tokens to their request's tail slot, and positions ``< S`` to the first page's sink rows;
   on the CPU the seal and these rows are one compiled call (:class:`kvpack.kernels.cpu_seal.StepWrites`) unless
   tails move between slots in the step;
3. attends: decode rows (one query) through the decode kernel :func:`kvpack.kernels.choose_backend` picks once per
   view (:func:`kvpack.kernels.run_backend`), which reads the packed pages in place, and so, on the CPU, a token's
   drafts (:class:`FusedPass`: positions as query heads of one call); rows with several queries (prefill, chunked
   prefill, the suffix after a prefix-cache hit) through the fused chunk kernel (:func:`kvpack.kernels.run_chunk_backend`; rows with the same number of queries in one
   call), or :func:`kvpack.kernels.reference.paged_attention_reference` where none can run.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvpack.cache.write import seal_outliers
from kvpack.calibration.static import ClipMonitor, seal_with_static
from kvpack.errors import ConfigError, NonFiniteError
from kvpack.formats import KVFormat
from kvpack.integrations.vllm.calibration import LayerCalibration
from kvpack.integrations.vllm.layout import PageLayout
from kvpack.integrations.vllm.tails import StepPlan
from kvpack.kernels import (
    choose_backend,
    cpu_seal,
    decode_positions,
    fused_chunk_backend,
    run_backend,
    run_chunk_backend,
)
from kvpack.kernels.reference import paged_attention_reference
from kvpack.kernels.views import PagedKV
from kvpack.quant import _raise_non_finite, all_finite, quantize, tail_torch_dtype
from kvpack.rotation import key_rotation, rotate

__all__ = ["DECODE_QUERIES", "DecodePass", "FusedPass", "PagedLayer", "StepTensors"]

_SERIALS = itertools.count()
_NO_BLOCKS = np.zeros(0, np.int64)


# A request with up to this many queries in a step (a token and its drafts, a short prefill chunk) is read by the
# decode kernel rather than by the chunk kernel when its queries share the open block: the last queries in one call,
# the earlier ones as more query heads of one more call (FusedPass; one call per position in a sliding-window layer).
# The chunk kernel decodes every block to floats for any number of queries and costs ~9x a decode call at one query
# (32 requests of ~350 int8 tokens on two threads: 3.8 ms against 0.43 ms, 4.1 ms at four queries, where the decode
# kernel takes 1.1 ms fused and 1.75 ms as a call per position; 5.1 ms at eight; int4 15x:
# benchmarks/cpu_few_queries.py). On a GPU the decode kernel is bound by the bytes it reads, which a call per query
# multiplies, and the chunk kernel reads them once: there only single queries decode.
DECODE_QUERIES = 8


@dataclass(frozen=True)
class DecodePass:
    """One decode-kernel call of a step: the query ``back`` positions before the last of each request in it.

    Attributes:
        rows: ``[Rk]`` int64 requests read (None: all ``R``, their tails in place).
        tokens: ``[Rk]`` int64 each row's query token.
        back: ``[Rk]`` int32 positions each row's history is cut by (its query's distance from the last), or None.
        keep: ``[Rm]`` int64 rows of the call whose output is kept (None: all); dst: ``[Rm]`` int64 their tokens.
        slots: ``[Rk]`` int64 the tail slots gathered for ``rows`` (None: the rows' own, slot ``i`` for request
            ``i``): reserves, for queries in a block the step sealed.
    """

    rows: torch.Tensor | None
    tokens: torch.Tensor
    back: torch.Tensor | None
    keep: torch.Tensor | None
    dst: torch.Tensor
    slots: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        """Whether the step's :class:`FusedPass` es cover this pass's queries (those before their request's last:
        a history cut by ``back``), so that a layer whose kernel takes them skips this pass."""
        return self.back is not None


@dataclass(frozen=True)
class FusedPass:
    """Queries before each request's last (a token's drafts, a short prefill chunk) in one call of the CPU decode
    kernel: ``K`` positions of a request as more query heads of its group, each cut to its own history inside the
    tail (``tail_cut``), the sealed blocks read once for all. Either the queries in the open block, or those in a
    block the step sealed, whose tail is then the block's reserve (``slots``) and whose history ends ``back``
    before the last.

    Attributes:
        rows: ``[Rf]`` int64 the requests (their tails gathered).
        tokens: ``[Rf, K]`` int64 the query token of position ``j``; a request with fewer such queries repeats
            its first (``keep`` False).
        cut: ``[Rf, K]`` int32 each position's distance from the end of its request's history in the view.
        keep: ``[Rf, K]`` bool the positions whose output is kept; dst: ``[M]`` int64 their tokens, in ``keep``'s
            row-major order.
        back: ``[Rf]`` int32 positions the view cuts each history by (None: none); slots: ``[Rf]`` int64 the tail
            slots gathered (None: the rows' own).
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    cut: torch.Tensor
    keep: torch.Tensor
    dst: torch.Tensor
    back: torch.Tensor | None = None
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTensors:
    """The step's request table as tensors (``R`` requests), shared by the layers.

    Attributes:
        block_table: ``[R, W]`` int32 block ids.
        seq_lens: ``[R]`` int32 tokens per request after the step.
        passes: the decode-kernel calls (:class:`DecodePass`): requests with one query, and on the CPU those with
            up to :data:`DECODE_QUERIES` (the query ``k`` places before the last reads the history cut by ``k``).
            Such a query lies in the open block (the same sealed blocks, the tail's first rows) or, with drafts, in
            the block the step sealed, whose rows the step kept in a reserve slot (``StepPlan.reserve_slot``): its
            history is the blocks before and the reserve's first rows. A request with a query in a sealed block
            and no reserve is a chunk row.
        prefill_rows: requests read by the chunk kernel (numpy int64).
        decode_dense: there are requests, every one decodes, and request ``i``'s query is token ``i``.
        first_blocks: ``[R]`` int64 each request's first block id (where its sink rows are), numpy; on the CPU only
            (elsewhere empty: every view gathers its sink rows).
        serial: a number no other step of this process has: the layers' shared view buffers know by it whether they
            already hold this step's tables (:meth:`PagedLayer.view`).
        fused: on the CPU, the queries of the ``passes`` with a cut history (``DecodePass.fused``) in at most two
            calls (:class:`FusedPass`: those in the open block, those in a block the step sealed), which a layer
            without a window takes when its decode backend is the CPU kernel.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    passes: tuple[DecodePass, ...]
    prefill_rows: np.ndarray
    decode_dense: bool = False
    fused: tuple[FusedPass, ...] = ()
    first_blocks: np.ndarray = dataclasses.field(default_factory=lambda: _NO_BLOCKS)
    serial: int = dataclasses.field(default_factory=lambda: next(_SERIALS))
    rows: int = dataclasses.field(init=False)  # R, and W below: read by every layer, asked of torch once a step
    width: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", int(self.seq_lens.shape[0]))
        object.__setattr__(self, "width", int(self.block_table.shape[1]))

    @classmethod
    def from_plan(cls, plan: StepPlan, block_table: torch.Tensor, block_size: int) -> StepTensors:
        """The tensors on ``block_table``'s device (vLLM's: the kernels want every cache tensor beside the pages)."""
        ql, sl, qs = plan.query_lens, plan.seq_lens, plan.query_start
        r = ql.size
        dev = block_table.device
        # the k-th query before the last sees the history cut by k: the same blocks and the tail's first rows while
        # k <= seq_len % block_size; further back (at most a block: drafts < block_size), the block the step sealed,
        # which is a tail again where the step kept its rows in a reserve
        most = DECODE_QUERIES if dev.type == "cpu" else 1
        open_rows = sl % block_size
        reserve = plan.reserve_slot
        decodable = (ql == 1) | ((ql <= most) & ((ql - 1 <= open_rows) | ((reserve >= 0) & (ql <= block_size))))
        dense = bool(0 < r == int(np.count_nonzero(ql == 1)) and np.array_equal(qs[:r], np.arange(r)))
        last = qs[:r] + ql - 1
        passes = []
        for k in range(int(ql[decodable].max()) if decodable.any() else 0):
            member = decodable & (ql > k)
            back_in = member & (k > open_rows)  # this query's tail is the reserve
            member &= ~back_in
            idx = np.nonzero(member)[0]
            tok = last - k
            if idx.size:
                everyone = 2 * idx.size >= r  # most requests: all, tails in place, the others' outputs dropped
                back = np.where(member, k, 0) if everyone else np.full(idx.size, k)
                passes.append(DecodePass(
                    rows=None if everyone else _dev(idx, dev),
                    tokens=_dev(np.where(member, tok, last) if everyone else tok[idx], dev),
                    back=_dev(back.astype(np.int32), dev) if k else None,
                    keep=_dev(idx, dev) if everyone and idx.size < r else None,
                    dst=_dev(tok[idx], dev),
                ))  # fmt: skip
            idx = np.nonzero(back_in)[0]
            if idx.size:
                passes.append(DecodePass(
                    rows=_dev(idx, dev),
                    tokens=_dev(tok[idx], dev),
                    back=_dev(np.full(idx.size, k, dtype=np.int32), dev),
                    keep=None,
                    dst=_dev(tok[idx], dev),
                    slots=_dev(reserve[idx], dev),
                ))  # fmt: skip
        table = block_table.to(torch.int32)
        return cls(
            block_table=table,
            seq_lens=torch.from_numpy(sl.astype(np.int32)).to(dev),
            passes=tuple(passes),
            prefill_rows=np.nonzero(~decodable)[0],
            decode_dense=dense,
            fused=_fused_passes(decodable, ql, open_rows, reserve, last, dev)
            if dev.type == "cpu" and not dense
            else (),
            first_blocks=table[:, 0].numpy().astype(np.int64) if dev.type == "cpu" and table.shape[1] else _NO_BLOCKS,
        )


def _fused_passes(
    decodable: np.ndarray, ql: np.ndarray, open_rows: np.ndarray, reserve: np.ndarray, last: np.ndarray,
    dev: torch.device,
) -> tuple[FusedPass, ...]:  # fmt: skip
    """The :class:`FusedPass` es of the decode passes' queries ``k >= 1`` places before their request's last: those
    in the open block (``1 <= k <= seq_len % block_size``), and those in the block the step sealed, read from its
    reserve (``k > seq_len % block_size``: the view ends each history ``seq_len % block_size + 1`` before the last,
    the reserve's first ``block_size - 1`` rows its tail)."""
    out = []
    most = np.where(decodable, np.minimum(ql - 1, open_rows), 0)  # each request's furthest query in the open block
    rows = np.nonzero(most > 0)[0]
    if rows.size:
        out.append(_fused_pass(rows, np.ones(rows.size, np.int64), most[rows], np.zeros(rows.size, np.int64), last,
                               dev))  # fmt: skip
    rows = np.nonzero(decodable & (reserve >= 0) & (ql - 1 > open_rows))[0]
    if rows.size:
        base = open_rows[rows] + 1
        out.append(_fused_pass(rows, base, ql[rows] - 1, base, last, dev, reserve[rows]))
    return tuple(out)


def _fused_pass(
    rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, base: np.ndarray, last: np.ndarray, dev: torch.device,
    slots: np.ndarray | None = None,
) -> FusedPass:  # fmt: skip
    """The queries ``lo[i] .. hi[i]`` places before the last of requests ``rows[i]``, in a view that cuts each
    history by ``base[i]`` (with ``slots``: the reserves as tails)."""
    n = hi - lo + 1
    j = np.arange(int(n.max()))[None, :]  # [1, K]
    keep = j < n[:, None]
    k = np.where(keep, lo[:, None] + j, lo[:, None])  # short requests repeat their first query, dropped
    tokens = last[rows, None] - k
    return FusedPass(
        rows=_dev(rows, dev), tokens=_dev(tokens, dev), cut=_dev((k - base[:, None]).astype(np.int32), dev),
        keep=_dev(keep, dev), dst=_dev(tokens[keep], dev),
        back=None if slots is None else _dev(base.astype(np.int32), dev),
        slots=None if slots is None else _dev(slots, dev),
    )  # fmt: skip


def _dev(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dev)


class PagedLayer:
    """One layer's kvpack state around vLLM's pages: the tails of ``capacity`` open blocks.

    Args:
        fmt: the format; kv_heads, head_dim: ``H``, ``D``; capacity: running requests (``max_num_seqs``).
        slots: tail slots (default ``capacity``; twice it with speculative decoding, for the reserves of
            :class:`~kvpack.integrations.vllm.tails.TailTable`).
        dtype: the model's activation dtype (queries; the tails and sink rows too unless the format names its
            own ``tail``); device: where the pages live.
        window: the layer's sliding window (a query at position ``p`` attends positions ``> p - window``), or
            None. For blocks that left the window vLLM's tables name the null block (id 0) or a stale id that
            may be another request's block by now; the kernels read neither (only blocks inside the window).
        calibration: the layer's static scales and outlier channels (a format with static specs needs them); values
            that fall outside the static scales' range are counted in ``clip_monitor``, which warns
            (:class:`~kvpack.calibration.CalibrationDriftWarning`) past 1% of a layer's sealed values.
    """

    def __init__(
        self,
        fmt: KVFormat,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        calibration: LayerCalibration | None = None,
        window: int | None = None,
        slots: int | None = None,
    ) -> None:
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"kvpack: a sliding window must be a positive number of tokens, got {window!r}")
        self.format = fmt
        self.window = window
        self.calibration = calibration
        # values outside the static scales' range, counted as blocks seal: a warning when the inputs drift from the
        # calibration text (kvpack.calibration.ClipMonitor, as in kvpack's own cache)
        self.clip_monitor = ClipMonitor(calibration.layer + 1) if calibration and fmt.is_static else None
        self.layout = PageLayout.build(fmt, kv_heads, head_dim, dtype)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.tail_dtype = tail_torch_dtype(fmt, dtype)
        # a tail narrower in range than the model's activations (float16 from float32 or bfloat16) can overflow:
        # each write checks its rows (NonFiniteError, naming the fix), as kvpack's own cache does
        self._check_range = self.tail_dtype == torch.float16 and dtype != torch.float16
        self.capacity, self.device = capacity, torch.device(device)
        self.slots = capacity if slots is None else slots
        if self.slots < capacity:
            raise ConfigError(f"kvpack: {self.slots} tail slots for {capacity} requests; need at least one each")
        shape = (self.slots, kv_heads, fmt.block_size, head_dim)
        self.tail_k = torch.zeros(shape, dtype=self.tail_dtype, device=device)
        self.tail_v = torch.zeros(shape, dtype=self.tail_dtype, device=device)
        self.rotation = key_rotation(head_dim).to(device) if fmt.key.rotate else None
        # tail writes and integer seals in compiled calls (kvpack.kernels.cpu_seal), on the CPU with numba
        self._compiled_writes = (
            self.device.type == "cpu" and self.tail_dtype in cpu_seal.ROW_DTYPES and cpu_seal.available()
        )
        # the tail pools as the compiled writes read them, made once (not per step: caches cold, each costs us)
        self._tail_arrays = cpu_seal.row_arrays(self.tail_k, self.tail_v) if self._compiled_writes else None
        # (the page views, the cpu_seal.StepWrites into them and the tails) for the compiled writes
        self._writes: tuple | None = None
        self._pools: dict[str, torch.Tensor] | None = None
        self._pools_key: tuple | None = None
        self._pools_of: torch.Tensor | None = None  # the tensor the pools were last asked of
        self._rows: _Rows | None = None
        self._sinks: _SinkRows | None = None  # this layer's gathered sink rows (see view)
        self._sink_writes = 0  # sink writes into this layer's pages so far: the gathered rows are stale past one
        self._views: dict[tuple[int, int, bool], PagedKV] = {}  # (rows, table width, all rows?) -> its view
        self._tail_slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # (id of a view in self._views, q dtype, kernel, chunk?) -> its decode (chunk) backend (None: reference)
        self._backend_of: dict[tuple, str | None] = {}

    def pools(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Strided views of ``kv_cache``'s pages (made once per cache tensor)."""
        ptr = kv_cache.data_ptr()
        if kv_cache is self._pools_of and ptr == self._pools_key[0]:  # vLLM hands over the same tensor every step
            return self._pools
        key = (ptr, tuple(kv_cache.shape), kv_cache.stride(0))
        if self._pools is None or self._pools_key != key:
            self._pools = self.layout.views(kv_cache)
            self._pools_key = key
            self._views, self._backend_of = {}, {}  # views over the old pages
        self._pools_of = kv_cache
        return self._pools

    # -- writes -----------------------------------------------------------------------------------------

    def _step_writes(self, pools: dict[str, torch.Tensor]) -> cpu_seal.StepWrites | None:
        """The compiled writes into these pages (made once per set of page views), or None where the seal is not
        compiled (a float tail on another device, numba missing, a spec :func:`cpu_seal.supports` refuses)."""
        if self._writes is not None and self._writes[0] is pools:
            return self._writes[1]
        specs = (self.format.key, self.format.value)
        if not (self._compiled_writes and all(map(cpu_seal.supports, specs))):
            return None
        rows = tuple(tuple(pools.get(f"{p}_{part}_bytes") for part in ("data", "scale", "zero")) for p in "kv")
        writes = cpu_seal.StepWrites((self.tail_k, self.tail_v), rows, specs)
        self._writes = (pools, writes)
        return writes

    def _refine(self, pools: dict[str, torch.Tensor], x: torch.Tensor | np.ndarray, ids: np.ndarray) -> None:
        """The refinement codes and channel indices of key blocks ``x`` ``[K, H, B, D]`` float32 just sealed into rows
        ``ids`` by the compiled seal (a refined key spec, ``o<k>r``: :func:`cpu_seal.refine_blocks`)."""
        cal = self.calibration
        rows = tuple(pools.get(f"k_{p}_bytes") for p in ("data", "scale", "zero"))
        out = (pools["k_outlier_bytes"], pools["k_outlier_idx_bytes"])
        energy, channels = (None, None) if cal is None else (cal.energy, cal.channels)
        cpu_seal.refine_blocks(x, self.format.key, ids, rows, out, energy, channels)

    def _refine_step(self, pools: dict[str, torch.Tensor], writes: cpu_seal.StepWrites, plan: StepPlan) -> None:
        """After a compiled step's seal: a refined key spec's codes, from the key blocks it gathered (still in its
        scratch)."""
        if self.format.key.refined and plan.seal_block.size:
            self._refine(pools, writes.scratch[0][: len(plan.seal_block)], plan.seal_block)

    def _seal(self, pools: dict[str, torch.Tensor], plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        writes = self._step_writes(pools)
        if writes is not None:
            new = cpu_seal.row_arrays(k, v)
            if writes(new, plan.seal_slot, plan.seal_from, plan.seal_tok, plan.seal_block):
                self._refine_step(pools, writes, plan)
                return
            # a key or value is not finite, nothing was written: the path below names the place and raises
        self._seal_reference(pools, plan, k, v)

    def _seal_reference(self, pools: dict[str, torch.Tensor], plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """The seal in torch (formats the compiled seal does not take; a non-finite block, raised here)."""
        b = self.format.block_size
        blocks_k, blocks_v = [], []
        for slot, s, tok in zip(plan.seal_slot.tolist(), plan.seal_from.tolist(), plan.seal_tok.tolist()):
            new_k = k[tok : tok + b - s].transpose(0, 1)  # [H, B - s, D]
            new_v = v[tok : tok + b - s].transpose(0, 1)
            if s:
                new_k = torch.cat([self.tail_k[slot, :, :s], new_k], dim=1)
                new_v = torch.cat([self.tail_v[slot, :, :s], new_v], dim=1)
            blocks_k.append(new_k)
            blocks_v.append(new_v)
        ids = torch.from_numpy(plan.seal_block).to(k.device)
        xs = []
        for blocks in (blocks_k, blocks_v):
            x = torch.stack(blocks)  # [K, H, B, D]
            if not all_finite(x):
                _raise_non_finite(x)  # NonFiniteError naming block, head and position; nothing written
            xs.append(x)
        for prefix, spec, x in zip(("k", "v"), (self.format.key, self.format.value), xs):
            rows = {part: pools.get(f"{prefix}_{part}_bytes") for part in ("data", "scale", "zero")}
            if x.device.type == "cpu" and cpu_seal.supports(spec):  # one compiled call, the same bytes
                cpu_seal.seal_blocks(x, spec, plan.seal_block, rows["data"], rows["scale"], rows["zero"])
                if spec.refined:
                    self._refine(pools, x, plan.seal_block)
                continue
            parts = {}
            cal = self.calibration
            scales = None if cal is None else (cal.key if prefix == "k" else cal.value)
            if spec.has_outliers:  # keys only: the artifact's channels, else chosen per block, as in kvpack's cache
                qt, clipped, (parts["outlier"], parts["outlier_idx"]) = seal_outliers(
                    x, spec, scales, None if cal is None else cal.channels, None if cal is None else cal.energy
                )
                rows |= {p: pools.get(f"{prefix}_{p}_bytes") for p in parts}
            elif spec.static:
                qt, clipped = seal_with_static(x, spec, scales)  # the scales: checked at start-up (calibration.py)
            else:
                qt, clipped = quantize(x, spec), 0
            if spec.static and self.clip_monitor is not None:
                self.clip_monitor.record(cal.layer, clipped, x.numel())
            parts |= {"data": qt.data, "scale": qt.scale, "zero": qt.zero}
            for part, t in parts.items():
                if t is not None:
                    rows[part][ids] = t.contiguous().view(torch.uint8).reshape(len(ids), -1)

    def write(self, kv_cache: torch.Tensor, plan: StepPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new keys and values.

        Args:
            kv_cache: this layer's pages (see :meth:`PageLayout.views`).
            plan: the step's plan. key, value: ``[N, H, D]`` the step's tokens (natural keys; rotated here when
                the format stores them rotated), any float dtype.
        """
        pools = self.pools(kv_cache)
        # keys rotated (where the format rotates them), then rounded to the tail dtype, as kvpack's cache does
        given = key if self.rotation is None else rotate(key, self.rotation)
        # the model's dtype is usually the tails': then no conversion (and fewer torch calls, ~10 us each cold)
        same = given.dtype is self.tail_dtype and value.dtype is self.tail_dtype
        k, v = (given, value) if same else (given.to(self.tail_dtype), value.to(self.tail_dtype))
        if self._check_range and not (all_finite(k) and all_finite(v)):
            self._raise_overflow((given, k), (value, v))
        writes = self._step_writes(pools) if not plan.move_src.size else None
        if writes is not None:  # no tail moves (the common step): the seal and the tail rows in one compiled call
            new = cpu_seal.row_arrays(k, v)
            if writes(new, plan.seal_slot, plan.seal_from, plan.seal_tok, plan.seal_block, plan.write_tok,
                      plan.write_slot, plan.write_off):  # fmt: skip
                self._refine_step(pools, writes, plan)
                self._write_sinks(pools, plan, k, v)
                return
            # a key or value of a sealed block is not finite, nothing was written: the seal below names it and raises
        if plan.seal_block.size:
            self._seal(pools, plan, k, v)  # first: a sealed block's tail slot may be handed out again this step
        if plan.move_src.size:  # tails follow their requests' rows (the right side is gathered before writing)
            src, dst = (torch.from_numpy(x).to(k.device) for x in (plan.move_src, plan.move_dst))
            self.tail_k[dst] = self.tail_k[src]
            self.tail_v[dst] = self.tail_v[src]
        if plan.write_tok.size and self._compiled_writes:  # one compiled call for keys and values
            cpu_seal.write_rows((self.tail_k, self.tail_v), (k, v), plan.write_tok, plan.write_slot, plan.write_off,
                                self._tail_arrays)  # fmt: skip
        elif plan.write_tok.size:
            tok, slot, off = (
                torch.from_numpy(x).to(k.device) for x in (plan.write_tok, plan.write_slot, plan.write_off)
            )
            # [slot, off] on a (slot, position, head, dim) view: adjacent indices, one fast scatter of [M, H, D]
            self.tail_k.transpose(1, 2)[slot, off] = k[tok]
            self.tail_v.transpose(1, 2)[slot, off] = v[tok]
        self._write_sinks(pools, plan, k, v)

    def _write_sinks(self, pools: dict[str, torch.Tensor], plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Each request's sink rows (position 0) into its first page, in the pages' sink dtype."""
        if plan.sink_tok.size:
            self._sink_writes += 1
            tok, blk, pos = (torch.from_numpy(x).to(k.device) for x in (plan.sink_tok, plan.sink_block, plan.sink_pos))
            pools["sink_k"][blk, :, pos] = k[tok].to(pools["sink_k"].dtype)
            pools["sink_v"][blk, :, pos] = v[tok].to(pools["sink_v"].dtype)

    def _raise_overflow(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Refuse a step whose keys or values (``(as given, as the tail holds them)`` pairs, each ``[N, H, D]``; keys
        rotated where the format rotates them) do not fit the float16 tail, naming the first token and head;
        nothing has been written. Non-finite inputs are left to the paths that name their place (the seal's
        :class:`NonFiniteError`)."""
        if not all(all_finite(given) for given, _ in pairs):
            return
        name = self.format.name or self.format.spec_string()
        for what, (given, stored) in zip(("key", "value"), pairs):
            bad = (~torch.isfinite(stored)).nonzero()
            if len(bad):
                tok, head = int(bad[0, 0]), int(bad[0, 1])
                raise NonFiniteError(
                    f"kvpack: a {what} of magnitude {float(given.abs().max()):.4g} (step token {tok}, kv head {head}) "
                    f"overflows the float16 tail of format {name!r}, which holds up to 65504; nothing of this step "
                    "was stored. Use tail=bf16 (float32's range) or drop 'tail=' (the model's dtype)",
                    [{"token": tok, "head": head}],
                )

    # -- reads ------------------------------------------------------------------------------------------

    def view(
        self,
        kv_cache: torch.Tensor,
        st: StepTensors,
        rows: torch.Tensor | None = None,
        back: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> PagedKV:
        """The :class:`PagedKV` of requests ``rows`` (None: all) over the pages, each history cut by ``back``
        (``[r]`` int32 positions, or None), the tails of ``rows`` gathered from ``slots`` (``[r]`` int64; None: the
        rows' own).

        The block tables, lengths and sink rows (from each request's first page) are copied into persistent
        buffers (:class:`_Rows`), and the view of ``r`` rows is the same object step after step, so that a
        kernel keeps what it derived from its structure (the CPU kernel's checks and numpy views) and only the
        contents change. Request ``i``'s tail is slot ``i`` of the layer's pool (:class:`TailTable`), so the
        view of all requests reads the first ``r`` slots in place; a view of some rows gathers theirs
        (``[r, H, B, D]``, one block per request).
        """
        pools = self.pools(kv_cache)
        r = st.rows if rows is None else rows.shape[0]
        width = st.width
        if self._rows is None or self._rows.capacity < r:
            self._rows = _Rows.shared(max(self.capacity, r), self, st.block_table.device)
            if self.format.sink:
                self._sinks = _SinkRows(max(self.capacity, r), self, st.block_table.device)
            self._views, self._backend_of = {}, {}
        buf = self._rows
        tables, lens, tail_k, tail_v = buf.take(r, width)
        sink_k, sink_v = self._sinks.take(r) if self._sinks is not None else (None, None)
        if rows is None:
            # the layers share these buffers and run one after another: the first layer of a step fills them
            if buf.holds != (st.serial, width, None if back is None else id(back)):
                tables.copy_(st.block_table)
                lens.copy_(st.seq_lens)
                if back is not None:
                    lens.sub_(back)
                buf.holds = (st.serial, width, None if back is None else id(back))
            tail_k, tail_v = self._tail_rows(r)
        else:
            torch.index_select(st.block_table, 0, rows, out=tables)
            torch.index_select(st.seq_lens, 0, rows, out=lens)
            if back is not None:
                lens.sub_(back)
            buf.holds = None
            src = rows if slots is None else slots  # request i's tail is slot i (TailTable), or a reserve
            torch.index_select(self.tail_k, 0, src, out=tail_k)
            torch.index_select(self.tail_v, 0, src, out=tail_v)
        if sink_k is not None:
            # each request's sink rows from its first page: gathered again only when the first blocks or their sink
            # rows changed (a first block's page changes only by a sink write of this layer)
            key = (st.first_blocks, self._sink_writes) if rows is None and len(st.first_blocks) == r else None
            held = self._sinks.holds
            if (
                key is None
                or held is None
                or held[1] != key[1]
                or (held[0] is not key[0] and not _same_blocks(held[0], key[0]))
            ):
                first = tables[:, 0].long()
                torch.index_select(pools["sink_k"], 0, first, out=sink_k)
                torch.index_select(pools["sink_v"], 0, first, out=sink_v)
                self._sinks.holds = key
        key = (r, width, rows is None)
        kv = self._views.get(key)
        if kv is None:
            kv = self._views[key] = PagedKV(
                format=self.format,
                head_dim=self.head_dim,
                k_data=pools["k_data"],
                k_scale=pools.get("k_scale"),
                k_zero=pools.get("k_zero"),
                v_data=pools["v_data"],
                v_scale=pools.get("v_scale"),
                v_zero=pools.get("v_zero"),
                k_outlier=pools.get("k_outlier"),
                k_outlier_idx=pools.get("k_outlier_idx"),
                block_tables=tables,
                seq_lens=lens,
                tail_k=tail_k,
                tail_v=tail_v,
                key_rotation=self.rotation,
                sink_k=sink_k,
                sink_v=sink_v,
            )
        return kv

    def _tail_rows(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``r`` slots of the tail pools (the same tensor objects for each ``r``)."""
        hit = self._tail_slices.get(r)
        if hit is None:
            hit = self._tail_slices[r] = (self.tail_k[:r], self.tail_v[:r])
        return hit

    def _decode_backend(self, q: torch.Tensor, kv: PagedKV, kernel: str, chunk: bool = False) -> str | None:
        """The decode backend :func:`~kvpack.kernels.choose_backend` picks for this view, or with ``chunk`` the chunk
        backend :func:`~kvpack.kernels.fused_chunk_backend` gives (None: the reference). Kept per view object: the
        views live across steps and the choice depends on their structure and the query's dtype alone."""
        key = (id(kv), q.dtype, kernel, chunk)
        if key not in self._backend_of:
            choose = fused_chunk_backend if chunk else choose_backend
            self._backend_of[key] = choose(q, kv, self.window, kernel)
        return self._backend_of[key]

    def attend(
        self,
        kv_cache: torch.Tensor,
        plan: StepPlan,
        st: StepTensors,
        query: torch.Tensor,
        out: torch.Tensor,
        sm_scale: float,
        kernel: str = "auto",
    ) -> None:
        """Causal attention of the step's queries over each request's stored history (the step's own tokens
        included: call :meth:`write` first).

        Args:
            query: ``[N, Hq, D]``; out: ``[N, Hq, D]`` written in place; kernel: the decode backend
                (``auto``, ``cpu``, ``triton``, ``reference``).
        """
        if st.decode_dense:  # every request decodes, request i's query is token i: no gather, no scatter
            kv = self.view(kv_cache, st)
            q, dst = query, out  # one token a request: the step's N tokens are its R rows
            res = run_backend(self._decode_backend(q, kv, kernel), q, kv, sm_scale, self.window,
                              out=dst if dst.dtype == query.dtype else None)  # fmt: skip
            if res is not dst:
                dst.copy_(res)
        else:
            fused = bool(st.fused) and self.window is None and self._attend_fused(kv_cache, st, query, out, sm_scale,
                                                                                  kernel)  # fmt: skip
            for p in st.passes:
                if fused and p.fused:
                    continue
                kv = self.view(kv_cache, st, p.rows, p.back, p.slots)
                q = query[p.tokens]
                res = run_backend(self._decode_backend(q, kv, kernel), q, kv, sm_scale, self.window)
                out[p.dst] = (res if p.keep is None else res[p.keep]).to(out.dtype)
        by_len: dict[int, list[int]] = {}  # prefill rows with the same number of queries share one call
        for i in st.prefill_rows.tolist():
            by_len.setdefault(int(plan.query_start[i + 1]) - int(plan.query_start[i]), []).append(i)
        for t, rows in by_len.items():
            starts = [int(plan.query_start[i]) for i in rows]
            # one row (the usual chunked prefill): its query read in place and its output written in place
            one = len(rows) == 1 and out.dtype == query.dtype
            if one:
                q, dst = query[starts[0] : starts[0] + t][None], out[starts[0] : starts[0] + t][None]
            else:
                q, dst = torch.stack([query[a : a + t] for a in starts]), None  # [rows, T, Hq, D]
            kv = self.view(kv_cache, st, torch.tensor(rows, device=st.seq_lens.device))
            name = self._decode_backend(q, kv, kernel, chunk=True)
            if name is None:
                res = paged_attention_reference(q, kv, sm_scale=sm_scale, window=self.window)
            else:
                res = run_chunk_backend(name, q, kv, sm_scale, self.window, out=dst)
            if res is dst:
                continue
            for a, r in zip(starts, res):
                out[a : a + t] = r.to(out.dtype)

    def _attend_fused(
        self, kv_cache: torch.Tensor, st: StepTensors, query: torch.Tensor, out: torch.Tensor, sm_scale: float,
        kernel: str,
    ) -> bool:  # fmt: skip
        """Attend ``st.fused``, each in one CPU decode call (positions as query heads, see :class:`FusedPass`); False,
        with nothing written, where the views' decode backend is not the CPU kernel (it depends on the format and the
        view's structure alone: the same for every pass of a step)."""
        for i, f in enumerate(st.fused):
            kv = self.view(kv_cache, st, f.rows, f.back, f.slots)
            q = query[f.tokens]  # [Rf, K, Hq, D]
            if i == 0 and self._decode_backend(q[:, 0], kv, kernel) != "cpu":
                return False
            out[f.dst] = decode_positions(q, kv, f.cut, sm_scale)[f.keep].to(out.dtype)
        return True


_SAME: list = [None, None, False]  # _same_blocks' last comparison: (a, b, equal), the arrays kept alive with it


def _same_blocks(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two steps' first block ids are equal. Every layer asks the same question of the same two arrays in a
    step (its rows gathered at the last step, this step's), so the answer is kept for the next layer: a numpy
    comparison costs tens of microseconds with the caches cold after a kernel pass."""
    if _SAME[0] is not a or _SAME[1] is not b:
        _SAME[:] = a, b, bool(a.shape == b.shape and (a == b).all())
    return _SAME[2]


class _Rows:
    """Persistent buffers behind the views of up to ``capacity`` requests (block tables ``[n, W]`` int32 for
    each table width ``W`` met, lengths ``[n]`` int32, tails ``[n, H, B, D]`` in the layer's tail dtype), and their
    first-``r``-rows slices, the same tensor objects every time (see :meth:`PagedLayer.view`). The layers of a model
    share one set (:meth:`shared`): they run one after another, and each fills the buffers before its kernel reads
    them, so the gathered tails cost one layer's tails, not a second tail pool; ``holds`` names the step and view
    whose tables and lengths the buffers hold (None: another), which the next layers then do not copy again."""

    _by_shape: ClassVar[dict[tuple, _Rows]] = {}

    @classmethod
    def shared(cls, capacity: int, layer: PagedLayer, device: torch.device) -> _Rows:
        """The set for ``layer``'s shape, dtype and device with room for ``capacity`` rows."""
        key = (layer.kv_heads, layer.format.block_size, layer.head_dim, layer.tail_dtype, device)
        hit = cls._by_shape.get(key)
        if hit is None or hit.capacity < capacity:
            hit = cls._by_shape[key] = cls(capacity, layer, device)
        return hit

    def __init__(self, capacity: int, layer: PagedLayer, device: torch.device) -> None:
        h, b, d = layer.kv_heads, layer.format.block_size, layer.head_dim
        self.capacity, self.device = capacity, device
        self.tables: dict[int, torch.Tensor] = {}
        self.lens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.tail_k = torch.zeros(capacity, h, b, d, dtype=layer.tail_dtype, device=device)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.holds: tuple | None = None
        self._slices: dict[tuple[int, int], tuple] = {}

    def take(self, r: int, width: int) -> tuple:
        """``(tables, lens, tail_k, tail_v)`` of the first ``r`` rows, tables ``width`` wide."""
        hit = self._slices.get((r, width))
        if hit is None:
            if width not in self.tables:
                self.tables[width] = torch.zeros(self.capacity, width, dtype=torch.int32, device=self.device)
            parts = (self.tables[width], self.lens, self.tail_k, self.tail_v)
            hit = self._slices[r, width] = tuple(t[:r] for t in parts)
        return hit


class _SinkRows:
    """One layer's sink rows of up to ``capacity`` requests, gathered from their first pages (``[n, H, S, D]`` in
    the layer's tail dtype, keys and values), and their first-``r``-rows slices (the same tensor objects every time).
    ``holds``: the first block ids and the layer's sink-write count they were gathered at (None: unknown), so that a
    step whose requests have the same first blocks, none of them written since, gathers nothing."""

    def __init__(self, capacity: int, layer: PagedLayer, device: torch.device) -> None:
        shape = (capacity, layer.kv_heads, layer.format.sink, layer.head_dim)
        self.sink_k = torch.zeros(shape, dtype=layer.tail_dtype, device=device)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.holds: tuple | None = None
        self._slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._slices.get(r)
        if hit is None:
            hit = self._slices[r] = (self.sink_k[:r], self.sink_v[:r])
        return hit
