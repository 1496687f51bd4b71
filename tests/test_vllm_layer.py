"""The vLLM backend's storage without vLLM: page layout, tail table, and a layer driven by a simulated scheduler.

The simulated scheduler does what vLLM's does to a backend: block ids from a shuffled free list, prompts in
chunks of any size, decode steps, a second request reusing a first one's full blocks (a prefix-cache hit),
requests that end or are preempted with an open block, and block ids handed to a new owner. The oracle is
kvpack's own :class:`PagedKVCache` fed the same tokens: sealing is block-local, so the same blocks must give the
same codes and the same attention.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types

import numpy as np
import pytest
import torch

from kvpack import parse_format
from kvpack.cache import PagedKVCache
from kvpack.calibration import CalibrationDriftWarning
from kvpack.calibration.artifact import CalibratedScales
from kvpack.calibration.static import StaticScales
from kvpack.errors import CalibrationError, NonFiniteError, PoolExhaustedError, ShapeError
from kvpack.integrations.vllm.calibration import LayerCalibration, layer_calibration, worker_heads
from kvpack.integrations.vllm.hooks import release_request
from kvpack.integrations.vllm.layer import DECODE_QUERIES, PagedLayer, StepTensors
from kvpack.integrations.vllm.layout import ALIGN, PageLayout
from kvpack.integrations.vllm.tails import TailError, TailTable
from kvpack.kernels import cpu_seal
from kvpack.kernels.reference import paged_attention_reference
from kvpack.testing import CPU_CHUNK_TOL, assert_close, cpu_kernel_tolerance

H, D, HQ = 2, 64, 4
POISON = 0x7F  # every byte of a foreign page: a NaN/huge value in any dtype if a read strays there
TRITON_TOL = (2e-5, 1e-4)  # float32 queries, test_kernel_triton.TOL
REFINED = "k=int4:channel:asym:o5r,v=int4:g32:asym,sink=1"  # kept key channels as 4-bit refinement codes


def _pages(layout: PageLayout, num_blocks: int, interleave: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_cache [num_blocks, 1, B, C] int8 view, backing buffer)``: this layer's pages with ``interleave - 1``
    poisoned foreign pages between blocks (other layers' pages sit there in vLLM's block-major layouts)."""
    page = layout.page_bytes
    buf = torch.full((num_blocks, interleave, page), POISON, dtype=torch.uint8)
    buf[:, 0] = 0
    view = buf.view(torch.int8)[:, 0].view(num_blocks, 1, layout.block_size, layout.cell_bytes)
    return view, buf


@pytest.mark.parametrize(
    "preset",
    ["int8", "int4", "kivi2", "fp8", "k8v4", "fp16", "int4,sink=0", "int4-o4", "fp8-o4", "int8,tail=fp16", REFINED],
)
def test_page_holds_exactly_the_format_bytes_plus_the_sink_rows(preset):
    fmt = parse_format(preset)
    layout = PageLayout.build(fmt, H, D, torch.float32)
    tail_bytes = 4 if fmt.tail is None else 2  # the model's float32, or the format's own tail dtype
    sink = 2 * H * fmt.sink * D * tail_bytes  # rows of K and V in the tail dtype
    assert layout.page_bytes >= layout.format_block_bytes + sink
    if fmt.sink:
        assert (
            layout.region("sink_k").dtype == layout.tail_dtype == (torch.float32 if fmt.tail is None else torch.float16)
        )
    slack = layout.page_bytes - layout.format_block_bytes - sink
    # region alignment, and whole cells of a multiple of the activation size (4 bytes here)
    assert slack < len(layout.regions) * ALIGN + 4 * layout.block_size
    assert layout.cell_bytes % 4 == 0
    ends = [(r.offset, r.offset + r.nbytes) for r in layout.regions]
    assert all(a % ALIGN == 0 for a, _ in ends)
    assert all(e1 <= a2 for (_, e1), (a2, _) in itertools.pairwise(ends))  # regions do not overlap
    assert ends[-1][1] <= layout.page_bytes


def test_views_share_the_pages_and_skip_foreign_bytes():
    layout = PageLayout.build(parse_format("int4"), H, D, torch.float32)
    kv_cache, buf = _pages(layout, 5)
    pools = layout.views(kv_cache)
    pools["k_scale"][3].fill_(1.5)
    pools["v_data_bytes"][2].fill_(0xAB)
    assert pools["k_scale"].stride(0) * 2 == 2 * layout.page_bytes  # fp16 elements: two pages a block
    page3 = buf[3, 0]
    off = layout.region("k_scale").offset
    assert torch.equal(page3[off : off + 2].view(torch.float16), torch.tensor([1.5], dtype=torch.float16))
    assert (buf[:, 1] == POISON).all()  # the foreign pages were never written
    assert (buf[2, 0, layout.region("v_data").offset : layout.region("v_data").offset + 8] == 0xAB).all()


def test_views_refuse_another_layout():
    layout = PageLayout.build(parse_format("int8"), H, D, torch.float32)
    with pytest.raises(ShapeError, match="page layout does not match"):
        layout.views(torch.zeros(4, 1, 64, layout.cell_bytes + 16, dtype=torch.int8))


def test_outlier_channels_have_their_regions_in_the_page():
    fmt = parse_format("int4-o4")  # 4 channels per kv head
    layout = PageLayout.build(fmt, H, D, torch.float32)
    res, idx = layout.region("k_outlier"), layout.region("k_outlier_idx")
    assert (res.shape, res.dtype) == ((H, fmt.block_size, 4), torch.float16)
    assert (idx.shape, idx.dtype) == ((H, 4), torch.uint8)
    assert res.nbytes + idx.nbytes == fmt.outlier_bytes(H, D)
    refined = parse_format(REFINED)  # 5 channels: 3 bytes of 4-bit refinement codes per token
    res, idx = (PageLayout.build(refined, H, D, torch.float32).region(n) for n in ("k_outlier", "k_outlier_idx"))
    assert (res.shape, res.dtype, idx.shape) == ((H, refined.block_size, 3), torch.uint8, (H, 5))
    assert res.nbytes + idx.nbytes == refined.outlier_bytes(H, D)
    assert PageLayout.build(parse_format("int4"), H, D, torch.float32).region("k_outlier") is None


# -- the tail table -----------------------------------------------------------------------------------------


def _plan(table: TailTable, rows: list[tuple[int, int, list[int]]]):
    """rows: (tokens before the step, tokens this step, block ids)."""
    qs = np.cumsum([0] + [t for _, t, _ in rows])
    sl = np.array([c + t for c, t, _ in rows])
    w = max(len(b) for _, _, b in rows)
    bt = np.zeros((len(rows), w), dtype=np.int32)
    for i, (_, _, b) in enumerate(rows):
        bt[i, : len(b)] = b
    return table.plan(qs, sl, bt)


def test_a_block_keeps_a_tail_until_its_last_slot_is_written():
    table = TailTable(num_blocks=10, capacity=2, block_size=4)
    p = _plan(table, [(0, 3, [5])])
    assert table.num_allocated == 1 and p.seal_block.size == 0 and list(p.write_off) == [0, 1, 2]
    p = _plan(table, [(3, 1, [5])])
    assert list(p.seal_block) == [5] and list(p.seal_from) == [3] and p.seal_slot[0] >= 0
    assert table.num_allocated == 0 and p.tail_slot[0] == 0  # nothing of the request is in a tail: it reads none
    p = _plan(table, [(4, 6, [5, 7, 8])])  # a chunk that seals one block and opens the next
    assert list(p.seal_block) == [7] and list(p.seal_from) == [0] and list(p.seal_tok) == [0]
    assert list(p.write_tok) == [4, 5] and table.num_allocated == 1


def test_tails_of_ended_requests_are_released_and_reused_block_ids_start_over():
    table = TailTable(num_blocks=10, capacity=2, block_size=4)
    _plan(table, [(0, 2, [3]), (0, 1, [4])])
    assert table.num_allocated == 2
    assert table.release_blocks([3, 9]) == 1  # request 1 finished (9 had no tail)
    _plan(table, [(0, 2, [4])])  # block 4 handed to a new owner: it starts at slot 0, its old tail is garbage
    assert table.num_allocated == 1
    table.release_blocks([4])
    assert table.num_allocated == 0


def test_a_write_into_the_middle_of_a_sealed_block_is_refused_and_changes_nothing():
    table = TailTable(num_blocks=10, capacity=2, block_size=4)
    _plan(table, [(0, 2, [3])])
    before = table.slot_of_block.copy()
    with pytest.raises(TailError, match="sealed"):
        _plan(table, [(2, 1, [3]), (5, 1, [1, 6])])  # block 6 was never opened: a partial hit into a sealed block
    assert np.array_equal(table.slot_of_block, before) and table.num_allocated == 1


def test_more_open_blocks_than_tail_slots_is_refused_before_any_change():
    table = TailTable(num_blocks=10, capacity=1, block_size=4)
    with pytest.raises(PoolExhaustedError, match="max-num-seqs"):
        _plan(table, [(0, 1, [1]), (0, 1, [2])])
    assert table.num_allocated == 0


def test_tails_follow_their_requests_rows():
    table = TailTable(num_blocks=10, capacity=3, block_size=8)
    p = _plan(table, [(0, 2, [3]), (0, 1, [4])])
    assert list(p.tail_slot) == [0, 1] and list(p.write_slot) == [0, 0, 1] and p.move_src.size == 0
    p = _plan(table, [(1, 1, [4]), (2, 1, [3])])  # the rows swap: so do the tails, before this step's writes
    assert sorted(zip(p.move_src, p.move_dst)) == [(0, 1), (1, 0)] and list(p.write_slot) == [0, 1]
    assert table.slot_of_block[4] == 0 and table.slot_of_block[3] == 1
    p = _plan(table, [(3, 1, [3])])  # block 4's request is not scheduled: its tail gives slot 0 up
    assert sorted(zip(p.move_src, p.move_dst)) == [(0, 1), (1, 0)] and table.slot_of_block[4] == 1
    p = _plan(table, [(4, 5, [3, 5]), (2, 1, [4])])  # block 3 seals from its tail, block 5 opens at row 0
    assert list(p.seal_block) == [3] and list(p.seal_slot) == [0] and p.move_src.size == 0
    assert table.slot_of_block[5] == 0 and table.slot_of_block[3] == -1 and table.num_allocated == 2


def test_more_requests_than_tail_slots_is_refused_before_any_change():
    table = TailTable(num_blocks=10, capacity=2, block_size=4)
    _plan(table, [(0, 1, [1])])
    with pytest.raises(PoolExhaustedError, match="max-num-seqs"):
        _plan(table, [(0, 4, [2]), (1, 1, [1]), (0, 4, [3])])  # three rows, even with one open block
    with pytest.raises(PoolExhaustedError, match="max-num-seqs"):
        _plan(table, [(0, 1, [2]), (0, 1, [3])])  # two rows need both slots, block 1's parked tail has none
    assert table.num_allocated == 1 and table.slot_of_block[1] == 0


def test_sink_positions_go_to_the_first_block():
    table = TailTable(num_blocks=10, capacity=2, block_size=4, sink=2)
    _plan(table, [(0, 1, [5])])
    p = _plan(table, [(0, 6, [2, 3]), (1, 1, [5])])
    assert list(p.sink_tok) == [0, 1, 6] and list(p.sink_block) == [2, 2, 5] and list(p.sink_pos) == [0, 1, 1]


def test_the_null_block_is_never_stored():
    table = TailTable(num_blocks=10, capacity=1, block_size=4)
    p = _plan(table, [(0, 3, [0])])
    assert table.num_allocated == 0 and p.write_tok.size == 0


# -- a layer under a simulated scheduler -----------------------------------------------------------------


def _static_scales(fmt) -> CalibratedScales:
    """Static scales of one layer for ``fmt``'s static specs, wide enough for :class:`_Sim`'s keys (``2 x randn``, one
    channel shifted by 6) and values (``randn``): what a calibration artifact would hold."""

    def role(name: str, spec, lo: float, hi: float) -> StaticScales | None:
        if not spec.static:
            return None
        shape = (1, *spec.scale_shape(H, 1, D))
        zero = None
        if spec.dtype.is_fp8:
            scale = torch.full(shape, max(-lo, hi) / spec.dtype.fp8_max)
        elif spec.has_zero:
            scale, zero = torch.full(shape, (hi - lo) / spec.qmax), torch.full(shape, lo)
        else:
            scale = torch.full(shape, max(-lo, hi) / spec.qmax)
        half = torch.float16
        return StaticScales(name, spec, scale.to(half), None if zero is None else zero.to(half), "absmax")

    return CalibratedScales(fmt, role("key", fmt.key, -12.0, 18.0), role("value", fmt.value, -6.0, 6.0))


class _Sim:
    """Requests scheduled in steps over one :class:`PagedLayer`, mirrored into kvpack's own cache."""

    def __init__(
        self, preset: str, num_blocks: int, capacity: int, kernel: str, seed: int, window: int | None = None,
        freed: str = "stale", head_dim: int = D, spec_tokens: int = 0,
    ):  # fmt: skip
        """``window``: the layer's sliding window. As vLLM's sliding-window manager does, a block every later query
        leaves out goes back to the free list (at its end: the next one handed out) once no request holds it;
        ``freed`` says what the request's block table names there afterwards: the old id (``stale``, as the model
        runner's list keeps it) or the null block (``null``)."""
        self.window, self.freed_mode, self.d = window, freed, head_dim
        self.fmt = parse_format(preset)
        self.b = self.fmt.block_size
        cal = _static_scales(self.fmt) if self.fmt.is_static else None
        layer_cal = (
            None
            if cal is None
            else LayerCalibration(*(None if s is None else s.layer(0) for s in (cal.key, cal.value)), None)
        )
        self.table = TailTable(num_blocks, capacity, self.b, self.fmt.sink, spec_tokens=spec_tokens)
        self.layer = PagedLayer(
            self.fmt, H, head_dim, capacity, torch.float32, torch.device("cpu"), calibration=layer_cal, window=window,
            slots=self.table.slots,
        )  # fmt: skip
        self.kv_cache, self.buf = _pages(self.layer.layout, num_blocks)
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.oracle = PagedKVCache(
            self.fmt, 1, H, head_dim, num_blocks, tail_dtype=torch.float32, max_seqs=16, calibration=cal
        )
        self.kernel = kernel
        self.gen = torch.Generator().manual_seed(seed)
        self.reqs: dict[int, dict] = {}
        self.reserve_reads = 0  # decode calls whose tails were reserves

    def add(self, rid: int, share_from: int | None = None, shared_blocks: int = 0) -> None:
        blocks, k, v, n, gone = [], None, None, 0, set()
        sid = self.oracle.add_sequence()
        if share_from is not None:  # a prefix-cache hit: the first full blocks are the other request's pages
            src = self.reqs[share_from]
            blocks = list(src["blocks"][:shared_blocks])
            gone = {j for j in src["gone"] if j < shared_blocks}  # out of the window: not this request's either
            n = shared_blocks * self.b
            k, v = src["k"][:n].clone(), src["v"][:n].clone()
            self.oracle.append(0, [sid], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        self.reqs[rid] = {"blocks": blocks, "n": n, "k": k, "v": v, "sid": sid, "gone": gone}

    def end(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        release_request(self.table, (req["blocks"],))  # the runner hook, before the next step
        self.oracle.free(req["sid"])
        held = self._held()
        self.free += [b for j, b in enumerate(req["blocks"]) if j not in req["gone"] and b and b not in held]

    def rollback(self, rid: int, n: int) -> None:
        """Speculative decoding's rejection: request ``rid`` keeps its first ``n`` tokens (its blocks stay, as
        vLLM's do), and its next step writes from position ``n``. The oracle is rebuilt from those tokens: what a
        run that never saw the drafts holds (the layer keeps a sealed block's exact rows, not dequantized ones)."""
        req = self.reqs[rid]
        req["n"], req["k"], req["v"] = n, req["k"][:n], req["v"][:n]
        self.oracle.free(req["sid"])
        req["sid"] = self.oracle.add_sequence()
        self.oracle.append(0, [req["sid"]], req["k"].transpose(0, 1)[None], req["v"].transpose(0, 1)[None])

    def _decoded(self, req: dict, pos: int, q: torch.Tensor) -> torch.Tensor:
        """``[HQ, D]``: the attention of query ``q`` (``[HQ, D]``) at position ``pos`` over a cache of the request's
        first ``pos + 1`` tokens (its last block open)."""
        sid = self.oracle.add_sequence()
        try:
            k, v = req["k"][: pos + 1], req["v"][: pos + 1]
            self.oracle.append(0, [sid], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            return paged_attention_reference(q[None, None], self.oracle.view(0, [sid]), window=self.window)[0, 0]
        finally:
            self.oracle.free(sid)

    def _held(self) -> set[int]:
        return {b for r in self.reqs.values() for j, b in enumerate(r["blocks"]) if j not in r["gone"]}

    def _slide(self) -> None:
        """Free the blocks every later query of a request leaves out of the window (vLLM's sliding-window
        manager), once no request holds them."""
        if self.window is None:
            return
        for req in self.reqs.values():
            for j in range(len(req["blocks"])):
                if (j + 1) * self.b <= req["n"] + 1 - self.window and j not in req["gone"]:
                    req["gone"].add(j)
        held = self._held()
        for req in self.reqs.values():
            for j in sorted(req["gone"]):
                bid = req["blocks"][j]
                if bid and bid not in held and bid not in self.free:
                    self.free.append(bid)  # handed out next
                if self.freed_mode == "null":
                    req["blocks"][j] = 0

    def step(self, work: dict[int, int]) -> None:
        """One step: request rid gets ``work[rid]`` new tokens; checks every query's attention."""
        rids = list(work)
        toks_k, toks_v, rows = [], [], []
        for rid in rids:
            req, t = self.reqs[rid], work[rid]
            need = -(-(req["n"] + t) // self.b) - len(req["blocks"])
            req["blocks"] += [int(self.free.pop()) for _ in range(need)]
            nk = torch.randn(t, H, self.d, generator=self.gen) * 2
            nv = torch.randn(t, H, self.d, generator=self.gen)
            nk[:, :, 3] += 6.0  # an outlier key channel, as real models have
            toks_k.append(nk)
            toks_v.append(nv)
            rows.append((req["n"], t, req["blocks"]))
        qs = np.cumsum([0] + [t for _, t, _ in rows])
        sl = np.array([c + t for c, t, _ in rows])
        bt = torch.zeros(len(rows), max(len(b) for _, _, b in rows), dtype=torch.int32)
        for i, (_, _, b) in enumerate(rows):
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        plan = self.table.plan(qs, sl, bt.numpy())
        st = StepTensors.from_plan(plan, bt, self.b)
        self.reserve_reads += sum(p.slots is not None for p in st.passes)
        key, value = torch.cat(toks_k), torch.cat(toks_v)
        query = torch.randn(int(qs[-1]), HQ, self.d, generator=self.gen)
        self.layer.write(self.kv_cache, plan, key, value)
        out = torch.full_like(query, float("nan"))
        self.layer.attend(self.kv_cache, plan, st, query, out, sm_scale=self.d**-0.5, kernel=self.kernel)
        for i, rid in enumerate(rids):
            req = self.reqs[rid]
            k, v = toks_k[i], toks_v[i]
            req["k"] = k if req["k"] is None else torch.cat([req["k"], k])
            req["v"] = v if req["v"] is None else torch.cat([req["v"], v])
            req["n"] += work[rid]
            self.oracle.append(0, [req["sid"]], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            want = paged_attention_reference(
                query[qs[i] : qs[i + 1]][None], self.oracle.view(0, [req["sid"]]), window=self.window
            )[0]
            n, t = req["n"], work[rid]
            if plan.reserve_slot[i] >= 0 and t <= DECODE_QUERIES:
                # drafts sealed a block and the step kept its rows in a reserve: the queries inside that block read
                # it from there, full precision, as steps without drafts read it from the tail; their reference is
                # a cache holding their history alone
                for j in range(t):
                    if t - 1 - j > n % self.b:
                        want[j] = self._decoded(req, n - t + j, query[qs[i] + j])
            atol, rtol = 1e-5, 1e-5  # the same codes, read by the reference
            if self.kernel == "triton":  # the Triton kernels (interpreter): float32 dots, float32 accumulation
                atol, rtol = TRITON_TOL
            elif self.kernel != "reference" and work[rid] == 1:  # decode rows through the fused CPU kernel
                atol, rtol = cpu_kernel_tolerance(self.oracle.view(0, [req["sid"]]))
            elif self.kernel != "reference":  # prefill rows through the fused CPU chunk kernel
                atol, rtol = CPU_CHUNK_TOL
            assert_close(out[qs[i] : qs[i + 1]], want, atol, rtol, f"request {rid} at {req['n']} tokens")
        assert (self.buf[:, 1] == POISON).all(), "a write strayed into another layer's pages"
        self._slide()


@pytest.mark.parametrize(
    ("preset", "kernel"),
    [("kv=fp32", "reference"), ("int8", "auto"), ("int4", "reference"), ("fp8", "auto"), ("kivi2", "reference"),
     ("int4,block=16", "auto"), ("k8v4,sink=0", "reference"), ("int8", "triton"), ("int4,block=16", "triton"),
     ("int4-o4", "auto"), ("fp8-o4", "auto"), ("int4-o4,block=16", "triton"), ("int8@static", "auto"),
     ("fp8@static", "reference"), ("k=int8:channel:asym:static:o4,v=int8:token,sink=1", "auto"),
     ("int8,tail=fp16", "auto"), ("int4,block=16,tail=bf16", "reference"), ("int4,block=16,tail=fp16", "triton"),
     ("fp8,tail=fp16", "auto"), (REFINED, "auto"), (REFINED + ",block=16", "triton")],
)  # fmt: skip
def test_layer_under_a_scheduler_matches_kvpacks_own_cache(preset, kernel):
    """``triton``: the Triton decode and chunk kernels (under the interpreter) reading the strided page views
    between poisoned foreign pages, as they would on CUDA."""
    with contextlib.ExitStack() as stack:
        if kernel == "triton":
            pytest.importorskip("triton")
            from _triton_interpreter import fixed_interpreter

            stack.enter_context(fixed_interpreter())
        _schedule(_Sim(preset, num_blocks=48, capacity=4, kernel=kernel, seed=7))


@pytest.mark.parametrize("preset", ["int4", "k4v2", "int4-o4,block=16", "kivi2"])
def test_layer_at_a_head_dim_that_g32_does_not_divide(preset):
    """Phi-2's head_dim 80: value groups of 20 channels (four a token, where g32 divides nothing), in the page
    and read by the fused CPU kernels."""
    sim = _Sim(preset, num_blocks=48, capacity=4, kernel="auto", seed=3, head_dim=80)
    assert sim.layer.layout.region("v_scale").shape[-1] == 4
    _schedule(sim)


@pytest.mark.parametrize(
    ("preset", "kernel"),
    [("kv=fp32", "reference"), ("int8,block=16", "auto"), ("int4,block=16", "reference"), ("int8,block=16", "triton")],
)
def test_drafts_rejected_inside_a_block_they_sealed_reopen_it(preset, kernel):
    """Speculative decoding under the simulated scheduler: each decode step writes its token and three drafts, and
    the next starts after the accepted ones (0-3 of them, at random). A draft in a block's last slot seals the block
    and keeps its rows in a reserve; a rejection then writes into the block again, which reopens it from the
    reserve, exactly: every query's attention matches a cache that never saw the drafts (the queries inside the block
    a step sealed read it from the reserve, as steps without drafts read it from the tail). Request 2 sits out every
    fifth step, holding its reserve meanwhile; once all end, nothing is held."""
    with contextlib.ExitStack() as stack:
        if kernel == "triton":
            pytest.importorskip("triton")
            from _triton_interpreter import fixed_interpreter

            stack.enter_context(fixed_interpreter())
        sim = _Sim(preset, num_blocks=64, capacity=3, kernel=kernel, seed=11, spec_tokens=3)
        b, drafts = sim.b, 3
        rng = np.random.default_rng(5)
        for rid in range(3):
            sim.add(rid)
        sim.step({0: b + 5, 1: 2 * b - 2, 2: 3})
        reopened = reserved = 0
        for step in range(2 * b if kernel != "triton" else b // 2):
            work = {rid: 1 + drafts for rid in sim.reqs if not (rid == 2 and step % 5 == 4)}
            before = {rid: sim.reqs[rid]["n"] for rid in work}
            sim.step(work)
            reserved = max(reserved, sim.table.num_reserved)
            for rid, c in before.items():
                n = c + 1 + int(rng.integers(0, drafts + 1))
                if n < c + 1 + drafts:
                    reopened += n // b < (c + 1 + drafts) // b and n % b > 0  # back inside a block it sealed
                    sim.rollback(rid, n)
        assert reopened > 0 and reserved > 0 and sim.reserve_reads > 0
        assert sim.table.num_reserved <= 3
        for rid in list(sim.reqs):
            sim.end(rid)
        assert sim.table.num_allocated == 0


def test_short_query_rows_are_decode_passes_and_the_rest_chunk_rows():
    """On the CPU, requests with up to DECODE_QUERIES queries that all lie in the open block go to the decode kernel,
    one call per query position: all requests with the tails in place when most take part, the members' tails
    gathered when few do; the queries before the last also as fused calls (positions as query heads: those in the
    open block, those in a block the step sealed), which a layer without a window takes instead of those calls. A
    request whose queries reach back into a block the step sealed is a chunk row unless the step kept that block's
    rows in a reserve (drafts inside); a request with more queries is one too."""
    b = 16
    ql = np.array([1, 4, 1, 1, 20, 3, DECODE_QUERIES + 1])
    sl = np.array([30, 36, 17, 5, 40, 33, 60])  # request 5: 33 % 16 = 1, its first query is in the block sealed
    qs = np.concatenate([[0], np.cumsum(ql)])
    plan = types.SimpleNamespace(query_lens=ql, seq_lens=sl, query_start=qs, reserve_slot=np.full(7, -1))
    st = StepTensors.from_plan(plan, torch.zeros(7, 4, dtype=torch.int32), b)
    assert st.prefill_rows.tolist() == [4, 5, 6] and not st.decode_dense
    last = qs[:7] + ql - 1
    first, *rest = st.passes
    assert first.rows is None and first.back is None  # 4 of 7: every request, the others' outputs dropped
    assert first.tokens.tolist() == last.tolist() and first.keep.tolist() == [0, 1, 2, 3]
    assert first.dst.tolist() == last[:4].tolist()
    assert len(rest) == 3  # request 1's three earlier queries, its tail gathered alone
    for k, p in enumerate(rest, start=1):
        assert p.rows.tolist() == [1] and p.back.tolist() == [k] and p.keep is None
        assert p.tokens.tolist() == p.dst.tolist() == [last[1] - k]
        assert p.fused  # ... which the fused pass also holds: one call, three positions as heads
    assert not first.fused
    (f,) = st.fused
    assert f.rows.tolist() == [1] and f.cut.tolist() == [[1, 2, 3]] and f.keep.all() and f.back is None
    assert f.tokens.tolist() == [[last[1] - 1, last[1] - 2, last[1] - 3]] and f.dst.tolist() == f.tokens[0].tolist()
    # with a reserve for request 5's sealed block (slot 9): its queries at positions 32 and 31 read the pages and
    # its open block (31 ends block 1: no tail rows), the one at 30 reads block 0 and the reserve's first 15 rows
    kept = types.SimpleNamespace(**{**vars(plan), "reserve_slot": np.array([-1, -1, -1, -1, -1, 9, -1])})
    st = StepTensors.from_plan(kept, torch.zeros(7, 4, dtype=torch.int32), b)
    assert st.prefill_rows.tolist() == [4, 6]
    got = [(p.rows is None, None if p.rows is None else p.rows.tolist(), None if p.back is None else p.back.tolist(),
            None if p.slots is None else p.slots.tolist(), p.dst.tolist()) for p in st.passes]  # fmt: skip
    assert got == [
        (True, None, None, None, last[[0, 1, 2, 3, 5]].tolist()),  # 5 of 7: every request
        (False, [1, 5], [1, 1], None, [last[1] - 1, last[5] - 1]),
        (False, [1], [2], None, [last[1] - 2]),
        (False, [5], [2], [9], [last[5] - 2]),  # the reserve gathered as request 5's tail
        (False, [1], [3], None, [last[1] - 3]),
    ]
    assert [p.fused for p in st.passes] == [False, True, True, True, True]
    f, r = st.fused  # request 5's query at 31 ends on the sealed block 1 (cut 1: no tail row); its padding dropped
    assert f.rows.tolist() == [1, 5] and f.cut.tolist() == [[1, 2, 3], [1, 1, 1]]
    assert f.keep.tolist() == [[True, True, True], [True, False, False]]
    assert f.dst.tolist() == [last[1] - 1, last[1] - 2, last[1] - 3, last[5] - 1]
    # its query at 30, in the block the step sealed: a history cut by 2, the reserve (slot 9) as its tail
    assert r.rows.tolist() == [5] and r.back.tolist() == [2] and r.slots.tolist() == [9]
    assert r.cut.tolist() == [[0]] and r.dst.tolist() == [last[5] - 2]
    dense = StepTensors.from_plan(types.SimpleNamespace(query_lens=np.ones(3, np.int64), seq_lens=sl[:3],
                                                        query_start=np.arange(4), reserve_slot=np.full(3, -1)),
                                  torch.zeros(3, 4), b)  # fmt: skip
    assert dense.decode_dense and dense.fused == ()
    # off the CPU the decode kernel reads the history once per call: only single queries decode there
    gpu_like = StepTensors.from_plan(plan, torch.zeros(7, 4, dtype=torch.int32, device="meta"), b)
    assert gpu_like.prefill_rows.tolist() == [1, 4, 5, 6] and len(gpu_like.passes) == 1 and gpu_like.fused == ()


def _schedule(sim: _Sim) -> None:
    b = sim.b
    sim.add(0)
    sim.add(1)
    sim.step({0: b + 5, 1: 3})  # a prompt past one block next to a short one
    sim.step({0: 2 * b - 5, 1: b})  # chunks that end on a block boundary and inside one
    for _ in range(3):
        sim.step({0: 1, 1: 1})  # decode
    sim.add(2, share_from=0, shared_blocks=2)  # a prefix-cache hit on request 0's two full blocks
    sim.step({2: 7, 0: 1, 1: 1})
    sim.step({1: 1, 2: 1})  # request 0 not scheduled: its tail is parked while request 2 takes its slot
    sim.step({0: 1, 2: 1, 1: 1})  # ... and read again, from wherever it moved
    sim.end(1)  # finished with an open block: its tail is released
    assert sim.table.num_allocated == 2
    sim.add(3)
    sim.step({3: b - 1, 2: 1, 0: 1})  # request 1's block ids may come back: they start over at slot 0
    sim.step({3: 1, 2: b, 0: 1})  # request 3's block seals from its tail on a decode step
    for rid in list(sim.reqs):
        sim.end(rid)
    assert sim.table.num_allocated == 0


@pytest.mark.parametrize("preset", ["int8,block=16", "int4,block=16,tail=bf16"])
def test_a_reused_first_block_gets_its_new_sink_rows(preset):
    """Decode steps gather each request's sink rows from its first page only when the first blocks or their sink
    rows changed. A request that ends and whose first block becomes the next request's first block, at the same
    row, in steps where every request decodes: the new request's sink rows, written as its position 0 arrives, are
    what its queries read once that block seals (the oracle checks every step)."""
    sim = _Sim(preset, num_blocks=24, capacity=2, kernel="auto", seed=5)
    b = sim.b
    sim.add(0)
    sim.add(1)
    sim.step({0: b + 5, 1: 3})  # request 1: three tokens, one (open) block
    for _ in range(2):
        sim.step({0: 1, 1: 1})
    first = sim.reqs[1]["blocks"][0]
    sim.end(1)
    sim.add(3)
    sim.step({0: 1, 3: 1})  # a one-token prompt: every request decodes
    assert sim.reqs[3]["blocks"][0] == first  # the freed block, handed out next
    for _ in range(b + 2):  # past the seal of request 3's first block, whose sink rows its queries then read
        sim.step({0: 1, 3: 1})


@pytest.mark.parametrize("preset", ["int8", "fp8"])  # the compiled seal, and quantize's
@pytest.mark.parametrize("role", ["key", "value"])
def test_non_finite_rows_are_refused_at_seal_and_nothing_is_written(preset, role):
    sim = _Sim(preset, num_blocks=8, capacity=2, kernel="reference", seed=1)
    plan = _plan(sim.table, [(0, 64, [3])])
    before = sim.buf.clone()
    rows = {"key": torch.randn(64, H, D), "value": torch.randn(64, H, D)}
    rows[role][10, 1, 5] = float("nan")  # a value's NaN too: the keys, finite, must not be written either
    with pytest.raises(NonFiniteError, match="position 10"):
        sim.layer.write(sim.kv_cache, plan, rows["key"], rows["value"])
    assert torch.equal(sim.buf, before)


@pytest.mark.parametrize("role", ["key", "value"])
def test_a_row_that_overflows_a_float16_tail_is_refused_and_nothing_is_written(role):
    """A float32 model's rows in ``tail=fp16``: a magnitude past float16's 65504 would become inf in the tail; the
    step is refused with the fix named, pages and tails as they were (a sealing write and a tail write alike)."""
    sim = _Sim("int8,tail=fp16", num_blocks=8, capacity=2, kernel="reference", seed=1)
    assert sim.layer.tail_k.dtype == torch.float16 and sim.layer.dtype == torch.float32
    sim.layer.write(sim.kv_cache, _plan(sim.table, [(0, 10, [3])]), torch.randn(10, H, D), torch.randn(10, H, D))
    plan = _plan(sim.table, [(10, 60, [3, 4])])  # seals block 3, opens block 4
    before, tails = sim.buf.clone(), (sim.layer.tail_k.clone(), sim.layer.tail_v.clone())
    rows = {"key": torch.randn(60, H, D), "value": torch.randn(60, H, D)}
    rows[role][57, 1, 5] = 7e4
    with pytest.raises(
        NonFiniteError,
        match=rf"{role} of magnitude 7e\+04 \(step token 57, kv head 1\) overflows the float16 tail.*tail=bf16",
    ):
        sim.layer.write(sim.kv_cache, plan, rows["key"], rows["value"])
    assert torch.equal(sim.buf, before)
    assert torch.equal(sim.layer.tail_k, tails[0]) and torch.equal(sim.layer.tail_v, tails[1])
    rows[role][57, 1, 5] = 6e4  # within float16's range: stored
    sim.layer.write(sim.kv_cache, plan, rows["key"], rows["value"])
    assert not torch.equal(sim.buf, before)


def test_a_rotated_key_that_overflows_a_float16_tail_is_refused():
    """``fp8`` stores keys rotated: a key whose every channel fits float16 can still overflow once rotated (the
    rotation can gather its length into one channel); the check looks at what the tail would hold."""
    sim = _Sim("fp8,tail=fp16", num_blocks=8, capacity=2, kernel="reference", seed=1)
    plan = _plan(sim.table, [(0, 10, [3])])
    key = torch.randn(10, H, D)
    key[4, 0] = 1e5 * sim.layer.rotation[:, 0]  # every channel 1e5 / 8; rotated, channel 0 holds all of 1e5
    assert key.abs().max() < 65504
    before, tails = sim.buf.clone(), sim.layer.tail_k.clone()
    with pytest.raises(NonFiniteError, match=r"a key of magnitude 1e\+05 \(step token 4, kv head 0\)"):
        sim.layer.write(sim.kv_cache, plan, key, torch.randn(10, H, D))
    assert torch.equal(sim.buf, before) and torch.equal(sim.layer.tail_k, tails)


def test_tensor_parallel_workers_take_their_heads_rows_of_the_scales(tmp_path):
    """vLLM's sharding of kv heads (an even split, or replicas when heads are fewer than workers), and each worker's
    slice of an artifact's per-channel scales and outlier channels."""
    assert [worker_heads(r, 3, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [worker_heads(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [worker_heads(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    from kvpack.calibration import Artifact, KVObserver, fingerprint_from_config

    layers, heads = 2, 4
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
           "num_attention_heads": 8, "num_key_value_heads": heads, "hidden_size": 8 * D, "head_dim": D,
           "vocab_size": 100, "rope_theta": 10000.0}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    obs = KVObserver(())
    for layer in range(layers):  # [batch, H, T, D] keys whose channels differ from head to head
        k = torch.randn(2, heads, 48, D, generator=g) * torch.arange(1, heads + 1).view(1, heads, 1, 1)
        obs.observe(layer, k, torch.randn(2, heads, 48, D, generator=g))
    fmt = parse_format("k=int8:channel:asym:static:o4,v=int8:token,sink=1")
    data = {"name": "test", "samples": 2, "seq_len": 48, "seed": 0, "tokens_sha256": "0" * 64}
    Artifact.build(*obs.stats(), fmt, fingerprint_from_config(cfg), data).save(tmp_path)
    whole = layer_calibration(str(tmp_path), fmt, 1, heads, D, torch.device("cpu"))
    part = layer_calibration(str(tmp_path), fmt, 1, 2, D, torch.device("cpu"), heads=(2, 4))
    assert torch.equal(part.key.scale, whole.key.scale[2:4]) and torch.equal(part.key.zero, whole.key.zero[2:4])
    assert torch.equal(part.channels, whole.channels[2:4]) and part.value is None
    with pytest.raises(CalibrationError, match="kv heads"):
        layer_calibration(str(tmp_path), fmt, 1, 2, D, torch.device("cpu"), heads=(3, 5))


def test_inputs_outside_the_static_range_warn_once_they_pass_the_threshold():
    fmt = parse_format("int8@static")
    narrow = StaticScales(
        "key", fmt.key, torch.full((1, H, 1, D), 2.0 / 255).half(), torch.full((1, H, 1, D), -1.0).half(), "absmax"
    )
    layer = PagedLayer(
        fmt, H, D, 2, torch.float32, torch.device("cpu"), calibration=LayerCalibration(narrow.layer(0), None, None, 7)
    )
    kv_cache, _ = _pages(layer.layout, 6)
    table = TailTable(6, 2, fmt.block_size, fmt.sink)
    plan = _plan(table, [(0, 64, [3])])
    with pytest.warns(CalibrationDriftWarning, match="layer 7"):  # keys ~ randn * 3 against a range of [-1, 1]
        layer.write(kv_cache, plan, torch.randn(64, H, D) * 3, torch.randn(64, H, D))
    report = layer.clip_monitor.report()
    assert report["layers_over_threshold"] == [7] and report["sealed"][7] == 64 * H * D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["int8", "int4", "k4v2", "k8v4", "int4,sink=0"])  # k8v4: symmetric keys
def test_compiled_writes_store_the_same_bytes_as_the_torch_path(preset, dtype):
    """Tail rows and seals in compiled calls (``kvpack.kernels.cpu_seal.write_rows`` / ``seal_step``) against the
    torch scatter and gather with ``quantize``: the same pages and tails, bit for bit, in every model dtype, from
    strided rows, over steps that open, fill from a tail, seal straight from a prefill chunk and move tails between
    slots."""
    fmt = parse_format(preset)
    b = fmt.block_size
    layers, caches, bufs, tables = [], [], [], []
    for compiled in (True, False):
        layer = PagedLayer(fmt, H, D, 3, dtype, torch.device("cpu"))
        assert layer._compiled_writes
        layer._compiled_writes = compiled
        kv_cache, buf = _pages(layer.layout, 12)
        layers.append(layer), caches.append(kv_cache), bufs.append(buf)
        tables.append(TailTable(12, 3, b, fmt.sink))
    gen = torch.Generator().manual_seed(7)
    steps = [
        [(0, b + 5, [3, 4])],  # a prefill that seals one block and leaves 5 rows in a tail
        [(b + 5, 1, [3, 4]), (0, 3, [6])],  # a decode row and a new request
        [(3, 1, [6])],  # the first request is not scheduled: the tails swap slots
        [(b + 6, b - 6, [3, 4]), (4, 2 * b, [6, 7, 8])],  # seals from both tails and from the chunk alone
    ]
    moved = 0
    for rows in steps:
        n = sum(t for _, t, _ in rows)
        qkv = torch.randn(n, 3 * H, D, generator=gen).to(dtype)  # keys and values as views of one projection
        k, v = qkv[:, H : 2 * H], qkv[:, 2 * H :]  # output, as vLLM hands them over: strided rows
        k.mul_(3)
        for layer, kv_cache, table in zip(layers, caches, tables):
            plan = _plan(table, rows)
            layer.write(kv_cache, plan, k, v)
        moved += plan.move_src.size
    assert moved
    assert torch.equal(bufs[0], bufs[1])
    assert torch.equal(layers[0].tail_k.view(torch.uint8), layers[1].tail_k.view(torch.uint8))
    assert torch.equal(layers[0].tail_v.view(torch.uint8), layers[1].tail_v.view(torch.uint8))
    assert (bufs[0][:, 1] == POISON).all()  # no write strayed into the foreign pages between blocks


def test_compiled_tail_writes_refuse_rows_outside_the_tails():
    tails = (torch.zeros(2, H, 8, D), torch.zeros(2, H, 8, D))
    new = (torch.ones(4, H, D), torch.ones(4, H, D))
    i64 = functools.partial(np.array, dtype=np.int64)
    cpu_seal.write_rows(tails, new, i64([1, 3]), i64([0, 1]), i64([2, 7]))
    assert tails[0][0, :, 2].eq(1).all() and tails[1][1, :, 7].eq(1).all() and tails[0].sum() == 2 * H * D
    for toks, slots, offs in (([4], [0], [0]), ([0], [2], [0]), ([0], [0], [8]), ([0, 0], [0, -1], [0, 0])):
        before = [t.clone() for t in tails]
        with pytest.raises(ShapeError, match="outside the tails"):
            cpu_seal.write_rows(tails, new, i64(toks), i64(slots), i64(offs))
        assert all(torch.equal(a, t) for a, t in zip(before, tails))


@pytest.mark.parametrize(
    ("preset", "kernel", "window", "freed"),
    [("kv=fp32", "reference", 100, "stale"), ("int8", "auto", 100, "stale"), ("int8", "auto", 130, "null"),
     ("int4,block=16", "auto", 40, "stale"), ("fp8", "reference", 100, "null"), ("int4-o4", "auto", 100, "stale"),
     ("int4,block=16", "triton", 40, "stale")],
)  # fmt: skip
def test_a_sliding_window_layer_matches_kvpacks_own_cache(preset, kernel, window, freed):
    """A layer with a sliding window, its requests' blocks freed as they leave it and handed to other requests at
    once: the window's queries read only their own blocks (a freed id now holds another request's codes, or is
    the null block), and a request that ends releases only its own tail, not the one of the request its old
    block id went to."""
    with contextlib.ExitStack() as stack:
        if kernel == "triton":
            pytest.importorskip("triton")
            from _triton_interpreter import fixed_interpreter

            stack.enter_context(fixed_interpreter())
        sim = _Sim(preset, num_blocks=48, capacity=4, kernel=kernel, seed=11, window=window, freed=freed)
        b, w = sim.b, window
        sim.add(0)
        sim.add(1)
        sim.step({0: w + 2 * b + 3, 1: 5})  # a prompt longer than the window: its first blocks leave it
        freed_ids = [sim.reqs[0]["blocks"][j] if freed == "stale" else None for j in sorted(sim.reqs[0]["gone"])]
        assert len(sim.reqs[0]["gone"]) >= 2
        sim.add(2)
        sim.step({2: b - 2, 0: 1, 1: 1})  # request 2's first block is one request 0 let go
        for _ in range(3):
            sim.step({0: 1, 1: 1, 2: 1})  # request 2 seals it and opens another of request 0's old blocks
        if freed == "stale":
            assert sim.reqs[2]["blocks"][-1] in freed_ids  # request 0's list still names request 2's open block
        tails = sim.table.num_allocated
        sim.end(0)  # request 0 ends: its own tail goes, request 2's stays
        assert sim.table.num_allocated == tails - 1
        sim.step({2: 1, 1: b})  # request 1's first block fills
        sim.add(3, share_from=1, shared_blocks=1)  # a prefix-cache hit on it, still inside the window
        sim.step({1: b + w, 2: 2, 3: 3})  # chunks across the window
        for _ in range(2):
            sim.step({1: 1, 2: 1, 3: 1})
        for rid in list(sim.reqs):
            sim.end(rid)
        assert sim.table.num_allocated == 0
