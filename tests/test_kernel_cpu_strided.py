"""The fused CPU kernel over pools that are views into one page buffer per block (vLLM's layout).

Every pool of a random cache is re-homed into a shared ``uint8`` buffer ``[num_blocks, page_bytes]``: each pool's
block is one 16-byte aligned region of the page, with poison (0xFF bytes: NaN in every float format, E8M0 and
e4m3) before, between and after the regions, so a read that misses its region shows. The pools are then
strided along the block axis only (``stride(0)`` = the page in that dtype's elements); the tails get the
same treatment along the batch axis. The kernel must read them in place and give the contiguous view's output
bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpack.errors import ShapeError
from kvpack.formats import PRESETS
from kvpack.kernels import chunk_attention, cpu_decode, decode_attention
from kvpack.kernels.views import PagedKV
from kvpack.testing import CPU_CHUNK_TOL, assert_bitexact, assert_close, cpu_kernel_tolerance, random_paged_kv

pytest.importorskip("numba")

POOLS = ("k_data", "k_scale", "k_zero", "k_outlier", "k_outlier_idx", "v_data", "v_scale", "v_zero")
ALIGN = 16
POISON = 0xFF


def _up(n: int, m: int = ALIGN) -> int:
    return -(-n // m) * m


def _rehome(tensors: dict[str, torch.Tensor], gap: int = 24) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Copies of ``tensors`` (same first axis ``n``) as views into one poisoned ``uint8`` buffer ``[n, page]``.

    Each tensor's ``t[i]`` lies in row ``i`` of the buffer at its own 16-byte aligned offset, ``gap`` poison
    bytes or more after the previous region (and before the first, and after the last): the views are strided
    along the first axis only, ``stride(0) = page / element_size``. Returns ``(views, buffer)``.
    """
    n = next(iter(tensors.values())).shape[0]
    offsets, end = {}, 0
    for name, t in tensors.items():
        offsets[name] = _up(end + gap)
        end = offsets[name] + t[0].numel() * t.element_size()
    page = _up(end + gap)
    buf = torch.full((n, page), POISON, dtype=torch.uint8)
    views = {}
    for name, t in tensors.items():
        es = t.element_size()
        inner = t.shape[1:]
        strides = torch.empty(inner).stride()  # contiguous within a block
        # the buffer's storage seen as t's dtype; element offset of block 0's region
        v = torch.empty(0, dtype=t.dtype).set_(
            buf.untyped_storage(), offsets[name] // es, t.shape, (page // es, *strides)
        )
        v.copy_(t)
        views[name] = v
    return views, buf


def _strided(kv: PagedKV, tails: bool = True) -> tuple[PagedKV, torch.Tensor]:
    """``kv`` with its payload, scale, zero-point and outlier pools (and its tails) re-homed (:func:`_rehome`);
    the pools' buffer."""
    pools = {n: getattr(kv, n) for n in POOLS if getattr(kv, n) is not None}
    views, buf = _rehome(pools)
    if tails:
        tv, _ = _rehome({"tail_k": kv.tail_k, "tail_v": kv.tail_v})
        views.update(tv)
    out = dataclasses.replace(kv, **views)
    for name, v in views.items():
        assert not v.is_contiguous() and torch.equal(v.view(torch.uint8), getattr(kv, name).view(torch.uint8)), name
    return out, buf


def _shares(arr, buf: torch.Tensor) -> bool:
    """Whether the numpy array ``arr`` points into ``buf``'s memory."""
    lo = buf.data_ptr()
    return lo <= arr.ctypes.data < lo + buf.numel()


CASES = [(1, 64, 0), (4, 128, 4), (4, 64, 4), (1, 128, 0)]  # (GQA group, head_dim, sink)


@pytest.mark.parametrize("int_dot", [True, False], ids=["int", "float"])
@pytest.mark.parametrize(("group", "head_dim", "sink"), CASES)
@pytest.mark.parametrize("name", ["int8", "fp8", "int4", "kivi2", "k8v4", "k4v2", "fp16", "int4-o4", "fp8-o4"])
def test_strided_pools_match_contiguous_and_reference(
    monkeypatch: pytest.MonkeyPatch, name: str, group: int, head_dim: int, sink: int, int_dot: bool
) -> None:
    monkeypatch.setattr(cpu_decode, "INT_DOT", int_dot)  # restored after the test
    sink = 0 if PRESETS[name].is_passthrough else sink  # a full-precision format keeps no sink
    fmt = PRESETS[name].with_block_size(16).with_sink(sink)
    lens = [16 * 5 + 7, 33, 16, 3]  # histories ending inside a block, on a block boundary, before one
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=head_dim, seed=head_dim + group, sink=sink)
    assert kv.sink == sink and not torch.equal(kv.block_tables[0, :5], torch.arange(1, 6, dtype=torch.int32))
    strided, _ = _strided(kv)
    q = torch.randn(len(lens), 2 * group, head_dim)
    for window in (None, 40):
        want = decode_attention(q, kv, backend="cpu", window=window)
        got = decode_attention(q, strided, backend="cpu", window=window, out=torch.full_like(q, float("nan")))
        assert_bitexact(got, want, f"{name} window {window}: strided against contiguous")
        expected = decode_attention(q, kv, backend="reference", window=window)
        assert_close(got, expected, *cpu_kernel_tolerance(kv), f"{name} window {window}: strided against reference")


def test_strided_views_are_kept_and_read_in_place() -> None:
    kv, _, _ = random_paged_kv(PRESETS["k8v4"].with_block_size(16), [50, 23], kv_heads=2, head_dim=64, seed=4)
    strided, buf = _strided(kv, tails=False)
    q = torch.randn(2, 4, 64)
    first = cpu_decode.decode_attention(q, strided)
    state = cpu_decode._prepare(strided)
    nbm = cpu_decode._nb()
    page = buf.shape[1]
    assert state.kp[nbm.P_BST] == page and state.kp[nbm.P_SBST] == page // 2  # int8 codes, fp16 scales
    assert state.vp[nbm.P_BST] == page and state.vp[nbm.P_ZBST] == page // 2
    assert state.tpk[nbm.P_BST] == 2 * 16 * 64  # contiguous tails
    assert state.k_data is not None and state.v_data is not None
    assert _shares(state.k_data[0], buf) and _shares(state.v_data[0], buf)
    k_scale, _, v_scale, v_zero = state.views[:4]  # fp16: the uint16 slot; k8v4 keys have no zero-points
    assert _shares(k_scale[1], buf) and _shares(v_scale[1], buf) and _shares(v_zero[1], buf)
    # new contents in place: the kept views see them (nothing was copied)
    row0 = int(strided.block_tables[0, 0])
    strided.v_scale[row0].mul_(2.0)
    kv.v_scale[row0].mul_(2.0)
    again = cpu_decode.decode_attention(q, strided)
    assert not torch.equal(first, again)
    assert_bitexact(again, cpu_decode.decode_attention(q, kv), "after an in-place change")


def test_strided_tails_are_read_in_place() -> None:
    kv, _, _ = random_paged_kv(PRESETS["int8"].with_block_size(16), [50, 23], kv_heads=2, head_dim=64, seed=5)
    strided, _ = _strided(kv)
    q = torch.randn(2, 4, 64)
    cpu_decode.decode_attention(q, strided)
    state = cpu_decode._prepare(strided)
    assert state.tails is not None and state.tpk[cpu_decode._nb().P_BST] == strided.tail_k.stride(0) > 2 * 16 * 64
    strided.tail_k.mul_(-1.0)
    kv.tail_k.mul_(-1.0)
    assert_bitexact(
        cpu_decode.decode_attention(q, strided), cpu_decode.decode_attention(q, kv), "tails changed in place"
    )


def _with(kv: PagedKV, **pools: torch.Tensor) -> PagedKV:
    return dataclasses.replace(kv, **pools)


def test_pools_the_kernel_cannot_read_in_place_are_refused() -> None:
    kv, _, _ = random_paged_kv(PRESETS["k8v4"].with_block_size(16), [40, 9], kv_heads=2, head_dim=64, seed=6)
    q = torch.randn(2, 4, 64)
    nb = kv.k_data.shape[0]
    # rows strided within a block: the payload's token axis is not contiguous
    wide = torch.zeros(nb, 2, 16, 128, dtype=kv.k_data.dtype)
    wide[..., :64] = kv.k_data
    with pytest.raises(ShapeError, match=r"key payload .*not contiguous within a block"):
        cpu_decode.decode_attention(q, _with(kv, k_data=wide[..., :64]))
    # blocks that overlap: stride(0) smaller than a block
    flat = kv.v_scale.reshape(-1)
    inner = kv.v_scale[0].numel()
    overlap = flat.as_strided(kv.v_scale.shape, (inner // 2, *kv.v_scale.stride()[1:]))
    with pytest.raises(ShapeError, match=r"value scale .*overlap"):
        cpu_decode.decode_attention(q, _with(kv, v_scale=overlap))
    # a zero-point pool laid out on its own stride is fine (it takes its own block stride)
    zpad = torch.full((nb, kv.v_zero[0].numel() + 8), float("nan"), dtype=kv.v_zero.dtype)
    zview = zpad[:, : kv.v_zero[0].numel()].view(kv.v_zero.shape)
    zview.copy_(kv.v_zero)
    assert_bitexact(
        cpu_decode.decode_attention(q, _with(kv, v_zero=zview)), cpu_decode.decode_attention(q, kv), "zero stride"
    )


@pytest.mark.parametrize("name", ["int4-o4", "fp8-o4"])
def test_strided_outlier_pools_are_read_in_place_by_the_chunk_kernel(name: str) -> None:
    """The vLLM layout: outlier residuals and channel indices in each block's page, between poisoned bytes."""
    kv, _, _ = random_paged_kv(PRESETS[name].with_block_size(16), [40, 9, 77], kv_heads=2, head_dim=64, seed=7)
    strided, buf = _strided(kv)
    assert kv.k_outlier is not None and strided.k_outlier.stride(0) * 2 == buf.shape[1]  # fp16: a page apart
    q = torch.randn(3, 5, 4, 64)
    want = chunk_attention(q, kv, backend="cpu")
    got = chunk_attention(q, strided, backend="cpu")
    assert_bitexact(got, want, f"{name}: strided against contiguous")
    assert_close(got, chunk_attention(q, kv, backend="reference"), *CPU_CHUNK_TOL, f"{name}: strided against reference")
