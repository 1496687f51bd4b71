"""The fused CPU decode kernel against the torch reference on fresh random, poisoned, shuffled caches."""

import warnings

import numpy as np
import pytest
import torch

from kvpack.errors import KVPackError, UnsupportedError
from kvpack.formats import PRESETS, parse_format
from kvpack.kernels import backend_reasons, cpu_decode, decode_attention
from kvpack.kernels import reference as ref
from kvpack.kernels.views import PagedKV
from kvpack.testing import assert_close, cpu_kernel_tolerance, random_paged_kv

pytest.importorskip("numba")


def _tol(kv: PagedKV) -> tuple[float, float]:
    """fp32 queries, fp32 accumulation; wider where the integer path rounds (bounds: tests/test_kernel_cpu.py)."""
    return cpu_kernel_tolerance(kv)


def _run(kv: PagedKV, q: torch.Tensor, window=None):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = decode_attention(q, kv, window=window, backend="cpu", out=out)
    expected = ref.decode_attention(q, kv, None, window, None)
    return got, expected


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("block", [16, 64])
def test_every_preset_matches_reference(name, block):
    fmt = PRESETS[name].with_block_size(block)
    lens = [1, block - 1, block + 1, 3 * block + 5]
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=64, seed=block)
    q = torch.randn(len(lens), 8, 64)
    got, expected = _run(kv, q)
    assert_close(got, expected, *_tol(kv), f"{name} block {block}")


@pytest.mark.parametrize(
    ("name", "group", "head_dim"),
    [("int8", 1, 128), ("int4", 3, 64), ("kivi2", 4, 256), ("fp8-plain", 8, 128), ("k8v4", 4, 128)],
)
def test_gqa_ratios_and_head_dims(name, group, head_dim):
    kv_heads = 2
    fmt = PRESETS[name].with_block_size(32)
    kv, _, _ = random_paged_kv(fmt, [33, 200, 7], kv_heads=kv_heads, head_dim=head_dim, seed=group)
    q = torch.randn(3, kv_heads * group, head_dim)
    got, expected = _run(kv, q)
    assert_close(got, expected, *_tol(kv), f"{name} gqa {group} head_dim {head_dim}")


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2"])
def test_sliding_window_and_left_padding(name):
    fmt = PRESETS[name].with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [5, 70, 130], kv_heads=2, head_dim=64, seed=3)
    q = torch.randn(3, 4, 64)
    got, expected = _run(kv, q, window=40)
    assert_close(got, expected, *_tol(kv), f"{name} window")
    padded = PagedKV(**{**kv.__dict__, "start_pos": torch.tensor([2, 30, 0], dtype=torch.int32)})
    got, expected = _run(padded, q)
    assert_close(got, expected, *_tol(kv), f"{name} start_pos")


def test_long_sequence_split_across_threads_matches():
    # long enough that the kernel splits the history into chunks merged by log-sum-exp
    fmt = PRESETS["int8"]
    kv, _, _ = random_paged_kv(fmt, [4096 + 17], kv_heads=1, head_dim=64, seed=9)
    q = torch.randn(1, 4, 64)
    got, expected = _run(kv, q)
    assert_close(got, expected, *_tol(kv), "split")


def test_custom_formats_and_scale_dtypes():
    for text in ("k=int8:channel:e8m0,v=int8:token:fp32", "k=int4:g32:sym:bf16,v=int4:head:asym:fp32,block=32"):
        fmt = parse_format(text)
        kv, _, _ = random_paged_kv(fmt, [fmt.block_size * 2 + 3, 9], kv_heads=2, head_dim=64, seed=1)
        q = torch.randn(2, 4, 64)
        if backend_reasons("cpu", q, kv):
            continue  # the fallback path is tested below
        got, expected = _run(kv, q)
        assert_close(got, expected, *_tol(kv), text)


def test_bf16_queries_within_bf16_tolerance():
    kv, _, _ = random_paged_kv(PRESETS["int8"], [150, 64], kv_heads=2, head_dim=64, seed=4)
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    out = decode_attention(q, kv, backend="cpu")
    assert out.dtype == torch.bfloat16
    expected = ref.decode_attention(q.float(), kv, None, None, None)
    assert_close(out.float(), expected, 2e-2, 2e-2, "bf16")


def test_bad_shape_is_a_typed_error():
    kv, _, _ = random_paged_kv(PRESETS["int8"], [20], kv_heads=2, head_dim=64)
    with pytest.raises(KVPackError):
        decode_attention(torch.randn(1, 3, 64), kv, backend="cpu")  # 3 query heads over 2 kv heads
    with pytest.raises(KVPackError):
        decode_attention(torch.randn(2, 4, 64), kv, backend="cpu")  # batch 2 for 1 sequence


def test_unsupported_case_falls_back_with_one_warning_naming_why():
    fmt = parse_format("k=int4:channel:asym,v=int8:token,block=16")
    kv, _, _ = random_paged_kv(fmt, [40], kv_heads=1, head_dim=65)  # odd head_dim: int4 rows do not pack evenly
    q = torch.randn(1, 2, 65)
    reasons = backend_reasons("cpu", q, kv)
    assert reasons and all(isinstance(r, str) for r in reasons)
    with pytest.raises(UnsupportedError) as e:
        decode_attention(q, kv, backend="cpu")
    assert e.value.reasons == reasons
    with pytest.warns(RuntimeWarning, match="reference"):
        out = decode_attention(q, kv)
    assert_close(out, ref.decode_attention(q, kv, None, None, None), 1e-6, 1e-6, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reasons do not warn twice
        decode_attention(q, kv)


def test_fp16_scale_decoding_is_exact_for_every_half():
    """Stored fp16 scales and zero-points are decoded by the hardware conversion where the CPU has one and
    by the branch-free bit decoder otherwise: both must give torch's float32 for all 65536 bit patterns
    (normals, subnormals, signed zeros, infinities, NaNs)."""
    import numpy as np
    from numba import njit

    nb = cpu_decode._nb()

    @njit
    def decode_both(bits, hw, sw):
        for i in range(bits.shape[0]):
            hw[i] = nb._half_hw(bits[i]) if nb._HW_HALF else nb._half(bits[i])
            sw[i] = nb._half(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint16)
    hw, sw = np.empty(1 << 16, np.float32), np.empty(1 << 16, np.float32)
    decode_both(bits, hw, sw)
    arrs = (np.zeros(1, np.uint8), bits, np.zeros(1, np.float32))
    scales = np.empty(1 << 16, np.float32)
    njit(lambda a, o: nb._scales(a, nb.SC_F16, 0, 1 << 16, o))(arrs, scales)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.float16).float().numpy()
    for got in (hw, sw, scales):
        assert np.array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
        assert np.isnan(got[np.isnan(want)]).all()


def test_output_rounding_to_16_bits_is_torchs_for_every_float_kind():
    """The merge writes a bfloat16 or fp16 model's output itself: round to nearest even as torch does, for normals,
    halfway cases, subnormals, overflow to infinity, signed zeros, infinities and NaNs."""
    from numba import njit

    nb = cpu_decode._nb()

    @njit
    def both(x, bf, hf):
        for i in range(x.shape[0]):
            bf[i] = nb.to_bf16_bits(x[i])
            hf[i] = nb.to_half_bits(x[i])

    g = np.random.default_rng(0)
    bits = [g.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)]
    halves = np.arange(1 << 16, dtype=np.uint32)  # around every half and bfloat16: exact, halfway, either side
    for base in (torch.from_numpy(halves.astype(np.uint16).view(np.int16)).view(torch.float16).float().numpy(),
                 (halves << 16).view(np.float32)):  # fmt: skip
        b = base.view(np.uint32)
        bits += [b, b + 1, b - 1, b + 0x1000, b + 0x0FFF, b + 0x1001, b + 0x8000, b + 0x7FFF]
    x = np.concatenate(bits).view(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-25,
                                     3 * 2.0**-26, 2.0**-24, 6e-5], np.float32)])  # fmt: skip
    bf, hf = np.empty(x.size, np.int64), np.empty(x.size, np.int64)
    both(x, bf, hf)
    t = torch.from_numpy(x)
    for got, dtype in ((bf, torch.bfloat16), (hf, torch.float16)):
        want = t.to(dtype).view(torch.int16).numpy().view(np.uint16).astype(np.int64)
        nan = np.isnan(x)
        assert np.array_equal(got[~nan], want[~nan]), dtype
        back = torch.from_numpy(got[nan].astype(np.uint16).view(np.int16)).view(dtype)
        assert torch.isnan(back).all()  # NaN stays NaN (its payload is not kept: torch's is not either)


def _items(costs: list[int]) -> np.ndarray:
    """Work items ``[n, 5]`` (b, h, j0, j1, tail) whose block counts are ``costs``."""
    return np.array([(0, i, 0, c, 0) for i, c in enumerate(costs)], dtype=np.int64)


def _taker():
    """A compiled stand-in for the kernel's ``work``: thread ``t`` takes items until none is left, recording
    who took each, and spins ``spin[t]`` iterations per item (a core busy elsewhere)."""
    from numba import njit

    take = cpu_decode._nb().take_item

    @njit(nogil=True)
    def taker(t, runs, items, who, spin):
        it = take(runs, t)
        while it >= 0:
            acc = 0.0
            for i in range(spin[t]):
                acc += np.sqrt(i + 1.0)
            who[it] = t + 1 + (0 if acc >= 0 else 100)
            it = take(runs, t)

    return taker


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("n", [2, 7, 40])
def test_threads_run_every_work_item_exactly_once(threads: int, n: int) -> None:
    items = _items([40 + 7 * (i % 3) for i in range(n)])
    taker = _taker()
    for _ in range(20):  # races, if any, show up over repeats
        who = np.zeros(n, np.int64)
        cpu_decode.run_items(taker, items, threads, (who, np.zeros(threads, np.int64)))
        assert ((who >= 1) & (who <= threads)).all()  # every item taken, by a real thread
    runs = cpu_decode.thread_runs(items, threads)
    bounds = [(int(r) & 0xFFFFFFFF, int(r) >> 32) for r in runs]
    assert bounds[0][0] == 0 and bounds[-1][1] == n  # contiguous runs cover all items once
    assert all(bounds[t][1] == bounds[t + 1][0] for t in range(threads - 1))


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_launch_plan_cuts_the_same_runs_as_the_launcher(threads: int) -> None:
    nb = cpu_decode._nb()
    seq_lens = np.array([3000, 17, 900, 64], np.int32)
    tables = np.arange(1, 4 * 60 + 1, dtype=np.int32).reshape(4, 60)
    start = np.array([0, 0, 100, 0], np.int32)
    err, items, first, runs, kstart, sink_len, lo, pm, pl, pacc = nb.prepare_launch(
        seq_lens, tables, start, 700, 64, 2, 1000, 1, 8 * threads, 8, threads, 1, 4, 64
    )
    assert err == 0
    want_items, want_first = cpu_decode.work_items(seq_lens, kstart, 700, 64, 2, threads)
    assert np.array_equal(items, want_items) and np.array_equal(first, want_first)
    assert np.array_equal(runs, cpu_decode.thread_runs(items, min(threads, len(items))))
    assert kstart.tolist() == [1, 0, 100, 1] and sink_len.tolist() == [1, 0, 1, 1]  # sink rows (sealed ones) apart
    assert lo.tolist() == [2300, 0, 200, 0]  # window 700 and start_pos
    assert pm.shape == pl.shape == (len(items), 4) and pacc.shape == (len(items), 4, 64)


def test_each_thread_walks_its_own_run_upwards_then_takes_from_the_longest_run() -> None:
    nb = cpu_decode._nb()
    runs = np.array([nb.pack_run(0, 3), nb.pack_run(3, 6), nb.pack_run(6, 10)], np.int64)
    take = nb.take_item
    assert [take(runs, 0) for _ in range(3)] == [0, 1, 2]
    assert take(runs, 0) == 9  # its own run is done: the last item of the longest run (thread 2's)
    assert [take(runs, 2) for _ in range(3)] == [6, 7, 8]
    assert take(runs, 2) == 5  # and thread 2 then helps thread 1 from the end
    assert [take(runs, 1) for _ in range(3)] == [3, 4, -1]
    assert take(runs, 0) == -1


def test_an_idle_thread_takes_the_items_of_a_busy_one() -> None:
    items = _items([100] * 32)
    who = np.zeros(32, np.int64)
    spin = np.array([2_000_000, 0], np.int64)  # the calling thread's core is busy elsewhere
    cpu_decode.run_items(_taker(), items, 2, (who, spin))
    assert (who > 0).all()
    assert (who == 1).sum() < 16 // 2  # its own run was half the items; the other thread took most of it


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fine_work_items_continue_or_merge_exactly(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Histories cut into many items: a thread that takes the next item of the same kv head carries its
    softmax state on (the finished item's partial is left empty), items taken by other threads merge."""
    monkeypatch.setattr(cpu_decode, "MIN_CHUNK_TOKENS", 16)
    monkeypatch.setattr(cpu_decode, "_ITEMS_PER_THREAD", 64)
    monkeypatch.setattr(cpu_decode, "_SERIAL_BLOCKS", 1)
    fmt = PRESETS["int8"].with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [1000, 37, 611, 16 * 20], kv_heads=2, head_dim=64, seed=5)
    q = torch.randn(4, 4, 64)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 300):
            got, expected = _run(kv, q, window=window)
            assert_close(got, expected, *_tol(kv), f"threads {threads} window {window}")
    finally:
        torch.set_num_threads(old)
    seq_lens = kv.seq_lens.numpy()
    items, _ = cpu_decode.work_items(seq_lens, np.zeros(4, np.int32), -1, 16, 2, threads)
    assert len(items) > 4 * 2 * 4  # several items per kv head: continuation is exercised


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2"])
def test_prefetch_distance_changes_nothing_but_timing(name: str) -> None:
    """The far prefetch distance (a spec's P_FAR) only moves prefetches: every distance, none included, gives
    bit-identical outputs, also where the distance runs past a sequence's last block. One thread, so the
    partials merge in the same order every call."""
    nbm = cpu_decode._nb()
    kv, _, _ = random_paged_kv(PRESETS[name].with_block_size(16), [300, 17, 16 * 9], kv_heads=2, head_dim=128, seed=9)
    q = torch.randn(3, 8, 128)
    state = cpu_decode._prepare(kv)
    outs = []
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for far in (cpu_decode.FAR_BLOCKS, 0, 1, 5, 40):
            state.kp[nbm.P_FAR] = state.vp[nbm.P_FAR] = far
            outs.append(decode_attention(q, kv, backend="cpu", out=torch.full_like(q, float("nan"))))
    finally:
        state.kp[nbm.P_FAR] = state.vp[nbm.P_FAR] = cpu_decode.FAR_BLOCKS
        torch.set_num_threads(old)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert_close(outs[0], ref.decode_attention(q, kv, None, None, None), *_tol(kv), name)


@pytest.mark.parametrize(
    ("name", "block", "group", "head_dim"),
    [("int8", 16, 4, 128), ("fp8-plain", 16, 8, 64), ("int4", 32, 3, 64), ("k8v4", 16, 1, 256), ("kivi2", 32, 4, 128),
     ("int4-o4", 16, 4, 64), ("k=int4:channel:asym:o5r,v=int4:g32:asym,sink=1", 32, 3, 128)],
)  # fmt: skip
def test_runs_of_blocks_match_one_block_at_a_time(
    monkeypatch: pytest.MonkeyPatch, name: str, block: int, group: int, head_dim: int
) -> None:
    """Runs of blocks attended with one softmax step (``cpu_decode_numba._attend_multi``) give the one-block path's
    results up to rounding, since each block keeps its own int16 weight bound: float rounding for int8 and 2-bit,
    and for asymmetric int4 keys with int4 group values a few int16 weight roundings that float32 association
    flips (the two paths compute ``p`` as ``s + (kc - m)`` and ``(s + kc) - m``): 7.7e-5 at most on an AVX-512
    VNNI CPU under numba 0.65 and 0.68, both paths 3.7e-4 from a float64 oracle. The lengths leave full
    runs, short last runs and single blocks; a window that starts inside a block, left padding and the presets'
    sink row start runs with their first rows masked (whose per-token value scales, k8v4's, must not bound the
    run's int16 weights: they did, 1.3e-4 off); small work items on two threads cut runs at item
    boundaries; padded heads (group 3, 1) and head_dim 64-256 change the scratch shapes."""
    monkeypatch.setattr(cpu_decode, "MIN_CHUNK_TOKENS", 4 * block)
    monkeypatch.setattr(cpu_decode, "_SERIAL_BLOCKS", 1)
    nbm = cpu_decode._nb()
    lens = [block * 21 + 5, 3 * block, block + 1, 1]
    fmt = parse_format(name).with_block_size(block)  # with outlier channels: each block's terms, then its max
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=head_dim, seed=11)
    q = torch.randn(len(lens), 2 * group, head_dim)
    state = cpu_decode._prepare(kv)
    runs = int(state.kp[nbm.P_MULTI])
    assert runs == cpu_decode.MULTI_TOKENS // block == cpu_decode.blocks_per_run(kv)  # the case takes runs
    padded = PagedKV(**{**kv.__dict__, "start_pos": torch.tensor([block + 3, 0, 2, 0], dtype=torch.int32)})
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for view, window in ((kv, None), (kv, 5 * block + 3), (padded, None)):
            pstate = cpu_decode._prepare(view)
            outs = []
            for m in (runs, 3, 1):
                pstate.kp[nbm.P_MULTI] = m
                outs.append(
                    decode_attention(q, view, window=window, backend="cpu", out=torch.full_like(q, float("nan")))
                )
            pstate.kp[nbm.P_MULTI] = runs
            tol = (2e-4, 1e-3) if "int4" in name else (2e-5, 1e-4)
            for o in outs[:2]:
                assert_close(o, outs[2], *tol, f"{name} window {window}: runs against one block at a time")
            assert_close(
                outs[0], ref.decode_attention(q, view, None, window, None), *_tol(kv), f"{name} window {window}"
            )
    finally:
        torch.set_num_threads(old)


def test_one_thread_leaves_one_partial_per_kv_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_decode, "MIN_CHUNK_TOKENS", 16)
    nb = cpu_decode._nb()
    seen = {}

    def spy(threads, serial, target, min_chunk, seq_lens, tables, start, window, bs, kv_heads, num_blocks, sink, q,
            *rest):  # fmt: skip
        """launch_one's three steps from Python, keeping the partials the merge gets."""
        err, items, first, runs, kstart, sink_len, lo, pm, pl, pacc = nb.prepare_launch(
            seq_lens, tables, start, window, bs, kv_heads, num_blocks, sink, target, min_chunk, 1, serial,
            q.shape[1] // kv_heads, q.shape[2])  # fmt: skip
        pools, (cuts, qscale, kout, kidx), out = rest[:12], rest[12:16], rest[16:]
        nb._run_thread(np.int64(0), runs, items, q, *pools, tables, seq_lens, kstart, cuts, window, qscale, kv_heads,
                       bs, pm, pl, pacc, kout, kidx)  # fmt: skip
        seen["first"], seen["pm"] = first.copy(), pm.copy()
        nb.merge(first, kv_heads, pm, pl, pacc, q, *out[:5], sink_len, lo, qscale, *out[5:])
        return err

    monkeypatch.setattr(nb, "launch_one", spy)
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [900], kv_heads=1, head_dim=64, seed=6)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(cpu_decode, "_ITEMS_PER_THREAD", 16)
        _run(kv, torch.randn(1, 2, 64))
    finally:
        torch.set_num_threads(old)
    pm = seen["pm"]
    assert len(pm) > 4  # the history was cut into items
    assert np.isneginf(pm[:-1]).all() and np.isfinite(pm[-1]).all()  # one thread ran them as one pass


# ----------------------------------------------------------------------------------------------------
# Per-view state: checked once, contents read live


def test_a_cached_view_follows_the_cache_as_it_grows() -> None:
    """The cache hands out the same view object step after step; the kernel's per-view state (spec vectors,
    numpy views of pools, tails, tables and lengths) must see every step's new contents."""
    from kvpack.cache import PagedKVCache

    cache = PagedKVCache("int8,block=16", num_layers=1, kv_heads=2, head_dim=64, num_blocks=64)
    sids = [cache.add_sequence(), cache.add_sequence()]
    gen = torch.Generator().manual_seed(3)
    cache.append(0, sids, torch.randn(2, 2, 21, 64, generator=gen), torch.randn(2, 2, 21, 64, generator=gen))
    first = cache.view(0, sids)
    for step in range(40):  # crosses seals (the tail turns into a block) and new block-table entries
        cache.append(0, sids, torch.randn(2, 2, 1, 64, generator=gen), torch.randn(2, 2, 1, 64, generator=gen))
        kv = cache.view(0, sids)
        q = torch.randn(2, 4, 64, generator=gen)
        got, expected = _run(kv, q)
        assert_close(got, expected, *_tol(kv), f"step {step}")
    assert kv is first  # one view object all along: the state was made once and read live


def test_view_state_follows_the_integer_path_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [70, 33], kv_heads=2, head_dim=64, seed=8)
    q = torch.randn(2, 4, 64)
    for forced in (False, True, False):
        monkeypatch.setattr(cpu_decode, "INT_DOT", forced)
        got, expected = _run(kv, q)
        assert_close(got, expected, *_tol(kv), f"INT_DOT={forced}")
        assert (cpu_decode._entry(kv).kp[cpu_decode._nb().P_DOT] > 0) == (
            forced and cpu_decode.int_dot_isa() is not None
        )


def test_a_bad_view_is_refused_on_every_call_and_its_state_goes_with_it() -> None:
    import dataclasses
    import gc

    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [40], kv_heads=2, head_dim=64, seed=1)
    bad = dataclasses.replace(kv, tail_v=kv.tail_v[:, :, :8])  # a tail of the wrong length
    q = torch.randn(1, 4, 64)
    for _ in range(2):  # a failed check leaves nothing that lets the next call through
        with pytest.raises(KVPackError, match="tails must be"):
            cpu_decode.decode_attention(q, bad)
    gc.collect()  # views of earlier tests that are garbage already leave the count now, not below
    before = len(cpu_decode._states)
    probe = dataclasses.replace(kv)
    cpu_decode.decode_attention(q, probe)
    assert len(cpu_decode._states) == before + 1
    del probe
    gc.collect()
    assert len(cpu_decode._states) == before  # dropped with its view: no pools kept alive


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_query_as_float32_is_torchs_widening_for_strided_views(dtype: torch.dtype) -> None:
    """The kernel's query comes from numpy (no torch call after a kernel pass): bit for bit torch's widening, for a
    view strided as vLLM hands it over (the query heads of a fused qkv row), specials included."""
    qkv = (torch.randn(5, 3 * 64) * 300).to(dtype)
    qkv[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-42, -3e-39]).to(dtype)
    q = qkv[:, :128].view(5, 2, 64)  # row stride 192: not contiguous
    assert not q.is_contiguous()
    got = cpu_decode.query_f32(q)
    want = q.float().contiguous().numpy()
    assert got.flags.c_contiguous and got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bits: signed zeros and NaNs too
    dense = q.contiguous()
    if dtype is torch.float32:  # a contiguous float32 query is read in place
        assert np.shares_memory(cpu_decode.query_f32(dense), dense.numpy())


def test_non_contiguous_tensors_are_read_afresh_every_call() -> None:
    import dataclasses

    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [50, 23], kv_heads=2, head_dim=64, seed=4)
    wide = torch.randn(2, 2, 16, 128)
    wide[..., :64] = kv.tail_k
    strided = dataclasses.replace(kv, tail_k=wide[..., :64])  # a view with row stride 128: not contiguous
    assert not strided.tail_k.is_contiguous()
    q = torch.randn(2, 4, 64)
    got, expected = _run(strided, q)
    assert_close(got, expected, *_tol(kv), "strided tail")
    strided.tail_k.mul_(-1.0)  # new contents in place: the next call must read them
    got2, expected2 = _run(strided, q)
    assert not torch.allclose(expected, expected2)
    assert_close(got2, expected2, *_tol(kv), "strided tail, changed")


_NESTING_CHILD = """
import ctypes, torch
torch.set_num_threads(2)
rt = ctypes.CDLL(None)
before = rt.omp_get_nested()
from kvpack.kernels import cpu_decode, decode_attention
from kvpack.formats import PRESETS
from kvpack.testing import random_paged_kv
kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [70, 41, 90], kv_heads=2, head_dim=64, seed=1)
decode_attention(torch.randn(3, 4, 64), kv)  # numba's pool started, a parallel launch run
import numba
print(before, rt.omp_get_nested(), numba.threading_layer(), torch.get_num_threads())
"""


def test_numbas_thread_pool_leaves_torchs_openmp_settings_as_they_were() -> None:
    """numba's omp layer shares torch's OpenMP runtime and turns nested parallelism on when its pool starts; left on,
    torch's parallel operations open a team in each thread (a causal SDPA over 2k tokens 6x slower on 2 threads).
    In a fresh process (the pool starts once per process): the setting and torch's thread count are as before."""
    import ctypes
    import subprocess
    import sys

    try:
        ctypes.CDLL(None).omp_get_nested  # noqa: B018
    except AttributeError:
        pytest.skip("no OpenMP runtime in the process's global symbols (torch built with another one)")
    res = subprocess.run([sys.executable, "-c", _NESTING_CHILD], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    before, after, layer, threads = res.stdout.split()
    assert after == before == "0", (before, after, layer)
    assert threads == "2"


def _first_rows(kv: PagedKV, r: int) -> PagedKV:
    """The view of ``kv``'s first ``r`` sequences over the same pools (as vLLM's layer makes one per batch size)."""
    import dataclasses

    rows = {f: getattr(kv, f)[:r] for f in ("block_tables", "seq_lens", "tail_k", "tail_v", "sink_k", "sink_v")
            if getattr(kv, f) is not None}  # fmt: skip
    return dataclasses.replace(kv, **rows)


@pytest.mark.parametrize("name", ["int4", "int8", "fp8-plain", "k4v2"])
def test_views_of_one_pool_share_its_spec_vectors_and_decode_alike(name: str) -> None:
    """A serving engine makes a view for each number of running requests over one layer's pools: the first view
    makes the spec vectors and the pools' numpy views, the others reuse those objects, and each decodes like the
    reference; a view over other pools makes its own."""
    import dataclasses

    kv, _, _ = random_paged_kv(PRESETS[name].with_block_size(16), [50, 23, 70], kv_heads=2, head_dim=64, seed=5)
    views = [kv, _first_rows(kv, 2), _first_rows(kv, 1)]
    for v in views:
        q = torch.randn(v.batch, 4, 64)
        got, expected = _run(v, q)
        assert_close(got, expected, *_tol(v), f"{name} batch {v.batch}")
    states = [cpu_decode._entry(v) for v in views]
    assert states[0].pools is not None and all(s.pools is states[0].pools for s in states)
    assert states[1].kp is states[0].kp and states[1].k_data is states[0].k_data
    other = dataclasses.replace(kv, k_data=kv.k_data.clone())  # the same layout over other memory
    got, expected = _run(other, torch.randn(3, 4, 64))
    assert cpu_decode._entry(other).pools is not states[0].pools


def test_the_short_path_with_an_output_buffer_computes_what_the_general_path_does() -> None:
    """A float32 query into a float32 buffer over a view read in place takes the launch with the view's arguments
    kept (fewer torch calls): bit for bit the same output as without the buffer (one thread: two threads may merge
    partials in another order), and the same errors for a query or buffer of the wrong shape."""
    kv, _, _ = random_paged_kv(PRESETS["int4"].with_block_size(16), [50, 23, 70], kv_heads=2, head_dim=64, seed=6)
    qkv = torch.randn(3, 6 * 64)
    q = qkv[:, : 4 * 64].view(3, 4, 64)  # strided, as vLLM hands the query over
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        general = cpu_decode.decode_attention(q, kv)
        fast = cpu_decode._entry(kv).fast
        assert fast is not None and fast.entry == [None, None]
        outs = []
        for _ in range(2):  # the first through numba's dispatcher, the second through the wrapper it found
            outs.append(torch.full_like(general, float("nan")))
            assert cpu_decode.decode_attention(q, kv, out=outs[-1]) is outs[-1]
            assert fast.entry[1] is None and fast.entry[0] not in (None, cpu_decode._nb().launch_one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], general) and torch.equal(outs[1], general)
    out = outs[0]
    with pytest.raises(KVPackError, match="out must be"):
        cpu_decode.decode_attention(q, kv, out=torch.empty(3, 8, 64))
    with pytest.raises(KVPackError, match="out must be"):
        cpu_decode.decode_attention(q, kv, out=torch.empty(3, 4, 64, dtype=torch.float16))
    with pytest.raises(KVPackError, match="q must be"):
        cpu_decode.decode_attention(q[:2], kv, out=out[:2])
    bad = kv.seq_lens.clone()
    bad[1] = 0
    empty = _first_rows(kv, 3)
    empty.seq_lens.copy_(bad)  # the lengths are the caller's: contents are checked on every call
    with pytest.raises(KVPackError, match="at least one token"):
        cpu_decode.decode_attention(q, empty, out=out)
