"""The cache's public core on its own: ``CacheConfig``, ``SlotTable`` and ``PrefixIndex`` (no ``PagedKVCache``)."""

import numpy as np
import pytest
import torch

from kvpack.cache.config import CacheConfig
from kvpack.cache.pool import BlockPool
from kvpack.cache.prefix import PrefixIndex, chain_keys
from kvpack.cache.slots import SlotTable
from kvpack.errors import ConfigError, SequenceError, ShapeError

L, H, B, D = 2, 2, 4, 8


def test_config_checks_once_and_derives():
    cfg = CacheConfig.create("int8,block=4", L, H, D, window=[8, 12])
    assert (cfg.block_size, cfg.sink, cfg.release_window, cfg.windows) == (4, cfg.format.sink, 12, (8, 12))
    assert cfg.salt.startswith(cfg.format.spec_string()) and cfg.key_rotation is None
    assert CacheConfig.create("int8", L, H, D, window=[8, None]).release_window is None
    assert cfg.check_layer(np.int64(1)) == 1
    with pytest.raises(ShapeError, match="layer must be"):
        cfg.check_layer(L)
    for kw, match in (({"seal_backend": "cuda"}, "seal_backend"), ({"window": [1]}, "one entry per layer")):
        with pytest.raises(ConfigError, match=match):
            CacheConfig.create("int8", L, H, D, **kw)


def test_slot_table_add_fork_remove_and_grow():
    t = SlotTable(L, H, B, D, sink=2, num_slots=1)
    a = t.add([3, 5], [], [])
    assert (a.slot, a.prefix_len, list(t.tables_np[a.slot, :2]), list(t.lens_np[:, a.slot])) == (0, 8, [3, 5], [8, 8])
    t.tail_k[:, a.slot] = 1.0
    t.sink_v[:, a.slot] = 2.0
    version = t.version
    b = t.fork(a)  # no free slot: the table doubles, arrays are replaced, the old slot is kept
    assert t.num_slots == 2 and t.version > version and b.slot == 1 and b.blocks == a.blocks
    assert bool((t.tail_k[:, 1] == 1).all() and (t.sink_v[:, 1] == 2).all()) and list(t.lens_np[:, 1]) == [8, 8]
    assert t.lens_np.base is not None and np.shares_memory(t.lens_np, t.lens.numpy())
    t.remove(a)
    with pytest.raises(SequenceError, match="already freed"):
        t.seq(a.sid)
    assert t.add([], [], []).slot == 0  # the lowest free slot is taken again


def test_batch_is_cached_until_the_layout_changes():
    t = SlotTable(L, H, B, D)
    ids = [t.add([], [], []).sid for _ in range(3)]
    batch = t.batch(ids[1:])
    assert batch.start == 1 and list(batch.slots) == [1, 2] and t.batch(ids[1:]) is batch
    assert t.batch(torch.tensor(ids[::-1])).start is None
    t.changed()
    assert t.batch(ids[1:]) is not batch
    with pytest.raises(SequenceError, match="twice"):
        t.batch([ids[0], ids[0]])
    with pytest.raises(ShapeError, match="wrap a single id"):
        t.batch(ids[0])


def test_prefix_index_registers_blocks_sealed_in_every_layer():
    pool = BlockPool(8)
    index = PrefixIndex(pool, "salt", B)
    t = SlotTable(L, H, B, D)
    tokens = list(range(2 * B + 1))
    seq = t.add([], tokens, [])
    seq.blocks = [pool.allocate(), pool.allocate()]
    t.lens_np[0, seq.slot], t.lens_np[1, seq.slot] = 2 * B, B  # layer 1 has sealed only the first block
    index.register(t, seq)
    assert seq.keys == chain_keys(tokens, B, "salt")[:1]
    t.lens_np[1, seq.slot] = 2 * B
    index.register(t, seq)
    assert seq.keys == chain_keys(tokens, B, "salt")
    assert index.lookup(tokens) == list(zip(seq.keys, seq.blocks))
    assert index.lookup(tokens[: 2 * B]) == [(seq.keys[0], seq.blocks[0])]  # one prompt token is left to run
