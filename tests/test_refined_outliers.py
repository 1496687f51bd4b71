"""Kept key channels stored as 4-bit refinements of their own codes (``o<N>r``, ``o<N>qr``): the syntax and the bytes,
the precision a refinement code gives, and the cache, the transformers integration and the simulate engine that
read them. The kernels' agreement with the reference is pinned where every outlier format's is
(``test_kernel_cpu``, ``test_kernel_cpu_chunk``, ``test_kernel_triton*``, ``test_vllm_layer``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import FormatError, ShapeError
from kvpack.formats import DType, PerChannel, QuantSpec, parse_format
from kvpack.outliers import apply_residual, kept_steps, quantize_outliers, refine, unrefine
from kvpack.quant import dequantize, quantize
from kvpack.testing import realistic_keys

H, D, B = 2, 64, 16


def test_syntax_bytes_and_refusals():
    f = parse_format("k=int4:channel:asym:o6qr,v=int4:g32:asym,sink=1")
    assert f.key.refined and f.key.query_ranked and f.key.outliers == 6 and f.needs_artifact
    assert str(f.key) == "int4:channel:asym:fp16:o6qr" and parse_format(f.spec_string()) == f
    assert parse_format("k=int4:channel:asym:o6r,v=int4").key.refined
    assert not parse_format("k=int4:channel:asym:o6r,v=int4").needs_artifact  # ranked by range: no artifact
    fp16 = parse_format("k=int4:channel:asym:o6q,v=int4:g32:asym,sink=1")
    # 6 channels: 3 bytes of codes per token instead of 12 bytes of fp16, the 6 index bytes unchanged
    assert f.outlier_bytes(3, 64) == 3 * 64 * 3 + 3 * 6 and fp16.outlier_bytes(3, 64) == 3 * 64 * 12 + 3 * 6
    assert f.bits_per_element(3, 64) == pytest.approx(4.943, abs=1e-3)  # under 5 bits, where o2q is 5.002
    assert parse_format("k=int4:channel:o5r,v=int4").key.residual_width == 3  # half a byte per row unused
    for bad, needle in (
        ("k=fp8:head:o4r,v=fp8:head", "integer dtype"),
        ("k=int4:g32:asym:o4r,v=int4", "'channel' scales"),
        ("k=int8:channel:static:o4r,v=int8", "no 'static'"),
        ("k=int4:channel:asym:o4r,v=int4:o2", "keys only"),
    ):
        with pytest.raises(FormatError, match=needle):
            parse_format(bad)
    with pytest.raises(FormatError, match="keeps none"):
        QuantSpec(DType.INT4, PerChannel(), symmetric=False, refined=True)
    # '@static' leaves a refined spec its block-local scales (a calibrated scale could clip a kept element)
    assert not parse_format("k=int4:channel:asym:o4r,v=int8:channel@static").key.static


@pytest.mark.parametrize(
    "spec", ["k=int4:channel:asym:o5r,v=int4", "k=int4:channel:o4r,v=int4", "k=int2:channel:asym:o3r,v=int4"]
)
def test_kept_elements_are_within_a_32nd_of_their_step(spec):
    """Each kept element reconstructs within 1/32 of its channel's scale step (int4 keys: int8 precision), better
    than the spec without outliers, and every other element exactly as that spec quantizes it."""
    key = parse_format(spec).key
    g = torch.Generator().manual_seed(1)
    x = realistic_keys(3, H, B, D, generator=g)
    ob = quantize_outliers(x, key)
    assert ob.residual.dtype == torch.uint8 and ob.residual.shape == (3, H, B, (key.outliers + 1) // 2)
    at = ob.idx.long().unsqueeze(-2).expand(3, H, B, -1)
    step = kept_steps(ob.qt.scale, key, ob.idx)
    rec = apply_residual(dequantize(ob.qt), ob.residual, ob.idx, step)
    err = (rec - x).abs()
    assert ((err.gather(-1, at) / step).max()) <= 1 / 32 + 1e-4
    plain = (dequantize(quantize(x, dataclasses.replace(key, outliers=0, refined=False))) - x).abs()
    assert err.gather(-1, at).amax() < plain.gather(-1, at).amax() / 4
    others = torch.ones_like(err, dtype=torch.bool).scatter(-1, at, False)
    assert torch.equal(err[others], plain[others])  # per-channel scales: the other channels are untouched


def test_codes_pack_two_channels_a_byte_and_a_zero_step_gives_zero():
    step = torch.tensor([[[1.0, 2.0, 0.0]]])  # [H=1, 1, k=3]
    r = torch.tensor([[[0.49, -1.0, 5.0], [-0.5, 0.9, -3.0]]])  # [1, T=2, 3]: within half a step, but the zero step
    codes = refine(r, step)
    assert codes.shape == (1, 2, 2) and codes.dtype == torch.uint8
    assert codes[0, 0, 0] == (15 | (0 << 4)) and codes[0, 0, 1] == 8  # 0.49 -> 15, -1.0 of step 2 -> 0; zero step: 8
    back = unrefine(codes, step)
    assert (back - torch.where(step > 0, r, 0.0)).abs().max() <= 2 / 32 + 1e-6
    assert torch.equal(back[..., 2], torch.zeros(1, 2))
    with pytest.raises(ShapeError, match="scale steps"):
        apply_residual(torch.zeros(1, 2, 4), codes, torch.tensor([[0, 1, 2]]))


def test_paged_cache_stores_the_codes_and_reads_them_back():
    fmt = parse_format(f"k=int4:channel:asym:o5r,v=int4:g32:asym,block={B}")
    cache = PagedKVCache(fmt, 1, H, D, 8)
    g = torch.Generator().manual_seed(2)
    k, v = realistic_keys(1, H, 2 * B + 5, D, generator=g), torch.randn(1, H, 2 * B + 5, D, generator=g)
    sid = cache.add_sequence()
    cache.append(0, [sid], k, v)
    assert cache.storage.k_outlier.dtype == torch.uint8 and cache.storage.k_outlier.shape[-1] == 3
    payload, scale, outlier = cache.storage.block_nbytes()
    assert payload + scale + outlier == fmt.block_bytes(H, D) and outlier == fmt.outlier_bytes(H, D)
    blocks = k[0, :, : 2 * B].reshape(H, 2, B, D).transpose(0, 1)
    want = [quantize_outliers(blocks[i], fmt.key) for i in range(2)]
    for i, block in enumerate(cache.slots.seqs[sid].blocks):
        got, _ = cache.storage.dequantize_block(block, torch.tensor([0]))
        ref = apply_residual(
            dequantize(want[i].qt), want[i].residual, want[i].idx, kept_steps(want[i].qt.scale, fmt.key, want[i].idx)
        )
        torch.testing.assert_close(got[0], ref, atol=1e-6, rtol=1e-6)
        assert (got[0] - blocks[i]).abs().max() < (dequantize(quantize(blocks[i], fmt.key)) - blocks[i]).abs().max()


def test_hf_cache_equals_the_simulated_reconstruction(tiny, monkeypatch):
    """Teacher-forced logits through kvpack's cache and fused kernels equal the simulate engine's reconstruction of
    the same refined format; the refinement codes move them (against the spec without kept channels)."""
    import kvpack.hf
    from kvpack.evaluation.simulate import SimulatedCache
    from kvpack.integrations import hf_attention as hfa
    from kvpack.kernels import cpu_decode

    model, _ = tiny
    cfg = model.config
    layers, head_dim = (
        cfg.num_hidden_layers,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    fmt = parse_format(f"k=int4:channel:asym:o{head_dim // 8}r,v=int4:g32:asym,block={B}")
    seq = torch.randint(0, cfg.vocab_size, (1, 3 * B + 9), generator=torch.Generator().manual_seed(5))
    key = kvpack.hf.cache_kwarg(model)

    def logits(cache):
        with torch.inference_mode():
            return model(input_ids=seq, **{key: cache}).logits

    model.set_attn_implementation("sdpa")  # the simulate engine's caches hold plain tensors
    want = logits(SimulatedCache([fmt] * layers))
    none = parse_format(f"k=int4:channel:asym,v=int4:g32:asym,block={B}")
    assert (logits(SimulatedCache([none] * layers)) - want).abs().max() > 1e-2  # the codes matter here
    monkeypatch.setattr(cpu_decode, "INT_DOT", False)  # the float path: the reconstruction's values exactly
    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    got = logits(kvpack.hf.cache_for(model, fmt, max_tokens=256))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "spec", ["k=int4:channel:asym:o6r,v=int4", "k=int4:channel:o5r,v=int4", "k=int2:channel:asym:o7r,v=int4"]
)
def test_the_short_seal_writes_the_general_seals_bytes(spec):
    """A refined spec's seal skips :func:`quantize_kept` (each kept channel is its own scale group and keeps its own
    code): the same payload, scales, codes and indices as the general seal."""
    from kvpack.cache.write import seal_outliers
    from kvpack.outliers import outlier_residual, quantize_kept, seal_time_channels

    key = parse_format(spec).key
    x = realistic_keys(4, H, B, D, generator=torch.Generator().manual_seed(4))
    qt, clipped, (res, idx) = seal_outliers(x, key)
    channels = seal_time_channels(x, key.outliers)
    want = quantize_kept(x, key, channels)
    want_res, want_idx = outlier_residual(x, want, channels)
    assert clipped == 0
    for got, ref in (
        (qt.data, want.data),
        (qt.scale, want.scale),
        (qt.zero, want.zero),
        (res, want_res),
        (idx, want_idx),
    ):
        assert (got is None and ref is None) or torch.equal(got, ref)
