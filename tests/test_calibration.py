"""Observer statistics, fingerprints and the artifact: save, load, and every way it is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvpack.calibration import (
    Artifact,
    KVObserver,
    diff_fingerprints,
    fingerprint_from_config,
    load_artifact,
)
from kvpack.calibration.artifact import MANIFEST_NAME, TENSORS_NAME
from kvpack.calibration.observer import NUM_BINS, bin_upper_edges, magnitude_bins
from kvpack.errors import CalibrationError, ConfigError, NonFiniteError, ShapeError

LAYERS, H, D = 3, 2, 16


def _config(**over):
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": H,
        "hidden_size": 4 * D,
        "head_dim": D,
        "vocab_size": 100,
        "rope_theta": 10000.0,
    }
    cfg.update(over)
    return cfg


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 3):  # two batches of different size, so accumulation across calls is exercised
        k = torch.randn(n, H, 40, D, generator=g) * torch.linspace(0.5, 8, D)
        v = torch.randn(n, H, 40, D, generator=g)
        out.append((k, v))
    return out


def _observed(percentiles=(99.0, 99.9)):
    obs = KVObserver(percentiles)
    data = _batches()
    for layer in range(LAYERS):
        for k, v in data:
            obs.observe(layer, k * (layer + 1), v)
    return obs, data


def _per_channel(ts):
    """[B, H, T, D] batches -> [H, D, N] all values per channel."""
    return torch.cat([t.permute(1, 3, 0, 2).reshape(H, D, -1) for t in ts], -1)


# -- observer -------------------------------------------------------------------------------------------


def test_observer_statistics_match_direct_computation():
    obs, data = _observed()
    keys, values = obs.stats()
    for layer in range(LAYERS):
        allk = _per_channel([k * (layer + 1) for k, _ in data])
        torch.testing.assert_close(keys.absmax[layer], allk.abs().amax(-1))
        torch.testing.assert_close(keys.min[layer], allk.amin(-1))
        torch.testing.assert_close(keys.max[layer], allk.amax(-1))
        torch.testing.assert_close(keys.rms[layer], allk.double().pow(2).mean(-1).sqrt().float())
        assert int(keys.tokens[layer]) == allk.shape[-1] == 8 * 40
    allv = _per_channel([v for _, v in data])
    torch.testing.assert_close(values.absmax[1], allv.abs().amax(-1))


def test_percentile_is_an_upper_bound_within_one_bin():
    obs, data = _observed((50.0, 99.0, 99.9))
    keys, _ = obs.stats()
    allk = _per_channel([k for k, _ in data]).abs().sort(-1).values  # layer 0
    n = allk.shape[-1]
    for p in (50.0, 99.0, 99.9):
        rank = math.ceil(p / 100 * n) - 1  # nearest-rank definition
        true = allk[..., rank]
        est = keys.percentiles[p][0]
        assert (est >= true).all(), p
        assert (est <= true * (1 + 1 / 32) + 1e-12).all(), p
        assert (est <= keys.absmax[0]).all()
    assert (keys.percentiles[50.0][0] < keys.percentiles[99.9][0]).all()


def test_histogram_bins_follow_the_float_exponent():
    edges = bin_upper_edges()
    assert edges.shape == (NUM_BINS,) and torch.isinf(edges[-1])
    x = torch.tensor([1.0, 1.0 + 1 / 64, 1.0 + 1 / 32, 2.0, 3e-9, 1e9])
    b = magnitude_bins(x)
    assert b[0] == b[1] and b[2] == b[0] + 1 and b[3] == b[0] + 32
    assert b[4] == 0 and b[5] == NUM_BINS - 1
    assert edges[b[0]] == 1.0 + 1 / 32  # upper edge of [1, 1 + 1/32)


def _rope(x, positions, theta=10000.0):
    """Rotate-half RoPE of x [T, D] at the given positions (the Llama convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_rope_pair_bound_covers_positions_beyond_calibration():
    g = torch.Generator().manual_seed(1)
    # pre-RoPE keys with a persistent offset per channel (what makes key channels stable)
    pre = torch.randn(256, D, generator=g) * 0.3 + torch.linspace(-3, 3, D)
    calib = _rope(pre[:128], torch.arange(128))
    later = _rope(pre[128:], torch.arange(5000, 5128))  # positions calibration never saw
    obs = KVObserver(())
    obs.observe(0, calib.reshape(1, 1, 128, D), calib.reshape(1, 1, 128, D))
    keys, _ = obs.stats()
    absmax, pair = keys.absmax[0, 0], keys.pair_absmax[0, 0]
    assert (pair >= absmax).all()
    beyond_absmax = int((later.abs() > absmax).sum())
    beyond_pair = int((later.abs() > pair * 1.05).sum())
    assert beyond_absmax > 20, "the abs-max of early positions should not cover late positions"
    assert beyond_pair == 0
    assert keys.magnitude("rope") is keys.pair_absmax


def test_observer_rejects_bad_input_and_records_nothing():
    obs = KVObserver()
    k = torch.randn(1, H, 4, D)
    bad = k.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="layer 2") as e:
        obs.observe(2, bad, k)
    assert e.value.where[0] == {"layer": 2, "head": 1, "position": 2, "channel": 3}
    assert obs.num_layers == 0
    with pytest.raises(ShapeError):
        obs.observe(0, k[0], k[0])
    with pytest.raises(ShapeError):
        obs.observe(0, k.long(), k)
    obs.observe(0, k, k)
    with pytest.raises(ShapeError, match="one observer per model"):
        obs.observe(0, torch.randn(1, H + 1, 4, D), torch.randn(1, H + 1, 4, D))
    with pytest.raises(CalibrationError):
        KVObserver((100.0,))


def test_stats_refuse_missing_layers():
    with pytest.raises(CalibrationError, match="nothing was observed"):
        KVObserver().stats()
    obs = KVObserver(())
    k = torch.randn(1, H, 4, D)
    obs.observe(0, k, k)
    obs.observe(2, k, k)
    with pytest.raises(CalibrationError, match=r"layers \[1\]"):
        obs.stats()


# -- fingerprint ----------------------------------------------------------------------------------------


def test_fingerprint_from_dict_and_transformers_config_agree():
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    d = _config(rope_scaling={**rope, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, max_position_embeddings=131072)
    fp_dict = fingerprint_from_config(d)
    cfg = LlamaConfig(**{k: v for k, v in d.items() if k not in ("model_type",)})
    fp_obj = fingerprint_from_config(cfg)
    assert fp_dict["num_layers"] == LAYERS and fp_dict["kv_heads"] == H and fp_dict["head_dim"] == D
    assert fp_dict["rope"]["rope_theta"] == 10000.0 and fp_dict["rope"]["factor"] == 8.0
    assert fp_dict["rope"]["rope_type"] == "llama3"
    assert diff_fingerprints(fp_dict, fp_obj) == []
    json.dumps(fp_obj)  # serializable


def test_fingerprint_diff_names_fields_and_bad_config_is_refused():
    a = fingerprint_from_config(_config())
    b = fingerprint_from_config(_config(num_key_value_heads=4, rope_theta=500000.0))
    diffs = diff_fingerprints(a, b)
    assert any(x.startswith("kv_heads: artifact 2, model 4") for x in diffs)
    assert any(x.startswith("rope:") for x in diffs)
    assert len(diffs) == 2
    with pytest.raises(ConfigError):
        fingerprint_from_config({"model_type": "llama"})


# -- artifact -------------------------------------------------------------------------------------------


FMT = "k=int8:channel:static,v=int8:token"
DATA = {"name": "test", "samples": 8, "seq_len": 40, "seed": 0, "tokens_sha256": "0" * 64}


def _artifact(fmt=FMT, source="absmax") -> Artifact:
    obs, _ = _observed()
    keys, values = obs.stats()
    return Artifact.build(keys, values, fmt, fingerprint_from_config(_config()), DATA, source)


def test_artifact_roundtrip(tmp_path):
    art = _artifact("k=int4:channel:asym:static,v=fp8:tensor:static:fp32")
    art.save(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["format"] == art.format.spec_string()
    assert manifest["fingerprint"]["num_layers"] == LAYERS
    assert manifest["data"]["name"] == "test" and manifest["kvpack_version"]
    assert len(manifest["tensors"]["sha256"]) == 64
    back = load_artifact(tmp_path, model=_config(), format=art.format)
    for name in ("absmax", "min", "max", "rms", "pair_absmax", "tokens"):
        assert torch.equal(getattr(back.keys, name), getattr(art.keys, name)), name
        assert torch.equal(getattr(back.values, name), getattr(art.values, name)), name
    for p in art.percentiles:
        assert torch.equal(back.keys.percentiles[p], art.keys.percentiles[p])
    assert torch.equal(back.key_scales.scale, art.key_scales.scale)
    assert torch.equal(back.key_scales.zero, art.key_scales.zero)
    assert back.key_scales.scale.shape == (LAYERS, H, 1, D)
    assert back.value_scales.scale.shape == (LAYERS, 1, 1, 1) and back.value_scales.scale.dtype == torch.float32
    scales = back.scales_for(art.format, model=_config())
    assert scales.key is back.key_scales and scales.value is back.value_scales


def test_corrupted_tensors_are_refused(tmp_path):
    _artifact().save(tmp_path)
    blob = bytearray((tmp_path / TENSORS_NAME).read_bytes())
    blob[-5] ^= 0x01  # one bit in the last tensor
    (tmp_path / TENSORS_NAME).write_bytes(bytes(blob))
    with pytest.raises(CalibrationError, match="checksum"):
        load_artifact(tmp_path)


def test_edited_or_broken_manifest_is_refused(tmp_path):
    _artifact().save(tmp_path)
    path = tmp_path / MANIFEST_NAME
    good = path.read_text()
    m = json.loads(good)
    m["format"] = "k=int4:channel:static,v=int8:token"  # an edit that would change the meaning of the scales
    path.write_text(json.dumps(m))
    with pytest.raises(CalibrationError, match="manifest checksum"):
        load_artifact(tmp_path)
    path.write_text(good[: len(good) // 2])
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_artifact(tmp_path)
    path.write_text(good)
    (tmp_path / TENSORS_NAME).unlink()
    with pytest.raises(CalibrationError, match="missing"):
        load_artifact(tmp_path)
    with pytest.raises(CalibrationError, match="kvpack calibrate"):
        load_artifact(tmp_path / "nowhere")


def test_another_model_is_refused_naming_the_fields(tmp_path):
    _artifact().save(tmp_path)
    other = _config(num_hidden_layers=4, head_dim=32, hidden_size=128)
    with pytest.raises(CalibrationError) as e:
        load_artifact(tmp_path, model=other)
    msg = str(e.value)
    assert "num_layers: artifact 3, model 4" in msg and "head_dim: artifact 16, model 32" in msg
    assert "kv_heads" not in msg
    art = load_artifact(tmp_path)
    with pytest.raises(CalibrationError, match="rope"):
        art.scales_for(FMT, model=_config(rope_theta=1e6))


def test_another_format_is_refused_and_rescaling_is_explicit(tmp_path):
    art = _artifact()
    art.save(tmp_path)
    with pytest.raises(
        CalibrationError, match=r"keys: artifact has scales for int8:channel:sym:fp16:static, requested int4"
    ):
        load_artifact(tmp_path, format="k=int4:channel:static,v=int8:token")
    with pytest.raises(CalibrationError, match="values"):
        art.check_format("k=int8:channel:static,v=fp8:tensor:static")  # the artifact has no value scales
    with pytest.raises(CalibrationError, match="takes no static scales"):
        art.scales_for("int8")
    # the same quantization with and without the static flag, and another block size, are the same scales
    art.check_format("k=int8:channel:static,v=int4:g32,block=32")
    again = art.rescaled("k=int4:channel:asym:static,v=int8:token", source="p99.9")
    assert again.key_scales.spec.dtype.value == "int4" and again.key_scales.zero is not None
    assert again.source == "p99.9"
    with pytest.raises(CalibrationError, match=r"p99\.5"):
        art.rescaled(FMT, source="p99.5")


def test_statistics_of_another_shape_are_refused():
    obs, _ = _observed()
    keys, values = obs.stats()
    with pytest.raises(CalibrationError, match="fingerprint"):
        Artifact.build(keys, values, FMT, fingerprint_from_config(_config(num_key_value_heads=4)), DATA)
