"""PagedKVCache write path: sealing equals the quant primitives, chunking invariance, the step rule,
views, and the bad-input errors (each leaving the cache exactly as it was)."""

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import (
    ConfigError,
    FormatError,
    NonFiniteError,
    PoolExhaustedError,
    SequenceError,
    ShapeError,
    UnsupportedError,
)
from kvpack.formats import parse_format
from kvpack.quant import quantize
from kvpack.testing import assert_bitexact

H, D = 2, 32


def snapshot(cache):
    """Everything observable, cloned: pools, tails, tables, lengths, pool counts."""
    state = {name: t.clone() for name, t in cache.storage.pools().items()}
    state["tail_k"], state["tail_v"] = cache.slots.tail_k.clone(), cache.slots.tail_v.clone()
    state["tables"], state["lens"] = cache.slots.tables.clone(), cache.slots.lens.clone()
    state["refs"] = torch.tensor(cache.pool.ref_counts())
    state["counts"] = torch.tensor([cache.pool.num_free, cache.pool.num_cached])
    state["blocks"] = {s: list(cache.slots.seqs[s].blocks) for s in cache.seq_ids}
    return state


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert_bitexact(a[key], b[key], key)
        else:
            assert a[key] == b[key], key


def sealed(cache, layer, sid):
    """The stored quantized blocks of one sequence: dict of pool name -> [n_sealed, ...]."""
    kv = cache.view(layer, [sid])
    n = int(kv.seq_lens[0]) // cache.block_size
    ids = kv.block_tables[0, :n].long()
    return {name: t[layer][ids] for name, t in cache.storage.pools().items()}


def expected(fmt, x, tail_dtype):
    """quant.quantize of each full block of ``x`` [H, n, D] after the cast to the tail dtype."""
    b = fmt.block_size
    nb = x.shape[1] // b
    blocks = x[:, : nb * b].to(tail_dtype).reshape(x.shape[0], nb, b, x.shape[2]).transpose(0, 1)
    out = {}
    for prefix, spec in (("k", fmt.key), ("v", fmt.value)):
        qt = quantize(blocks, spec)
        out[f"{prefix}_data"] = qt.data
        if qt.scale is not None:
            out[f"{prefix}_scale"] = qt.scale
        if qt.zero is not None:
            out[f"{prefix}_zero"] = qt.zero
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8-plain", "kivi2", "fp16", "k=int4:g8:sym:e8m0,v=fp8_e5m2:token"])
@pytest.mark.parametrize("tail_dtype", [torch.float32, torch.float16])
def test_prefill_then_decode_stores_what_quantize_gives(fmt, tail_dtype):
    fmt = parse_format(fmt).with_block_size(16)
    lens = [1, 15, 17, 49]  # odd lengths around the block size, different per row
    cache = PagedKVCache(fmt, 2, H, D, 40, tail_dtype=tail_dtype)
    sids = [cache.add_sequence() for _ in lens]
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(H, n + 20, D, generator=g) * 3 for n in lens]
    # prefill: one append per length group (same T within a call), then 20 decode steps for all rows
    for sid, n, x in zip(sids, lens, full):
        for layer in range(2):
            cache.append(layer, [sid], x[None, :, :n], -x[None, :, :n])
    for step in range(20):
        k = torch.stack([x[:, n + step : n + step + 1] for n, x in zip(lens, full)])
        for layer in range(2):
            cache.append(layer, sids, k, -k)
    for sid, n, x in zip(sids, lens, full):
        total = n + 20
        assert cache.seq_len(sid) == cache.seq_len(sid, 1) == total
        for layer in range(2):
            got = sealed(cache, layer, sid)
            want_k = expected(fmt, x, tail_dtype)
            want_v = expected(fmt, -x, tail_dtype)
            for name in got:
                want = (want_k if name.startswith("k") else want_v)[name]
                assert_bitexact(got[name], want, f"{name} seq {sid} layer {layer}")
            kv = cache.view(layer, [sid])
            r = total % 16
            assert_bitexact(kv.tail_k[0, :, :r], x[:, total - r :].to(tail_dtype))
            assert_bitexact(kv.tail_v[0, :, :r], (-x[:, total - r :]).to(tail_dtype))
    assert cache.problems() == []


def test_chunking_does_not_change_the_stored_bytes():
    fmt = parse_format("int4").with_block_size(8)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, H, 53, D, generator=g)
    results = []
    for chunks in ([53], [1] * 53, [5, 11, 3, 8, 16, 10], [8, 8, 37]):
        cache = PagedKVCache(fmt, 1, H, D, 16)
        sid = cache.add_sequence()
        pos = 0
        for c in chunks:
            cache.append(0, [sid], x[:, :, pos : pos + c], x[:, :, pos : pos + c] * 2)
            pos += c
        kv = cache.view(0, [sid])
        results.append((sealed(cache, 0, sid), kv.tail_k[0, :, : 53 % 8].clone()))
    for got, tail in results[1:]:
        for name in got:
            assert_bitexact(got[name], results[0][0][name], name)
        assert_bitexact(tail, results[0][1])


def test_prefill_seals_all_blocks_in_one_quantize_call(monkeypatch):
    import kvpack.cache.write as write

    calls = []
    real = write.quantize

    def counting(x, spec, *a, **kw):
        calls.append(tuple(x.shape))
        return real(x, spec, *a, **kw)

    monkeypatch.setattr(write, "quantize", counting)
    cache = PagedKVCache(parse_format("int8").with_block_size(16), 1, H, D, 40)
    sids = [cache.add_sequence() for _ in range(3)]
    cache.append(0, sids, torch.randn(3, H, 100, D), torch.randn(3, H, 100, D))
    assert calls == [(18, H, 16, D), (18, H, 16, D)]  # 3 rows x 6 blocks, keys then values
    calls.clear()
    cache.append(0, sids, torch.randn(3, H, 1, D), torch.randn(3, H, 1, D))
    assert calls == []  # 101 tokens: no tail is full yet


def test_step_rule_layer_zero_leads():
    cache = PagedKVCache("int8", 3, H, D, 8)
    sid = cache.add_sequence()
    x = torch.randn(1, H, 2, D)
    cache.append(0, [sid], x, x)
    with pytest.raises(SequenceError, match="layer 0 of sequence 0 starts a new step at 2 tokens but layer 1 holds 0"):
        cache.append(0, [sid], x, x)
    cache.append(2, [sid], x, x)  # the other layers may follow in any order
    with pytest.raises(SequenceError, match="past layer 0's 2"):
        cache.append(2, [sid], x[:, :, :1], x[:, :, :1])
    cache.append(1, [sid], x[:, :, :1], x[:, :, :1])  # or in pieces
    cache.append(1, [sid], x[:, :, 1:], x[:, :, 1:])
    cache.append(0, [sid], x, x)
    assert [cache.seq_len(sid, layer) for layer in range(3)] == [4, 2, 2]


def test_first_layer_to_seal_allocates_the_others_reuse():
    cache = PagedKVCache(parse_format("int8").with_block_size(4), 3, H, D, 8)
    sid = cache.add_sequence()
    x = torch.randn(1, H, 9, D)
    cache.append(0, [sid], x, x)
    assert cache.pool.num_used == 2
    cache.append(1, [sid], x, x)
    cache.append(2, [sid], x, x)
    assert cache.pool.num_used == 2
    ids = cache.view(0, [sid]).block_tables[0, :2]
    for layer in (1, 2):
        assert torch.equal(cache.view(layer, [sid]).block_tables[0, :2], ids)
        for name in ("k_data", "k_scale", "v_data", "v_scale"):
            assert_bitexact(
                getattr(cache.storage, name)[layer][ids.long()], getattr(cache.storage, name)[0][ids.long()]
            )


def test_views_are_slices_for_consecutive_slots_and_copies_otherwise():
    cache = PagedKVCache("int8", 2, H, D, 8, max_seqs=4)
    a, b, c = (cache.add_sequence() for _ in range(3))
    x = torch.arange(3.0).view(3, 1, 1, 1).expand(3, H, 5, D).contiguous()
    for layer in range(2):
        cache.append(layer, [a, b, c], x, x)
    kv = cache.view(1, [a, b, c])
    assert kv.tail_k.data_ptr() == cache.slots.tail_k[1].data_ptr()  # no copy
    assert cache.view(1, [a, b, c]) is kv  # cached
    assert kv.block_tables.dtype == torch.int32 and kv.seq_lens.dtype == torch.int32
    assert kv.seq_lens.tolist() == [5, 5, 5]
    y = torch.full((3, H, 1, D), 7.0)
    for layer in range(2):
        cache.append(layer, [a, b, c], y, y)
    assert kv.seq_lens.tolist() == [6, 6, 6] and float(kv.tail_k[2, 0, 5, 0]) == 7.0  # live on the CPU
    rev = cache.view(1, [c, a])
    assert rev.tail_k.data_ptr() != cache.slots.tail_k[1].data_ptr()
    assert rev.tail_k[:, 0, 0, 0].tolist() == [2.0, 0.0]  # rows in seq_ids order
    assert rev.seq_lens.tolist() == [6, 6]


def test_tail_slots_grow_beyond_max_seqs():
    cache = PagedKVCache("int8", 1, H, D, 40, max_seqs=2)
    x = torch.randn(5, H, 70, D)
    sids = [cache.add_sequence() for _ in range(5)]
    cache.append(0, sids, x, x)
    for i, sid in enumerate(sids):
        k, _ = cache.dense(0, sid)
        assert_bitexact(k[:, 64:], x[i, :, 64:])
    assert cache.problems() == []


# -- bad input ----------------------------------------------------------------------------------------


@pytest.fixture
def busy_cache():
    cache = PagedKVCache(parse_format("int8").with_block_size(8), 2, H, D, 6)
    sids = [cache.add_sequence() for _ in range(2)]
    x = torch.randn(2, H, 13, D)
    for layer in range(2):
        cache.append(layer, sids, x, x)
    return cache, sids


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        (
            (2, H + 1, 1, D),
            torch.float32,
            r"k must have shape \[batch=2, kv_heads=2, T>=1, head_dim=32\], got \(2, 3, 1, 32\)",
        ),
        ((2, H, 1, D - 1), torch.float32, r"head_dim=32\], got \(2, 2, 1, 31\)"),
        ((1, H, 1, D), torch.float32, r"batch=2"),
        ((2, H, 0, D), torch.float32, "no token"),
        ((2, H, D), torch.float32, "must have shape"),
        ((2, H, 1, D), torch.int32, "floating-point"),
    ],
)
def test_bad_shapes_and_dtypes_name_the_expected_shape(busy_cache, shape, dtype, match):
    cache, sids = busy_cache
    before = snapshot(cache)
    bad = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ShapeError, match=match):
        cache.append(0, sids, bad, bad)
    assert_same(before, snapshot(cache))


def test_other_bad_appends(busy_cache):
    cache, sids = busy_cache
    before = snapshot(cache)
    x = torch.randn(2, H, 1, D)
    with pytest.raises(ShapeError, match="same shape"):
        cache.append(0, sids, x, x[:, :, :, :].repeat(1, 1, 2, 1))
    with pytest.raises(ShapeError, match="layer must be"):
        cache.append(2, sids, x, x)
    with pytest.raises(SequenceError, match="unknown sequence id 9"):
        cache.append(0, [sids[0], 9], x, x)
    with pytest.raises(SequenceError, match="twice"):
        cache.append(0, [sids[0], sids[0]], x, x)
    with pytest.raises(ShapeError, match="empty"):
        cache.append(0, [], x[:0], x[:0])
    meta = torch.empty(2, H, 1, D, device="meta")
    with pytest.raises(ShapeError, match="cache lives on cpu"):
        cache.append(0, sids, meta, meta)
    assert_same(before, snapshot(cache))


@pytest.mark.parametrize("what", ["key", "value"])
def test_non_finite_at_seal_names_layer_head_position(busy_cache, what):
    cache, sids = busy_cache  # 13 tokens: 1 sealed block, 5 in the tail
    k = torch.randn(2, H, 4, D)
    v = torch.randn(2, H, 4, D)
    (k if what == "key" else v)[1, 1, 1, 7] = float("nan")  # sequence 1, head 1, position 13 + 1
    cache.append(0, sids, k.clone().nan_to_num(), v.clone().nan_to_num())
    before = snapshot(cache)
    with pytest.raises(NonFiniteError, match=f"non-finite {what} at layer 1, sequence 1, head 1, position 14") as e:
        cache.append(1, sids, k, v)
    assert e.value.where[0] == {"layer": 1, "sequence": 1, "head": 1, "position": 14}
    assert_same(before, snapshot(cache))
    cache.append(1, sids, k.nan_to_num(), v.nan_to_num())  # the corrected step goes through
    assert cache.seq_len(1, 1) == 17


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_refused_at_append_and_the_tail_stays_as_it_was(bad):
    cache = PagedKVCache(parse_format("int4").with_block_size(8), 1, H, D, 4)
    sid = cache.add_sequence()
    cache.append(0, [sid], torch.randn(1, H, 2, D), torch.randn(1, H, 2, D))
    before = snapshot(cache)
    x = torch.randn(1, H, 3, D)
    x[0, 0, 2, 0] = bad
    with pytest.raises(NonFiniteError, match="non-finite key at layer 0, sequence 0, head 0, position 4") as e:
        cache.append(0, [sid], x, torch.randn(1, H, 3, D))  # stays in the tail: still refused
    assert e.value.where[0] == {"layer": 0, "sequence": sid, "head": 0, "position": 4}
    assert_same(before, snapshot(cache))
    assert cache.seq_len(sid) == 2


def test_a_finite_value_that_overflows_the_tail_dtype_is_refused_as_an_overflow():
    cache = PagedKVCache(parse_format("int8").with_block_size(8), 1, H, D, 4, tail_dtype=torch.float16)
    sid = cache.add_sequence()
    before = snapshot(cache)
    v = torch.randn(1, H, 1, D)
    v[0, 1, 0, 3] = 1e6  # finite in float32, inf in float16
    with pytest.raises(NonFiniteError, match="value at layer 0, sequence 0, head 1, position 0 overflows") as e:
        cache.append(0, [sid], torch.randn(1, H, 1, D), v)
    assert "tail_dtype" in str(e.value) and "produced NaN" not in str(e.value)
    assert_same(before, snapshot(cache))
    cache.append(0, [sid], torch.randn(1, H, 1, D), v.clamp(-6e4, 6e4))  # in range: stored
    assert cache.seq_len(sid) == 1


def test_pool_exhausted_before_anything_changes(busy_cache):
    cache, sids = busy_cache  # 2 blocks used of 5
    before = snapshot(cache)
    x = torch.randn(2, H, 16, D)  # needs 2 x 2 more blocks
    with pytest.raises(PoolExhaustedError, match="seals 4 new block"):
        cache.append(0, sids, x, x)
    assert_same(before, snapshot(cache))
    cache.append(0, sids, x[:, :, :8], x[:, :, :8])  # 2 blocks: fits
    assert cache.pool.num_available == 1


def test_bad_construction():
    with pytest.raises(FormatError):
        PagedKVCache("int9", 1, H, D, 4)
    with pytest.raises(FormatError, match="leave nothing to quantize"):
        PagedKVCache("int4-o4", 1, H, 4, 4)
    with pytest.raises(FormatError, match="group size 32"):  # another system's layout keeps its groups exactly
        PagedKVCache("llamacpp-q4_0", 1, H, 48, 4)
    with pytest.raises(ConfigError, match="tail_dtype"):
        PagedKVCache("int8", 1, H, D, 4, tail_dtype=torch.int8)
    with pytest.raises(ConfigError, match="one entry per layer"):
        PagedKVCache("int8", 2, H, D, 4, window=[8])
    with pytest.raises(ConfigError, match="window"):
        PagedKVCache("int8", 1, H, D, 4, window=0)
    with pytest.raises(ConfigError, match="num_layers"):
        PagedKVCache("int8", 0, H, D, 4)
    with pytest.raises(ConfigError, match="at least 2 blocks"):
        PagedKVCache("int8", 1, H, D, 1)


@pytest.mark.parametrize("fmt", ["int8", "k4v2"])
def test_triton_seal_backend_stores_the_same_bytes(fmt):
    """The cache wired to the Triton seal (interpreted on the CPU here) stores what the torch path stores."""
    fmt = parse_format(fmt).with_block_size(8)
    caches = [PagedKVCache(fmt, 2, H, D, 12, seal_backend=b, tail_dtype=torch.float16) for b in ("torch", "triton")]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, H, 13, D, generator=g)
    y = torch.randn(2, H, 4, D, generator=g)
    for cache in caches:
        sids = [cache.add_sequence() for _ in range(2)]
        for chunk in (x, y):
            for layer in range(2):
                cache.append(layer, sids, chunk, -chunk)
    for name, pool in caches[0].storage.pools().items():
        assert_bitexact(caches[1].storage.pools()[name], pool, name)
    bad = torch.randn(2, H, 8, D, generator=g)  # 17 + 8 tokens: seals positions 16..23
    bad[1, 0, 3, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="non-finite key at layer 0, sequence 1, head 0, position 20"):
        caches[1].append(0, sids, bad, bad)


def test_seal_backend_choice():
    with pytest.raises(ConfigError, match="seal_backend"):
        PagedKVCache("int8", 1, H, D, 4, seal_backend="cuda")
    cache = PagedKVCache("int8", 1, H, D, 4, seal_backend="triton")
    cache.seal_state.triton_reasons[(cache.format.key, torch.float32, torch.device("cpu"))] = ["pretend: no GPU"]
    sid = cache.add_sequence()
    before = snapshot(cache)
    x = torch.randn(1, H, 64, D)
    with pytest.raises(UnsupportedError, match="pretend: no GPU"):
        cache.append(0, [sid], x, x)
    assert_same(before, snapshot(cache))
