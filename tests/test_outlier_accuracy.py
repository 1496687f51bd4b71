"""Kept outlier channels never reconstruct worse than the same format without them (``fp8-o4`` against
``fp8-plain``, ``int4-o4`` against ``int4``), on adversarial blocks near the fp16 range."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack.cache import PagedKVCache
from kvpack.formats import parse_format
from kvpack.kernels.reference import dense_history, paged_attention_reference
from kvpack.outliers import dequantize_outliers, quantize_outliers
from kvpack.quant import dequantize, quantize

H, B, D, K = 2, 16, 32, 4
PAIRS = [("fp8-o4", "fp8-plain"), ("int4-o4", "int4"), ("k=int4:g32:asym:o4,v=int4", "int4-g32")]
FP16_MAX = 65504.0


def _channel_errors(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Largest ``|x - y|`` over the tokens of each kept channel: float64 ``[..., H, k]``.

    ``x``, ``y``: ``[..., H, T, D]``; ``idx``: ``[..., H, k]`` channel indices.
    """
    gidx = idx.long().unsqueeze(-2).expand(*x.shape[:-1], idx.shape[-1])
    return (x.double() - y.double()).abs().gather(-1, gidx).amax(-2)


def _adversarial(case: str, seed: int = 0) -> torch.Tensor:
    """One ``[1, H, B, D]`` float32 block (fp16 values) of a named adversarial case."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, B, D, generator=g)
    if case == "one channel +60000":
        x[..., 3] = 60000
    elif case == "one channel -60000":
        x[..., 3] = -60000
    elif case == "+60000 against a -30000 remainder":  # the fill was the remainder's min: residual 90000
        x[..., 3], x[..., 5:10] = 60000, -30000
    elif case == "-65504 against a +65504 remainder":
        x[..., 3], x[..., 5:10] = -FP16_MAX, FP16_MAX
    elif case == "several large channels, both signs":
        x[..., [1, 7, 20, 31]] = torch.tensor([60000.0, -59000.0, 65504.0, -65504.0])
        x[..., 12] = -40000
    elif case == "alternating signs per token":
        x[..., 3] = 60000 * (1 - 2 * (torch.arange(B) % 2))
        x[..., 4] = -50000
    elif case == "kept values inside the remainder's range":  # more large channels than are kept
        x[..., :8] = 30000 * torch.randn(1, H, B, 8, generator=g).sign()
    elif case == "per-head magnitudes":  # per-block scales of very different sizes
        x[:, 0] *= 1e-3
        x[:, 1, :, 2] = 65000
    else:
        raise ValueError(case)
    return x.half().float()


CASES = [
    "one channel +60000",
    "one channel -60000",
    "+60000 against a -30000 remainder",
    "-65504 against a +65504 remainder",
    "several large channels, both signs",
    "alternating signs per token",
    "kept values inside the remainder's range",
    "per-head magnitudes",
]


def _assert_no_worse(x: torch.Tensor, with_outliers: str, without: str) -> None:
    ob = quantize_outliers(x, parse_format(with_outliers).key)
    kept = _channel_errors(x, dequantize_outliers(ob), ob.idx)
    plain = _channel_errors(x, dequantize(quantize(x, parse_format(without).key)), ob.idx)
    assert torch.isfinite(ob.residual).all()
    assert (kept <= plain).all(), f"kept-channel errors {kept[kept > plain]} > plain {plain[kept > plain]}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("with_outliers", "without"), PAIRS)
def test_kept_channels_reconstruct_at_least_as_well_as_without_them(case, with_outliers, without):
    _assert_no_worse(_adversarial(case), with_outliers, without)


_values = st.one_of(
    st.floats(-FP16_MAX, FP16_MAX, width=16),
    st.sampled_from([0.0, 60000.0, -60000.0, FP16_MAX, -FP16_MAX, 6.1e-5, -3e4]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    big=st.lists(st.tuples(st.integers(0, D - 1), _values), min_size=1, max_size=8),
    scale=st.sampled_from([1e-4, 1.0, 1e3]),
    fp32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kept_channels_no_worse_on_generated_blocks(big, scale, fp32, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, B, D, generator=g) * scale
    for ch, value in big:  # whole channels, with a random per-token sign
        x[..., ch] = value * torch.randn(1, H, B, generator=g).sign()
    x = x if fp32 else x.half().float()  # the float32 tail keeps bits fp16 cannot hold
    for with_outliers, without in PAIRS:
        _assert_no_worse(x, with_outliers, without)


@pytest.mark.parametrize("case", CASES)
def test_symmetric_kept_channels_hold_fp16_values_exactly(case):
    x = _adversarial(case)
    ob = quantize_outliers(x, parse_format("fp8-o4").key)
    assert _channel_errors(x, dequantize_outliers(ob), ob.idx).max() == 0


def test_a_channel_of_60000_reconstructs_as_60000_not_a_saturated_residual():
    x = _adversarial("+60000 against a -30000 remainder")
    y = dequantize_outliers(quantize_outliers(x, parse_format("fp8-o4").key))
    plain = dequantize(quantize(x, parse_format("fp8-plain").key))
    assert y[0, 0, 0, 3].item() == 60000  # a -30000 fill saturated the residual: 35488
    assert plain[0, 0, 0, 3].item() == 60032


def _cache_and_keys(fmt: str, case: str, tail_dtype: torch.dtype):
    """A one-layer cache holding two sealed adversarial blocks and 3 tail tokens of one sequence."""
    cache = PagedKVCache(parse_format(f"{fmt},block={B},sink=0"), 1, H, D, 8, tail_dtype=tail_dtype)
    sid = cache.add_sequence()
    k = torch.cat([_adversarial(case, seed=1), _adversarial(case, seed=2)], dim=2)  # [1, H, 2B, D]
    g = torch.Generator().manual_seed(3)
    k = torch.cat([k, torch.randn(1, H, 3, D, generator=g)], dim=2).to(tail_dtype)
    v = torch.randn(1, H, 2 * B + 3, D, generator=g).to(tail_dtype)
    cache.append(0, [sid], k, v)
    return cache, sid, k.float(), v


@pytest.mark.parametrize("case", ["+60000 against a -30000 remainder", "several large channels, both signs"])
@pytest.mark.parametrize(("with_outliers", "without"), PAIRS[:2])
@pytest.mark.parametrize("tail_dtype", [torch.float16, torch.float32])
def test_cache_seal_and_reference_attention_no_worse_with_kept_channels(case, with_outliers, without, tail_dtype):
    cache, sid, k, _ = _cache_and_keys(with_outliers, case, tail_dtype)
    view = cache.view(0, [sid])
    chans = view.k_outlier_idx[view.block_tables[0, :2].long()]  # [2, H, k] per sealed block
    q = torch.zeros(1, 1, H, D)  # reads the kept channels only, small enough for an unsaturated softmax
    for j in range(2):
        q[0, 0].scatter_(-1, chans[j].long(), 1e-4)
    out, keys = {}, {}
    for fmt in (with_outliers, without):
        cache, sid, k, _ = _cache_and_keys(fmt, case, tail_dtype)
        view = cache.view(0, [sid])
        keys[fmt] = dense_history(view, 0)[0]  # [H, n, D]
        out[fmt] = paged_attention_reference(q, view)[0, 0]  # [H, D]
    exact_k = k[0]  # [H, n, D]
    for j in range(2):  # per sealed block, its own kept channels
        idx = chans[j].unsqueeze(0)  # [1, H, k]
        sl = slice(j * B, (j + 1) * B)
        kept = _channel_errors(exact_k[:, sl].unsqueeze(0), keys[with_outliers][:, sl].unsqueeze(0), idx)
        plain = _channel_errors(exact_k[:, sl].unsqueeze(0), keys[without][:, sl].unsqueeze(0), idx)
        assert (kept <= plain).all()
    # the same values in both formats: the attention error is the keys' error
    vals = dense_history(cache.view(0, [sid]), 0)[1]  # [H, n, D] (the plain cache's values, same bytes)
    w = torch.softmax((q[0, 0].double().unsqueeze(1) * exact_k.double()).sum(-1) / D**0.5, dim=-1)  # [H, n]
    exact = (w.unsqueeze(-1) * vals.double()).sum(1)  # [H, D]
    err_o, err_p = ((out[f].double() - exact).abs().max().item() for f in (with_outliers, without))
    assert err_o <= err_p + 1e-6


@pytest.mark.parametrize("spec_text", ["k=int8:channel:static:o3,v=int8:token", "k=fp8:head:static:o3,v=fp8:head"])
def test_kept_channels_with_static_scales_no_worse_than_the_static_format(spec_text):
    spec = parse_format(spec_text).key
    x = _adversarial("+60000 against a -30000 remainder")
    chans = torch.tensor([[3, 5, 6]] * H)
    shape = spec.scale_shape(H, 1, D)
    scale = torch.full((1, *shape), 0.25, dtype=torch.float16)  # calibrated far below the block's range
    ob = quantize_outliers(x, spec, chans, scale=scale)
    kept = _channel_errors(x, dequantize_outliers(ob), ob.idx)
    plain = _channel_errors(x, dequantize(quantize(x, spec, scale)), ob.idx)
    assert torch.equal(ob.qt.scale, scale) and (kept <= plain).all() and kept.max() < plain.max() / 100
