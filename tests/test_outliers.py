"""Outlier key channels (``QuantSpec.outliers``, preset ``fp8-o4``) through formats, seal, cache, kernels and HF."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from kvpack import kernels
from kvpack.cache import PagedKVCache
from kvpack.calibration import Artifact, KVObserver
from kvpack.errors import CalibrationError, FormatError, NonFiniteError, ShapeError
from kvpack.formats import PRESETS, DType, KVFormat, PerHead, QuantSpec, parse_format
from kvpack.kernels.reference import dense_history, paged_attention_reference
from kvpack.outliers import (
    apply_residual,
    artifact_outlier_channels,
    dequantize_outliers,
    index_dtype,
    neutral_fill,
    outlier_mask,
    quantize_outliers,
    seal_time_channels,
    select_outlier_channels,
)
from kvpack.quant import dequantize, quantize
from kvpack.testing import assert_bitexact, assert_close, cpu_kernel_tolerance, random_paged_kv, realistic_keys, snr_db

L, H, D, B = 2, 2, 64, 16
FMT = parse_format(f"fp8-o4,block={B}")


def _keys(n_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return realistic_keys(n_blocks, H, B, D, generator=g)


# -- formats ------------------------------------------------------------------------------------------


def test_syntax_preset_and_round_trip():
    f = PRESETS["fp8-o4"]
    assert f.key.outliers == 4 and f.value.outliers == 0 and f.has_outliers
    assert parse_format("k=fp8:head:o4,v=fp8:head,sink=1") is f  # a custom string spelling the preset gets its name
    assert parse_format("k=fp8:head:o4,v=fp8:head") == f.with_sink(0)  # (its sink=1 included)
    assert parse_format(f.spec_string()) == f and str(f.key) == "fp8_e4m3:head:fp16:o4"
    g = parse_format("k=int8:channel:o8,v=int4:g32:asym,block=32")
    assert g.key.outliers == 8 and parse_format(g.spec_string()) == g
    assert parse_format("fp8-o4,block=16").key.outliers == 4


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("k=fp8:head,v=fp8:head:o4", "keys only"),
        ("kv=fp8:head:o4", "keys only"),
        ("k=fp8:head:o4:o2,v=fp8", "twice"),
        ("k=fp16:o4,v=fp16", "takes no fields"),
    ],
)
def test_bad_outlier_syntax_says_why(text, needle):
    with pytest.raises(FormatError, match=needle):
        parse_format(text)


def test_outlier_spec_validation():
    with pytest.raises(FormatError, match="keys only"):
        KVFormat(QuantSpec(DType.FP8_E4M3, PerHead()), QuantSpec(DType.FP8_E4M3, PerHead(), outliers=2))
    with pytest.raises(FormatError, match="full precision"):
        QuantSpec(DType.FP16, outliers=2)
    with pytest.raises(FormatError, match=">= 0"):
        QuantSpec(DType.FP8_E4M3, PerHead(), outliers=-1)
    f = parse_format("k=int8:channel:o16,v=int8:token")
    f.check(17)
    with pytest.raises(FormatError, match="fewer than 16"):
        f.check(16)


def test_bytes_counted_by_hand():
    f = PRESETS["fp8-o4"]  # block 64
    h, d, b, k = 2, 64, 64, 4
    key = h * b * d + h * 2 + h * b * k * 2 + h * k  # fp8 payload, fp16 scale per head, fp16 residuals, uint8 idx
    value = h * b * d + h * 2
    assert f.outlier_bytes(h, d) == h * b * k * 2 + h * k == 1032
    assert f.block_bytes(h, d) == key + value == 17424
    assert f.bytes_per_token(h, d, layers=2) == 2 * 17424 / 64 == 544.5
    assert f.bits_per_element(h, d) == 8 * 17424 / (2 * h * b * d)
    tail = 2 * h * b * d * 2
    sink = 2 * h * 1 * d * 2  # the preset's sink=1: one fp16 position of K and V
    assert f.bytes_for_tokens(130, h, d, layers=3) == 3 * (2 * 17424 + tail + sink)
    assert parse_format("fp8-o4,sink=0").bytes_for_tokens(130, h, d, layers=3) == 3 * (2 * 17424 + tail)
    # past head_dim 256 an index takes two bytes
    assert f.outlier_bytes(1, 512) == b * k * 2 + k * 2 and index_dtype(512) == torch.int16


def test_size_command_counts_the_outliers(capsys):
    from kvpack.cli.main import main

    argv = ["size", "--format", "fp8-o4", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "128"]
    assert main([*argv, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["formats"][0]
    assert row["format"] == "fp8-o4" and row["bytes_per_token"] == 544.5
    # 2 sealed blocks of 2 layers x 17424 bytes, plus the fp16 tail (one block of K and V per layer), plus the
    # preset's sink=1 (one fp16 position of K and V per layer)
    assert row["bytes_per_sequence"] == 2 * 2 * 17424 + 2 * (2 * 2 * 64 * 64 * 2) + 2 * (2 * 2 * 1 * 64 * 2)
    assert row["bits_per_element"] == pytest.approx(8 * 17424 / (2 * 2 * 64 * 64), abs=0)


# -- seal-level primitives ------------------------------------------------------------------------------


def test_seal_keeps_residuals_at_the_largest_channels():
    x = _keys(3)
    spec = FMT.key
    ob = quantize_outliers(x, spec)
    chans = seal_time_channels(x, 4)
    assert ob.idx.dtype == torch.uint8 and ob.idx.shape == (3, H, 4) and torch.equal(ob.idx.long(), chans)
    assert (chans.diff(dim=-1) > 0).all()  # ascending
    assert ob.residual.shape == (3, H, B, 4) and ob.residual.dtype == torch.float16
    # the scales are those of the neutrally filled block: they ignore the kept channels
    mask = outlier_mask(chans, x)
    filled = neutral_fill(x.float(), mask, spec)
    assert_bitexact(ob.qt.scale, quantize(filled, spec).scale, "scales")
    # the other channels hold their own codes; each kept element the fill's code or its own (clipped)
    codes_own = quantize(x, spec, ob.qt.scale).data.view(torch.uint8)
    codes_fill = quantize(filled, spec, ob.qt.scale).data.view(torch.uint8)
    stored = ob.qt.data.view(torch.uint8)
    assert torch.equal(stored[~mask], codes_own[~mask])
    assert ((stored == codes_own) | (stored == codes_fill))[mask].all()
    # residual = x - dequantize(payload) at the kept channels (fp16-rounded), and the reconstruction adds it
    base = dequantize(ob.qt)
    gidx = chans.unsqueeze(-2).expand(3, H, B, 4)
    assert torch.equal(ob.residual, (x.gather(-1, gidx) - base.gather(-1, gidx)).half())
    y = dequantize_outliers(ob)
    assert torch.equal(y, apply_residual(base, ob.residual, ob.idx))
    assert torch.equal(y.gather(-1, gidx), base.gather(-1, gidx) + ob.residual.float())
    assert snr_db(x, y) > snr_db(x, dequantize(quantize(x, spec))) + 6


def test_seal_with_given_channels_static_scales_and_bad_input():
    x = _keys(2)
    spec = parse_format("k=int8:channel:o3,v=int8:token").key
    chans = torch.tensor([[0, 5, 9], [1, 2, 60]])
    ob = quantize_outliers(x, spec, chans)
    assert torch.equal(ob.idx.long(), chans.expand(2, H, 3))  # calibrated channels copied into every block
    static = parse_format("k=int8:channel:static:o3,v=int8:token").key
    scale = torch.full((2, H, 1, D), 0.25, dtype=torch.float16)
    sb = quantize_outliers(x, static, chans, scale=scale)
    assert torch.equal(sb.qt.scale, scale)
    with pytest.raises(CalibrationError):  # a static spec never gets block-local scales silently
        quantize_outliers(x, static, chans)
    with pytest.raises(ShapeError):
        quantize_outliers(x, spec, torch.tensor([[0, D]] * H))
    bad = x.clone()
    bad[1, 0, 3, int(chans[0, 1])] = float("nan")  # inside a kept channel: must not be hidden by the fill
    with pytest.raises(NonFiniteError, match="position 3, channel 5"):
        quantize_outliers(bad, spec, chans)


def test_int16_indices_past_head_dim_256():
    x = torch.randn(1, 1, 8, 512)
    x[..., 300] *= 50
    ob = quantize_outliers(x, parse_format("k=fp8:head:o2,v=fp8").key)
    assert ob.idx.dtype == torch.int16 and 300 in ob.idx.flatten().tolist()
    assert snr_db(x, dequantize_outliers(ob)) > 30


# -- reference kernel and dispatcher -------------------------------------------------------------------


@pytest.mark.parametrize("sink", [0, 1], ids=["sink=0", "preset-sink=1"])
def test_random_paged_kv_and_reference_apply_the_residuals(sink):
    fmt = FMT.with_sink(sink)
    lens = [1, B - 1, B + 1, 3 * B + 5]
    kv, keys, values = random_paged_kv(fmt, lens, kv_heads=H, head_dim=D, seed=3)
    assert kv.sink == sink
    assert kv.k_outlier.dtype == torch.float16 and kv.k_outlier_idx.dtype == torch.uint8
    assert torch.isnan(kv.k_outlier[0]).all() and (kv.k_outlier_idx[0] == 0xFF).all()  # the null block: poisoned
    plain_fmt = parse_format(f"fp8-plain,block={B}").with_sink(sink)
    plain, _, _ = random_paged_kv(plain_fmt, lens, kv_heads=H, head_dim=D, seed=3)
    blocks_only = kernels.PagedKV(**{**kv.__dict__, "sink_k": None, "sink_v": None})  # a reader ignoring the sink
    for row, n in enumerate(lens):
        k, v = dense_history(kv, row)
        nb = n // B
        s = min(sink, nb * B)
        blocks = keys[row][:, : nb * B].reshape(H, nb, B, D).transpose(0, 1)
        expect = dequantize_outliers(quantize_outliers(blocks, FMT.key)).transpose(0, 1).reshape(H, nb * B, D)
        if s:
            # positions p < s read the sink rows exactly (the returned keys hold them); block 0 was sealed from
            # the rows the sink replaced, so its other rows are what a reader ignoring the sink gets, and every
            # later block is the re-quantization of the returned keys
            assert torch.equal(k[:, :s], keys[row][:, :s]) and torch.equal(v[:, :s], values[row][:, :s])
            assert torch.equal(k[:, s:B], dense_history(blocks_only, row)[0][:, s:B])
            assert not torch.equal(k[:, :s], dense_history(blocks_only, row)[0][:, :s])
            assert torch.equal(k[:, B : nb * B], expect[:, B:])
        else:
            assert torch.equal(k[:, : nb * B], expect)
        if nb:
            assert snr_db(keys[row], k) > snr_db(keys[row], dense_history(plain, row)[0]) + 6
    q = torch.randn(len(lens), 1, 4, D)
    out = paged_attention_reference(q, kv)
    assert torch.isfinite(out).all()
    ignored = paged_attention_reference(q, kernels.PagedKV(**{**kv.__dict__, "k_outlier": None}))
    assert (out - ignored).abs().max() > 1e-3  # the residuals matter


def test_dispatcher_names_the_outlier_reason(monkeypatch):
    kv, _, _ = random_paged_kv(FMT, [40, 7], kv_heads=H, head_dim=D)
    q = torch.randn(2, 4, D)
    assert kernels.backend_reasons("reference", q, kv) == []
    reasons = kernels.backend_reasons("cpu", q, kv)
    monkeypatch.setattr(kernels, "_warned", set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = kernels.decode_attention(q, kv)
    expected = paged_attention_reference(q.unsqueeze(1), kv)[:, 0]
    if kernels.BACKENDS["cpu"].capabilities.outliers:
        assert kernels.OUTLIER_REASON not in reasons
        assert_close(got, expected, *cpu_kernel_tolerance(kv))
    else:
        assert kernels.OUTLIER_REASON in reasons
        assert any(kernels.OUTLIER_REASON in str(x.message) for x in w)
        assert torch.equal(got, expected)
    # the same cache without outliers never gets the reason
    plain, _, _ = random_paged_kv(parse_format(f"fp8-plain,block={B}"), [40, 7], kv_heads=H, head_dim=D)
    assert kernels.OUTLIER_REASON not in kernels.backend_reasons("cpu", q, plain)


# -- the paged cache ------------------------------------------------------------------------------------


def _cache(fmt=FMT, **kw) -> PagedKVCache:
    return PagedKVCache(fmt, L, H, D, kw.pop("num_blocks", 32), **kw)


def _fill(cache, sids, k, v, chunks):
    t0 = 0
    for t in chunks:
        for layer in range(L):
            cache.append(layer, sids, k[:, :, t0 : t0 + t], v[:, :, t0 : t0 + t])
        t0 += t


def _kv(batch: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return realistic_keys(batch, H, n, D, generator=g), torch.randn(batch, H, n, D, generator=g)


def test_cache_seals_payload_scales_residuals_and_indices():
    cache = _cache()
    sids = [cache.add_sequence(), cache.add_sequence()]
    k, v = _kv(2, 3 * B + 5)
    _fill(cache, sids, k, v, [B + 3, 1, 1, B, B])  # prefill, decode steps, chunks crossing seals
    st = cache.storage
    for row, sid in enumerate(sids):
        ids = cache.slots.seqs[sid].blocks
        blocks = k[row, :, : 3 * B].reshape(H, 3, B, D).transpose(0, 1)
        ob = quantize_outliers(blocks, FMT.key)
        for layer in range(L):
            assert_bitexact(st.k_data[layer, ids], ob.qt.data, "payload")
            assert_bitexact(st.k_scale[layer, ids], ob.qt.scale, "scales")
            assert_bitexact(st.k_outlier[layer, ids], ob.residual, "residuals")
            assert_bitexact(st.k_outlier_idx[layer, ids], ob.idx, "indices")
            kd, _ = cache.dense(layer, sid)
            expect = dequantize_outliers(ob).transpose(0, 1).reshape(H, 3 * B, D)
            expect[:, : FMT.sink] = k[row, :, : FMT.sink]  # the preset's sink=1: position 0 exact (fp32 tail)
            assert FMT.sink == 1 and not torch.equal(expect[:, :1], dequantize_outliers(ob)[0, :, :1])
            assert torch.equal(kd[:, : 3 * B], expect)
            assert torch.equal(kd[:, 3 * B :], k[row, :, 3 * B :])
        view = cache.view(0, [sid])
        assert view.k_outlier is not None and view.k_outlier.data_ptr() == st.k_outlier[0].data_ptr()
    report = cache.memory_report()
    t = report.total
    assert t.outlier_bytes == report.used_blocks * L * FMT.outlier_bytes(H, D) > 0
    assert (
        t.used_bytes == t.theoretical_bytes == 2 * FMT.bytes_for_tokens(3 * B + 5, H, D, layers=L, tail_element_bytes=4)
    )
    assert "outliers" in str(report) and cache.problems() == []


def test_fork_prefix_sharing_and_crop_keep_the_residuals():
    cache = _cache()
    a = cache.add_sequence(list(range(2 * B + 3)))
    k, v = _kv(1, 2 * B + 3)
    _fill(cache, [a], k, v, [2 * B + 3])
    b = cache.fork(a)
    # shared blocks share payload, residuals and indices
    assert cache.slots.seqs[b].blocks == cache.slots.seqs[a].blocks
    c = cache.add_sequence(list(range(2 * B + 3)))
    assert cache.cached_prefix_len(c) == 2 * B and cache.slots.seqs[c].blocks == cache.slots.seqs[a].blocks[:2]
    for layer in range(L):
        assert torch.equal(cache.dense(layer, b)[0], cache.dense(layer, a)[0])
    # crop inside the second sealed block: its kept tokens go back to the tail WITH the residuals
    before = [cache.dense(layer, b)[0] for layer in range(L)]
    cache.crop(b, B + 5)
    for layer in range(L):
        kd, _ = cache.dense(layer, b)
        assert torch.equal(kd, before[layer][:, : B + 5])  # fp32 tail: the reconstruction exactly
    # and sealing the refilled tail again uses the reconstructed values
    k2, v2 = _kv(1, B, seed=5)
    _fill(cache, [b], k2, v2, [B])
    assert cache.problems() == []


def test_offload_restore_bit_identical_with_residuals():
    cache = _cache()
    sid = cache.add_sequence()
    k, v = _kv(1, 3 * B + 2)
    _fill(cache, [sid], k, v, [3 * B + 2])
    before = {n: t[:, cache.slots.seqs[sid].blocks].clone() for n, t in cache.storage.pools().items()}
    assert {"k_outlier", "k_outlier_idx"} <= set(before)
    moved = cache.offload(sid)
    assert moved == 3 * L * FMT.block_bytes(H, D)
    assert cache.memory_report().total.host_bytes == moved
    assert cache.restore(sid) == moved
    for name, t in cache.storage.pools().items():
        assert_bitexact(t[:, cache.slots.seqs[sid].blocks], before[name], name)
    assert cache.problems() == []


def test_non_finite_in_a_kept_channel_is_reported_and_nothing_changes():
    cache = _cache()
    sid = cache.add_sequence()
    k, v = _kv(1, B + 1)
    ch = int(seal_time_channels(k[0, :, :B], 4)[1, 2])
    k[0, 1, 7, ch] = float("inf")  # the largest channel: exactly what an outlier choice would pick
    with pytest.raises(NonFiniteError, match="position 7"):
        cache.append(0, [sid], k, v)
    assert cache.seq_len(sid) == 0 and cache.pool.num_used == 0


def _artifact(fmt, seed=0) -> Artifact:
    g = torch.Generator().manual_seed(seed)
    obs = KVObserver((99.0,))
    for layer in range(L):
        obs.observe(layer, realistic_keys(2, H, 64, D, generator=g), torch.randn(2, H, 64, D, generator=g))
    fingerprint = {"num_layers": L, "kv_heads": H, "head_dim": D}
    return Artifact.build(*obs.stats(), fmt, fingerprint, {"name": "synthetic"})


def test_calibrated_channels_are_copied_into_every_block():
    art = _artifact(FMT)
    chans = artifact_outlier_channels(art, 4, L, H, D)
    assert torch.equal(chans[1], select_outlier_channels(art.keys.absmax[1], 4))
    cache = _cache(calibration=art)
    seal_time = _cache()
    sid, other = cache.add_sequence([1] * (2 * B)), seal_time.add_sequence([1] * (2 * B))
    k, v = _kv(1, 2 * B, seed=9)  # other outlier channels than the calibration's
    _fill(cache, [sid], k, v, [2 * B])
    _fill(seal_time, [other], k, v, [2 * B])
    ids = cache.slots.seqs[sid].blocks
    for layer in range(L):
        assert torch.equal(cache.storage.k_outlier_idx[layer, ids].long(), chans[layer].expand(2, H, 4))
        blocks = k[0, :, : 2 * B].reshape(H, 2, B, D).transpose(0, 1)
        assert_bitexact(cache.storage.k_outlier[layer, ids], quantize_outliers(blocks, FMT.key, chans[layer]).residual)
    assert cache.salt != seal_time.salt  # blocks sealed with other channels are never shared
    with pytest.raises(CalibrationError, match="another model"):
        PagedKVCache(FMT, L + 1, H, D, 8, calibration=art)
    with pytest.raises(CalibrationError, match="ignored"):  # a format with neither static nor outliers
        PagedKVCache(parse_format(f"fp8-plain,block={B}"), L, H, D, 8, calibration=art)


def test_static_scales_and_outliers_together():
    fmt = parse_format(f"k=int8:channel:static:o4,v=int8:token,block={B}")
    art = _artifact(fmt)
    with pytest.raises(CalibrationError, match="static"):
        _cache(fmt)  # fail closed: no artifact
    cache = _cache(fmt, calibration=art, clip_threshold=1.0)  # other data than calibrated: clipping expected
    sid = cache.add_sequence()
    k, v = _kv(1, 2 * B + 1, seed=2)
    _fill(cache, [sid], k, v, [2 * B + 1])
    chans = artifact_outlier_channels(art, 4, L, H, D)
    scales = art.scales_for(fmt).key
    ids = cache.slots.seqs[sid].blocks
    for layer in range(L):
        blocks = k[0, :, : 2 * B].reshape(H, 2, B, D).transpose(0, 1)
        want = scales.layer(layer).scale.unsqueeze(0).expand(2, H, 1, D)
        ob = quantize_outliers(blocks, fmt.key, chans[layer], scale=want)
        assert_bitexact(cache.storage.k_scale[layer, ids], ob.qt.scale, "static scales")
        assert_bitexact(cache.storage.k_data[layer, ids], ob.qt.data, "payload")
        assert_bitexact(cache.storage.k_outlier[layer, ids], ob.residual, "residuals")
    t = cache.memory_report().total
    assert t.used_bytes == t.theoretical_bytes


# -- the transformers integration ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=H,
        head_dim=D,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # persistent large key channels, as trained models have: outliers to keep
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight.view(H, D, -1)
            w[:, [3, 40]] *= 12.0
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from a second thread on a shared box
    yield model
    torch.set_num_threads(n)
    model.set_attn_implementation("sdpa")


def _teacher_forced(model, cache, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``[1, steps, vocab]`` predicting ``seq[prompt_len:]``: prefill, then one token per step."""
    from kvpack.integrations.transformers import cache_kwarg

    kw = {cache_kwarg(model): cache}
    out = model(input_ids=seq[:, :prompt_len], **kw)
    logits = [out.logits[:, -1]]
    for i in range(prompt_len, seq.shape[1] - 1):
        out = model(input_ids=seq[:, i : i + 1], **kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@torch.inference_mode()
def test_hf_generation_equals_the_simulated_reconstruction(tiny_llama, monkeypatch):
    import kvpack.hf
    from kvpack.evaluation.simulate import SimulatedCache
    from kvpack.integrations import hf_attention as hfa
    from kvpack.kernels import cpu_decode

    model = tiny_llama
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 256, (1, 3 * B + 30), generator=g)
    prompt = B + 5

    def simulated(fmt):
        model.set_attn_implementation("sdpa")
        return _teacher_forced(model, SimulatedCache([fmt] * L), seq, prompt)

    expected = simulated(FMT)
    monkeypatch.setattr(kernels, "_warned", set())
    # the float path, whose values are the reconstruction's exactly; the integer path's fp8 rounding is bounded
    # against the reference in tests/test_kernel_cpu.py, this test is about the cache feeding the kernel
    monkeypatch.setattr(cpu_decode, "INT_DOT", False)
    # and the exact chunk path (the fused chunk kernel rounds weights and values to bf16, 2e-3 here: the size of
    # the residuals' effect this test measures; its own accuracy is bounded in tests/test_kernel_cpu_chunk.py)
    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cache = kvpack.hf.cache_for(model, FMT, max_tokens=256)
        got = _teacher_forced(model, cache, seq, prompt)
    assert cache.paged.storage.k_outlier is not None
    assert_close(got, expected, atol=1e-5, rtol=1e-5)  # measured 3e-7: the same values, another kernel
    # the residuals matter at this tolerance: plain fp8 lands far outside it (measured 2.5e-3)
    assert (simulated(parse_format(f"fp8-plain,block={B}")) - expected).abs().max() > 1e-4
    outlier_warnings = [x for x in w if kernels.OUTLIER_REASON in str(x.message)]
    if kernels.BACKENDS["cpu"].capabilities.outliers:
        assert cache.decode_backends.get("cpu", 0) > 0 and not outlier_warnings
    else:  # until the CPU kernel applies the residuals, decode falls back to the reference, once warned
        assert cache.decode_backends.get("reference", 0) > 0 and len(outlier_warnings) == 1
    # greedy generation: the same tokens either way
    ids = seq[:, :prompt]
    kv_out = model.generate(
        input_ids=ids,
        max_new_tokens=12,
        do_sample=False,
        **{kvpack.hf.cache_kwarg(model): kvpack.hf.cache_for(model, FMT, max_tokens=256)},
    )
    model.set_attn_implementation("sdpa")
    sim_out = model.generate(
        input_ids=ids, max_new_tokens=12, do_sample=False, **{kvpack.hf.cache_kwarg(model): SimulatedCache([FMT] * L)}
    )
    assert torch.equal(kv_out, sim_out)


def test_hf_calibration_argument(tiny_llama, tmp_path):
    import kvpack.hf
    from kvpack.calibration.fingerprint import fingerprint_from_config

    model = tiny_llama
    g = torch.Generator().manual_seed(0)
    obs = KVObserver((99.0,))
    for layer in range(L):
        obs.observe(layer, realistic_keys(1, H, 64, D, generator=g), torch.randn(1, H, 64, D, generator=g))
    art = Artifact.build(*obs.stats(), FMT, fingerprint_from_config(model.config), {"name": "synthetic"})
    art.save(tmp_path)
    for calibration in (tmp_path, str(tmp_path), art):
        cache = kvpack.hf.cache_for(model, FMT, max_tokens=128, calibration=calibration)
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 256, (1, B + 2), generator=g), **{kvpack.hf.cache_kwarg(model): cache})
        want = artifact_outlier_channels(art, 4, L, H, D)
        blocks = cache.paged.slots.seqs[cache.seq_ids[0]].blocks
        assert torch.equal(cache.paged.storage.k_outlier_idx[:, blocks].long(), want.unsqueeze(1))
    # fail closed, before the model runs
    with pytest.raises(CalibrationError, match="static"):
        kvpack.hf.cache_for(model, f"k=int8:channel:static,v=int8:token,block={B}")
    other = Artifact.build(*obs.stats(), FMT, {**fingerprint_from_config(model.config), "vocab_size": 7}, {})
    with pytest.raises(CalibrationError, match="another model"):
        kvpack.hf.cache_for(model, FMT, calibration=other)
    with pytest.raises(CalibrationError, match="ignored"):
        kvpack.hf.cache_for(model, f"int8,block={B}", calibration=art)
