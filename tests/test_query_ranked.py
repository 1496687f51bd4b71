"""Outlier key channels ranked by the queries (``o<N>q``): the syntax, the ranking, the query statistics a
calibration artifact carries, and the cache, the transformers integration, the evaluation and the vLLM layer that
take them. Nothing falls back silently: a query-ranked format without the statistics is refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load, save

from kvpack.cache import PagedKVCache
from kvpack.cache.write import seal_outliers
from kvpack.calibration import Artifact, KVObserver, load_artifact
from kvpack.calibration.artifact import MANIFEST_NAME, TENSORS_NAME, _manifest_digest
from kvpack.errors import CalibrationError, ConfigError, FormatError, NonFiniteError, ShapeError
from kvpack.formats import DType, PerChannel, QuantSpec, parse_format
from kvpack.outliers import apply_residual, query_ranked_channels, seal_time_channels
from kvpack.quant import dequantize
from kvpack.testing import assert_bitexact, realistic_keys

L, H, D, B = 2, 2, 64, 16
FMT = parse_format(f"k=int4:channel:asym:o2q,v=int4:g32:asym,block={B}")
DATA = {"name": "test", "samples": 2, "seq_len": 64, "seed": 0, "tokens_sha256": "0" * 64}
FINGERPRINT = {"num_layers": L, "kv_heads": H, "head_dim": D}


def _artifact(queries: bool = True, seed: int = 0, fmt=FMT) -> Artifact:
    """Keys, values and (``queries``) queries of two query heads per kv head, whose energy differs per channel."""
    g = torch.Generator().manual_seed(seed)
    obs = KVObserver(())
    for layer in range(L):
        obs.observe(layer, realistic_keys(2, H, 64, D, generator=g), torch.randn(2, H, 64, D, generator=g))
        if queries:
            gain = torch.rand(D, generator=g) * 3
            obs.observe_queries(layer, torch.randn(2, 2 * H, 64, D, generator=g) * gain, H)
    return Artifact.build(*obs.stats(), fmt, FINGERPRINT, DATA, query_energy=obs.query_energy())


# -- syntax -----------------------------------------------------------------------------------------------------


def test_syntax_round_trip_and_bytes():
    f = parse_format("k=int4:channel:asym:o2q,v=int4:g32:asym")
    assert f.key.outliers == 2 and f.key.query_ranked and f.query_ranked and not f.value.query_ranked
    assert str(f.key) == "int4:channel:asym:fp16:o2q" and parse_format(f.spec_string()) == f
    by_range = parse_format("k=int4:channel:asym:o2,v=int4:g32:asym")
    assert not by_range.query_ranked and by_range != f
    assert f.block_bytes(H, D) == by_range.block_bytes(H, D)  # the ranking costs no byte
    assert parse_format("k=fp8:head:outliers4q,v=fp8:head").key.query_ranked
    with pytest.raises(FormatError, match="keys only"):
        parse_format("k=int4,v=int4:o2q")
    with pytest.raises(FormatError, match="N > 0"):
        parse_format("k=int4:o0q,v=int4")
    with pytest.raises(FormatError, match="keeps none"):
        QuantSpec(DType.INT4, PerChannel(), symmetric=False, query_ranked=True)
    with pytest.raises(FormatError, match="'rot' cannot be combined"):
        parse_format("k=fp8:head:o2q:rot,v=fp8")


# -- the ranking -------------------------------------------------------------------------------------------------


def test_ranking_weighs_each_channels_spread_by_the_queries():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, B, D, generator=g)
    x[..., 5] *= 20  # the widest channel
    flat = torch.ones(H, D)
    # the same energy everywhere: the widest channels (range for asymmetric specs, abs-max for symmetric ones)
    assert torch.equal(query_ranked_channels(x, 2, flat, symmetric=True), seal_time_channels(x, 2))
    by_range = (x.amax(-2) - x.amin(-2)).topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(query_ranked_channels(x, 2, flat, symmetric=False), by_range)
    # channel 9 read 1000x more than the others is kept though narrow; channel 5, which no query reads, is not
    energy = flat.clone()
    energy[:, 9], energy[:, 5] = 1e3, 0.0
    ch = query_ranked_channels(x, 2, energy, symmetric=False)
    assert ch.shape == (3, H, 2) and bool((ch == 9).any(-1).all()) and not bool((ch == 5).any())
    assert bool((ch[..., :1] < ch[..., 1:]).all())  # ascending, as the pages store them
    # no query reads anything: the ties fall to the wider channels
    assert torch.equal(query_ranked_channels(x, 2, torch.zeros(H, D), symmetric=False), by_range)
    with pytest.raises(ShapeError, match="query energy"):
        query_ranked_channels(x, 2, torch.ones(H + 1, D), symmetric=False)
    with pytest.raises(ShapeError, match="k must be"):
        query_ranked_channels(x, D + 1, flat, symmetric=False)


def test_the_queries_see_less_error_than_with_the_widest_channels_kept():
    """The point of the ranking: with keys whose widest channels no query reads and whose read channels are narrower,
    the score error ``E[(q . (k - k_hat))^2] = sum_c E[q_c^2] err_c^2`` falls when the queries rank the channels."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, H, B, D, generator=g)
    x[..., :4] *= 8.0  # wide, barely read
    x[..., 10:14] *= 3.0  # narrower, read
    energy = torch.ones(H, D)
    energy[:, :4], energy[:, 10:14] = 0.01, 10.0
    by_range = parse_format(f"k=int4:channel:asym:o4,v=int4:g32:asym,block={B}").key
    by_query = parse_format(f"k=int4:channel:asym:o4q,v=int4:g32:asym,block={B}").key

    def score_error(spec, e=None):
        qt, _, (residual, idx) = seal_outliers(x, spec, None, None, e)
        err = apply_residual(dequantize(qt, torch.float32), residual, idx) - x
        return float((energy[:, None, :] * err.square()).sum(-1).mean())

    ranked, widest = score_error(by_query, energy), score_error(by_range)
    assert ranked < 0.5 * widest, (ranked, widest)
    with pytest.raises(CalibrationError, match="no query statistics"):
        seal_outliers(x, by_query)  # never a silent fall-back to the range ranking


# -- the statistics --------------------------------------------------------------------------------------------


def test_observer_refuses_bad_queries_and_records_nothing():
    obs = KVObserver(())
    q = torch.randn(1, 4, 8, D)
    with pytest.raises(ShapeError, match="split"):
        obs.observe_queries(0, q, 3)
    with pytest.raises(ShapeError, match="float tensor"):
        obs.observe_queries(0, q[0], 2)
    bad = q.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="layer 0"):
        obs.observe_queries(0, bad, 2)
    assert obs.query_energy() is None
    obs.observe_queries(0, q, 2)
    with pytest.raises(ShapeError, match="one observer per model"):
        obs.observe_queries(0, torch.randn(1, 4, 8, D // 2), 2)
    torch.testing.assert_close(obs.query_energy()[0], q.pow(2).reshape(1, 2, 2, 8, D).mean(dim=(0, 2, 3)))
    obs.observe_queries(2, q, 2)  # layer 1 never seen: statistics with a hole are refused
    with pytest.raises(CalibrationError, match=r"layers \[1\]"):
        obs.query_energy()


def test_artifact_round_trip_and_older_artifacts(tmp_path):
    art = _artifact()
    art.save(tmp_path / "a")
    back = load_artifact(tmp_path / "a")
    assert torch.equal(back.query_energy, art.query_energy) and back.query_energy.shape == (L, H, D)
    assert torch.equal(art.rescaled("int8@static").query_energy, art.query_energy)
    _artifact(queries=False).save(tmp_path / "b")  # as kvpack wrote them before queries were observed
    assert load_artifact(tmp_path / "b").query_energy is None
    with pytest.raises(CalibrationError, match="query statistics have shape"):
        Artifact.build(art.keys, art.values, FMT, FINGERPRINT, DATA, query_energy=torch.ones(L, H, D + 1))


def _tamper(d, change) -> None:
    """Change the tensors and re-sign both checksums: what is tested is the validation, not the signature."""
    tensors = load((d / TENSORS_NAME).read_bytes())
    change(tensors)
    blob = save(tensors)
    (d / TENSORS_NAME).write_bytes(blob)
    m = json.loads((d / MANIFEST_NAME).read_text())
    m["tensors"]["sha256"] = hashlib.sha256(blob).hexdigest()
    m["manifest_sha256"] = _manifest_digest(m)
    (d / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t["queries.energy"].__setitem__((0, 0, 3), -1.0), "below 0"),
        (lambda t: t["queries.energy"].__setitem__((1, 1, 1), float("inf")), "non-finite"),
        (lambda t: t.__setitem__("queries.energy", t["queries.energy"][:, :1].contiguous()), "queries.energy is"),
        (lambda t: t.__setitem__("queries.energy", t["queries.energy"].double()), "queries.energy is"),
    ],
    ids=["negative", "inf", "shape", "dtype"],
)
def test_tampered_query_statistics_are_refused(tmp_path, change, needle):
    _artifact().save(tmp_path)
    _tamper(tmp_path, change)
    with pytest.raises(CalibrationError, match=needle):
        load_artifact(tmp_path)


# -- the cache ---------------------------------------------------------------------------------------------------


def test_cache_ranks_every_block_by_the_artifacts_queries():
    art = _artifact()
    for calibration, needle in ((None, "got none"), (_artifact(queries=False), "holds no query statistics")):
        with pytest.raises(CalibrationError, match=needle) as e:
            PagedKVCache(FMT, L, H, D, 8, calibration=calibration)
        assert "kvpack calibrate" in str(e.value)
    with pytest.raises(CalibrationError, match="another model"):
        PagedKVCache(FMT, L + 1, H, D, 8, calibration=art)
    cache = PagedKVCache(FMT, L, H, D, 16, calibration=art)
    g = torch.Generator().manual_seed(3)
    k, v = realistic_keys(1, H, 2 * B + 3, D, generator=g), torch.randn(1, H, 2 * B + 3, D, generator=g)
    sid = cache.add_sequence()
    for layer in range(L):
        cache.append(layer, [sid], k, v)
    ids = cache.slots.seqs[sid].blocks
    for layer in range(L):
        blocks = k[0, :, : 2 * B].reshape(H, 2, B, D).transpose(0, 1)  # [2, H, B, D]
        energy = art.query_energy[layer]
        want = query_ranked_channels(blocks, 2, energy, symmetric=False)
        assert torch.equal(cache.storage.k_outlier_idx[layer, ids].long(), want)
        _, _, (residual, _) = seal_outliers(blocks, FMT.key, None, None, energy)
        assert_bitexact(cache.storage.k_outlier[layer, ids], residual, f"residuals of layer {layer}")
    assert not torch.equal(want, seal_time_channels(blocks, 2)), "the test keys must rank differently by range"
    # blocks ranked by other statistics may hold other channels: never shared through the prefix cache
    assert PagedKVCache(FMT, L, H, D, 8, calibration=_artifact(seed=1)).salt != cache.salt


# -- transformers, the evaluation, vLLM ----------------------------------------------------------------------------


def _tiny_artifact(model) -> Artifact:
    from kvpack.calibration.fingerprint import fingerprint_from_config
    from kvpack.calibration.run import observe_model

    obs = KVObserver(())
    ids = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    observe_model(model, ids, obs)
    fp = fingerprint_from_config(model.config)
    return Artifact.build(*obs.stats(), "int8@static", fp, DATA, query_energy=obs.query_energy())


def _geometry(model) -> tuple[int, int, int]:
    cfg = model.config
    return (
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads),
    )


def test_hf_cache_equals_the_simulated_reconstruction(tiny, tmp_path, monkeypatch):
    """Teacher-forced logits through kvpack's cache and kernels equal the simulate engine's, both ranking the outlier
    channels by the same artifact; without the artifact both refuse."""
    import kvpack.hf
    from kvpack.evaluation.simulate import SimulatedCache
    from kvpack.integrations import hf_attention as hfa
    from kvpack.kernels import cpu_decode

    model, _ = tiny
    layers, kv_heads, head_dim = _geometry(model)
    fmt = parse_format(f"k=int4:channel:asym:o{head_dim // 16}q,v=int4:g32:asym,block={B}")
    art = _tiny_artifact(model)
    art.save(tmp_path)
    seq = torch.randint(0, model.config.vocab_size, (1, 3 * B + 9), generator=torch.Generator().manual_seed(5))
    key = kvpack.hf.cache_kwarg(model)

    def logits(cache):
        with torch.inference_mode():
            return model(input_ids=seq, **{key: cache}).logits

    model.set_attn_implementation("sdpa")
    want = logits(SimulatedCache([fmt] * layers, query_energy=art.query_energy))
    by_range = parse_format(fmt.spec_string().replace("q,", ",", 1))
    assert not by_range.query_ranked
    model.set_attn_implementation("sdpa")
    assert (logits(SimulatedCache([by_range] * layers)) - want).abs().max() > 0.1  # the ranking matters here
    monkeypatch.setattr(cpu_decode, "INT_DOT", False)  # the float path: the reconstruction's values exactly
    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    cache = kvpack.hf.cache_for(model, fmt, max_tokens=256, calibration=str(tmp_path))
    got = logits(cache)
    # measured 3.2e-5 (one prefill: another summation order); ranking by range instead moves the logits by 1.7
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    blocks = cache.paged.slots.seqs[cache.seq_ids[0]].blocks
    assert cache.paged.storage.k_outlier_idx[:, blocks].shape == (layers, 3, kv_heads, head_dim // 16)
    with pytest.raises(CalibrationError, match="kvpack calibrate"):
        kvpack.hf.cache_for(model, fmt, max_tokens=256)
    with pytest.raises(ConfigError, match="query statistics"):
        SimulatedCache([fmt] * layers)


def test_evaluation_refuses_a_query_ranked_format_without_an_artifact(tiny):
    from kvpack.evaluation.runner import Runner, wrap

    model, tok = tiny
    fmt = f"k=int4:channel:asym:o2q,v=int4:g32:asym,block={B}"
    with pytest.raises(ConfigError, match="kvpack calibrate"):
        Runner(wrap(model, tok, "tiny"), engine="simulate").cache(fmt, 64)
    art = _tiny_artifact(model)
    runner = Runner(wrap(model, tok, "tiny"), engine="simulate", calibration=art)
    cache = runner.cache(fmt, 64)
    assert torch.equal(cache.layers[1].key_energy, art.query_energy[1])
    older = Artifact.build(art.keys, art.values, "int8@static", art.fingerprint, DATA)
    with pytest.raises(CalibrationError, match="no query statistics"):
        Runner(wrap(model, tok, "tiny"), engine="simulate", calibration=older).cache(fmt, 64)


def test_vllm_layer_takes_its_heads_share_of_the_statistics(tmp_path):
    from kvpack.integrations.vllm.calibration import calibration_reasons, layer_calibration
    from kvpack.plans import parse_plan

    heads = 4
    g = torch.Generator().manual_seed(0)
    obs = KVObserver(())
    for layer in range(L):
        obs.observe(layer, torch.randn(1, heads, 32, D, generator=g), torch.randn(1, heads, 32, D, generator=g))
        obs.observe_queries(layer, torch.randn(1, 2 * heads, 32, D, generator=g), heads)
    fp = {**FINGERPRINT, "kv_heads": heads}
    Artifact.build(*obs.stats(), FMT, fp, DATA, query_energy=obs.query_energy()).save(tmp_path / "with")
    Artifact.build(*obs.stats(), FMT, fp, DATA).save(tmp_path / "without")
    cpu = torch.device("cpu")
    whole = layer_calibration(str(tmp_path / "with"), FMT, 1, heads, D, cpu)
    part = layer_calibration(str(tmp_path / "with"), FMT, 1, 2, D, cpu, heads=(2, 4))
    assert torch.equal(whole.energy, obs.query_energy()[1]) and whole.channels is None
    assert torch.equal(part.energy, whole.energy[2:4])
    plan = parse_plan(FMT.spec_string())
    assert any("queries' statistics" in r for r in calibration_reasons(None, plan, None))
    assert any("no query statistics" in r for r in calibration_reasons(None, plan, str(tmp_path / "without")))
    assert calibration_reasons(None, plan, str(tmp_path / "with")) == []
    with pytest.raises(ConfigError, match="queries' statistics"):
        layer_calibration(None, FMT, 1, heads, D, cpu)


def test_a_per_layer_plan_gives_each_part_its_layers_rows(tiny, tmp_path, monkeypatch):
    """A plan with query-ranked layers takes the artifact: the part holding them ranks by those layers' rows (the
    logits equal the simulate engine's with the same plan), and the artifact is checked before the model runs."""
    import kvpack.hf
    from kvpack.evaluation.runner import Runner, wrap
    from kvpack.evaluation.simulate import SimulatedCache
    from kvpack.integrations import hf_attention as hfa
    from kvpack.kernels import cpu_decode
    from kvpack.plans import parse_plan

    model, tok = tiny
    layers, _, head_dim = _geometry(model)
    ranked = f"k=int4:channel:asym:o{head_dim // 16}q,v=int4:g32:asym,block={B}"
    plan = f"int4,block={B}/{ranked}[1]"
    art = _tiny_artifact(model)
    sub = art.select_layers([1])
    assert torch.equal(sub.query_energy, art.query_energy[1:]) and torch.equal(sub.keys.absmax, art.keys.absmax[1:])
    assert sub.fingerprint["num_layers"] == 1 and sub.key_scales.scale.shape[0] == 1
    with pytest.raises(CalibrationError, match="cannot select"):
        art.select_layers([layers])
    seq = torch.randint(0, model.config.vocab_size, (1, 3 * B + 9), generator=torch.Generator().manual_seed(6))
    key = kvpack.hf.cache_kwarg(model)

    def logits(cache):
        with torch.inference_mode():
            return model(input_ids=seq, **{key: cache}).logits

    formats = parse_plan(plan).formats(layers)
    model.set_attn_implementation("sdpa")
    want = logits(SimulatedCache(formats, query_energy=art.query_energy))
    monkeypatch.setattr(cpu_decode, "INT_DOT", False)
    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    got = logits(kvpack.hf.cache_for(model, plan, max_tokens=256, calibration=art))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the rows must be the part's layers': ranked by layer 0's statistics, the same plan gives other logits
    swapped = art.query_energy.clone()
    swapped[1] = art.query_energy[0]
    model.set_attn_implementation("sdpa")
    assert (logits(SimulatedCache(formats, query_energy=swapped)) - want).abs().max() > 1e-3
    with pytest.raises(CalibrationError, match="kvpack calibrate"):
        kvpack.hf.cache_for(model, plan, max_tokens=256)
    with pytest.raises(CalibrationError, match="would be ignored"):
        kvpack.hf.cache_for(model, f"int4,block={B}/int8,block={B}[1]", max_tokens=256, calibration=art)
    # the evaluation hands the artifact to plans with query-ranked layers, in both engines
    simulated = Runner(wrap(model, tok, "tiny"), engine="simulate", calibration=art).cache(plan, 64)
    assert simulated.layers[0].key_energy is None and torch.equal(simulated.layers[1].key_energy, art.query_energy[1])
    assert Runner(wrap(model, tok, "tiny"), engine="kvpack", calibration=art).cache(plan, 64).calibration is art
    for engine in ("simulate", "kvpack"):
        with pytest.raises(ConfigError, match="kvpack calibrate"):
            Runner(wrap(model, tok, "tiny"), engine=engine).cache(plan, 64)
