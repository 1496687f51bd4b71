"""Prefix sharing: sealed blocks named by (parent key, token ids, format), reused by reference, LRU-evicted."""

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.cache.prefix import block_key, chain_keys
from kvpack.formats import parse_format
from kvpack.testing import assert_bitexact

H, D, B, L = 2, 32, 8, 2
FMT = parse_format("k8v4").with_block_size(B)


def kv_of(tokens, layer):
    """Keys/values as a deterministic function of the token prefix, like a model's: [1, H, n, D]."""
    out = []
    for p in range(len(tokens)):
        g = torch.Generator().manual_seed(hash((tuple(tokens[: p + 1]), layer)) % 2**31)
        out.append(torch.randn(2, H, D, generator=g))
    x = torch.stack(out, dim=2)  # [2, H, n, D]
    return x[:1], x[1:]


def run(cache, sid, tokens, start=0):
    """Append tokens[start:] (all layers) and record their ids."""
    for layer in range(L):
        k, v = kv_of(tokens, layer)
        cache.append(layer, [sid], k[:, :, start:], v[:, :, start:])
    cache.append_tokens(sid, tokens[start:])


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n,), generator=g).tolist()


def test_a_new_sequence_reuses_cached_blocks_by_reference():
    cache = PagedKVCache(FMT, L, H, D, 20)
    doc = prompt(40, 0)
    a = cache.add_sequence()
    run(cache, a, doc)
    assert cache.cached_prefix_len(a) == 0
    b_tokens = doc[:27] + prompt(10, 1)
    b = cache.add_sequence(b_tokens)
    assert cache.cached_prefix_len(b) == 24 and cache.seq_len(b) == cache.seq_len(b, 1) == 24
    a_ids = cache.view(0, [a]).block_tables[0, :3].tolist()
    assert cache.view(1, [b]).block_tables[0, :3].tolist() == a_ids
    assert all(cache.pool.ref_count(i) == 2 for i in a_ids)
    used = cache.pool.num_used
    for layer in range(L):
        k, v = kv_of(b_tokens, layer)
        cache.append(layer, [b], k[:, :, 24:], v[:, :, 24:])
    assert cache.pool.num_used == used + 1  # only b's own block 3 is new
    for layer in range(L):
        assert_bitexact(cache.dense(layer, b)[0][:, :24], cache.dense(layer, a)[0][:, :24])
    # b's contents equal a fresh run of the same tokens (sealing is deterministic)
    ref = PagedKVCache(FMT, L, H, D, 20)
    r = ref.add_sequence()
    run(ref, r, b_tokens)
    for layer in range(L):
        for got, want in zip(cache.dense(layer, b), ref.dense(layer, r)):
            assert_bitexact(got, want)
    assert cache.problems() == []


def test_keys_name_the_whole_prefix_and_the_format():
    t = list(range(16))
    other = [99, *t[1:]]
    assert chain_keys(t, 8, "s")[1] != chain_keys(other, 8, "s")[1]  # same block 1 tokens, other parent
    assert block_key(b"", t[:8], "int8") != block_key(b"", t[:8], "int4")
    cache = PagedKVCache(FMT, L, H, D, 20)
    a = cache.add_sequence()
    run(cache, a, [*t, 1])
    assert cache.cached_prefix_len(cache.add_sequence([*other, 5])) == 0


def test_blocks_register_only_once_sealed_in_every_layer_and_ids_known():
    cache = PagedKVCache(FMT, L, H, D, 20)
    doc = prompt(17, 2)
    a = cache.add_sequence()
    k, v = kv_of(doc, 0)
    cache.append(0, [a], k, v)
    cache.append_tokens(a, doc)
    assert cache.cached_prefix_len(cache.add_sequence(doc)) == 0  # layer 1 has not sealed yet
    k, v = kv_of(doc, 1)
    cache.append(1, [a], k, v)
    assert cache.cached_prefix_len(cache.add_sequence(doc)) == 16
    # without recorded ids nothing is shareable
    c = cache.add_sequence()
    for layer in range(L):
        k, v = kv_of(doc, layer)
        cache.append(layer, [c], k, v)
    cache.free(a)
    assert cache.pool.num_cached == 0  # still referenced by the sequences that reused them
    assert cache.cached_prefix_len(cache.add_sequence([*doc, 1])) == 16


def test_at_least_one_prompt_token_is_left_to_run():
    cache = PagedKVCache(FMT, L, H, D, 20)
    doc = prompt(16, 3)
    a = cache.add_sequence()
    run(cache, a, doc)
    assert cache.cached_prefix_len(cache.add_sequence(doc)) == 8  # not 16: the model needs logits
    assert cache.cached_prefix_len(cache.add_sequence([*doc, 7])) == 16


@pytest.mark.parametrize("sink", [1, 0], ids=["preset-sink=1", "sink=0"])
def test_unreferenced_blocks_stay_cached_and_are_evicted_lru(sink):
    fmt = FMT.with_sink(sink)
    cache = PagedKVCache(fmt, L, H, D, 7)  # 6 usable blocks
    docs = [prompt(17, 10 + i) for i in range(3)]
    for doc in docs:  # 2 blocks each, all freed: 6 cached blocks
        s = cache.add_sequence(doc)
        run(cache, s, doc)
        cache.free(s)
    assert cache.pool.num_cached == 6 and cache.pool.num_free == 0
    report = cache.memory_report()
    # beside each registered first block its sink rows are kept for reuse: K and V, H x S x D fp32 per layer
    sink_rows = 2 * H * sink * D * 4
    assert report.total.cached_bytes == 6 * L * fmt.block_bytes(H, D) + 3 * L * sink_rows
    assert report.total.used_bytes == 0
    hit = cache.add_sequence(docs[0])  # docs[0]'s blocks become most recently used
    assert cache.cached_prefix_len(hit) == 16
    cache.free(hit)
    s = cache.add_sequence()
    run(cache, s, prompt(24, 99))  # needs 3 blocks: evicts docs[1] (both) and docs[2]'s first
    assert cache.pool.num_cached == 3
    # the evicted first blocks' sink rows go with them; docs[0]'s and the live sequence's first block's stay
    report = cache.memory_report()
    assert report.total.cached_bytes == 3 * L * fmt.block_bytes(H, D) + 2 * L * sink_rows
    assert cache.cached_prefix_len(cache.add_sequence(docs[0] + [1])) == 16
    assert cache.cached_prefix_len(cache.add_sequence(docs[1] + [1])) == 0
    assert cache.problems() == []


def test_crop_returned_blocks_are_not_registered():
    cache = PagedKVCache(FMT, L, H, D, 20)
    doc = prompt(24, 4)
    a = cache.add_sequence()
    for layer in range(L):  # contents first, ids recorded only at the end: nothing registered yet
        k, v = kv_of(doc[:20], layer)
        cache.append(layer, [a], k, v)
    cache.crop(a, 10)  # block 1 was sealed: tokens 8, 9 return dequantized, the block is released
    assert cache.pool.num_cached == 0
    for layer in range(L):
        k, v = kv_of(doc, layer)
        cache.append(layer, [a], k[:, :, 10:], v[:, :, 10:])
    cache.append_tokens(a, doc)
    ids = cache.view(0, [a]).block_tables[0, :3].tolist()
    assert [cache.pool.is_cached(i) for i in ids] == [True, False, True]  # block 1: re-quantized values
    b = cache.add_sequence([*doc, 0])
    assert cache.cached_prefix_len(b) == 8  # the chain stops at block 1
    assert cache.problems() == []


def test_a_released_original_block_still_serves_its_prefix():
    cache = PagedKVCache(FMT, L, H, D, 20)
    doc = prompt(24, 5)
    a = cache.add_sequence()
    run(cache, a, doc[:20])
    old = cache.view(0, [a]).block_tables[0, 1].item()
    cache.crop(a, 10)
    assert cache.pool.ref_count(old) == 0 and cache.pool.is_cached(old)  # the original contents stay cached
    run(cache, a, doc, start=10)
    b = cache.add_sequence([*doc, 0])
    assert cache.cached_prefix_len(b) == 24
    table_a = cache.view(0, [a]).block_tables[0, :3].tolist()
    assert cache.view(0, [b]).block_tables[0, :3].tolist() == [table_a[0], old, table_a[2]]
    assert cache.problems() == []
