"""The paged, quantized K/V cache: block pool, per-layer packed pools, full-precision tails, sealing,
prefix sharing, fork / crop, offload to a host tier, memory report.

>>> from kvpack.cache import PagedKVCache
>>> cache = PagedKVCache("int8", num_layers=2, kv_heads=2, head_dim=64, num_blocks=16)
>>> sid = cache.add_sequence()
"""

from kvpack.cache.layered import LayeredKVCache
from kvpack.cache.memory import LayerMemory, MemoryReport
from kvpack.cache.paged import PagedKVCache
from kvpack.cache.pool import NULL_BLOCK, BlockPool

__all__ = ["NULL_BLOCK", "BlockPool", "LayerMemory", "LayeredKVCache", "MemoryReport", "PagedKVCache"]
