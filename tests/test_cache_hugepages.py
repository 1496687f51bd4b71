"""Pools on transparent huge pages: same tensor semantics as ``torch.zeros``, 2 MiB aligned where offered."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvpack.cache import PagedKVCache, hugepages
from kvpack.kernels.reference import dense_history

BIG = (4, 64, 8, 64, 128)  # 16 Mi elements: above MIN_BYTES for every dtype used below


def _thp_offered() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return (
        hasattr(mmap, "MADV_HUGEPAGE") and p.exists() and ("[always]" in p.read_text() or "[madvise]" in p.read_text())
    )


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float16, torch.float32])
def test_zeros_is_a_zero_filled_contiguous_tensor(dtype: torch.dtype) -> None:
    t = hugepages.zeros(BIG, dtype)
    gc.collect()  # nothing but the tensor holds the mapping now
    assert t.shape == BIG and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.view(torch.uint8).count_nonzero() == 0
    t[1, 2, 3] = 1
    assert float(t.float().sum()) == 64 * 128
    assert float(t[0].float().abs().sum()) == 0.0


def test_large_pools_are_aligned_and_backed_by_huge_pages_where_the_os_offers_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPACK_HUGE_PAGES", "1")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform: zeros() is torch.zeros here")
    t = hugepages.zeros(BIG, torch.int8)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(3)
    granted = hugepages.huge_page_bytes(t)
    if _thp_offered():
        assert granted is not None and granted >= hugepages.HUGE_PAGE
    # the tail past the last whole huge page is ordinary memory and still correct
    assert int(t.view(-1)[-1]) == 3


def test_small_pools_cuda_and_the_switch_fall_back_to_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hugepages.zeros((16, 8), torch.float16)
    assert small.shape == (16, 8) and small.count_nonzero() == 0
    monkeypatch.setenv("KVPACK_HUGE_PAGES", "0")
    off = hugepages.zeros(BIG, torch.int8)
    assert off.shape == BIG and off.count_nonzero() == 0
    assert not hugepages._enabled()


def test_the_paged_cache_keeps_what_it_stores_in_huge_page_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPACK_HUGE_PAGES", "1")
    cache = PagedKVCache("int8", num_layers=2, kv_heads=8, head_dim=128, num_blocks=1024)
    big = cache.storage.k_data
    assert big.nbytes >= hugepages.MIN_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % hugepages.HUGE_PAGE == 0
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 8, 700, 128, generator=g), torch.randn(2, 8, 700, 128, generator=g)
    ids = [cache.add_sequence(), cache.add_sequence()]
    for layer in range(2):
        cache.append(layer, ids, k, v)
    view = cache.view(1, ids)
    for row in range(2):
        hk, hv = dense_history(view, row)
        # int8 per-channel keys / per-token values: within half a step of the block's range
        assert (hk - k[row]).abs().max() < 0.05 and (hv - v[row]).abs().max() < 0.05
