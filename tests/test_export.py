"""Export to the vLLM / llm-compressor checkpoint convention: names, shapes, dtypes and values."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kvpack.calibration import (
    Artifact,
    KVObserver,
    fingerprint_from_config,
    load_artifact,
    seal_with_static,
    static_scales,
)
from kvpack.calibration.artifact import TENSORS_NAME
from kvpack.cli.main import main
from kvpack.errors import CalibrationError
from kvpack.formats import parse_format
from kvpack.integrations.export import (
    E4M3_MAX,
    SCALES_FILE,
    SCHEME_FILE,
    export_vllm,
    vllm_reasons_unsupported,
    vllm_scale_name,
    vllm_scales,
)
from kvpack.quant import dequantize

LAYERS, H, D = 4, 2, 8
CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": H,
    "hidden_size": 4 * D,
    "head_dim": D,
    "vocab_size": 50,
    "rope_theta": 10000.0,
}


def _keys_values(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, H, 24, D, generator=g) * (i + 1), torch.randn(2, H, 24, D, generator=g) * 0.1 * (i + 2))
        for i in range(LAYERS)
    ]


def _artifact(tmp_path, fmt="k=int8:channel:static,v=int8:token", data=None):
    data = data or _keys_values()
    obs = KVObserver((99.9,))
    for i, (k, v) in enumerate(data):
        obs.observe(i, k, v)
    keys, values = obs.stats()
    art = Artifact.build(keys, values, fmt, fingerprint_from_config(CONFIG), {"name": "test"}, "absmax")
    art.save(tmp_path)
    return art, data


def test_scale_names_shapes_dtypes_and_values(tmp_path):
    art, data = _artifact(tmp_path / "a")
    scales = vllm_scales(art)
    assert set(scales) == {f"model.layers.{i}.self_attn.{r}_scale" for i in range(LAYERS) for r in "kv"}
    for i, (k, v) in enumerate(data):
        ks, vs = scales[vllm_scale_name(i, "k")], scales[vllm_scale_name(i, "v")]
        assert ks.shape == () and ks.dtype == torch.float32 and vs.shape == () and vs.dtype == torch.float32
        assert float(ks) == pytest.approx(float(k.abs().max()) / 448.0, rel=1e-6)
        assert float(vs) == pytest.approx(float(v.abs().max()) / 448.0, rel=1e-6)
    assert E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    with pytest.raises(ValueError):
        vllm_scale_name(0, "q")


def test_exported_scale_is_kvpacks_own_static_fp8_scale(tmp_path):
    """kv=fp8:tensor:static:fp32 is exactly what vLLM runs: the exported scalars are its scales, bit for bit."""
    fmt = parse_format("kv=fp8:tensor:static:fp32")
    art, data = _artifact(tmp_path / "a", fmt)
    assert vllm_reasons_unsupported(fmt) == []
    scales = vllm_scales(art)
    ks = static_scales(art.keys, fmt.key, "key", "absmax")
    for i, (k, _) in enumerate(data):
        assert torch.equal(scales[vllm_scale_name(i, "k")], ks.scale[i].reshape(()))
        assert torch.equal(scales[vllm_scale_name(i, "v")], art.value_scales.scale[i].reshape(()))
        # the calibration data itself fits: x / k_scale stays within the e4m3 range, nothing saturates
        blocks = k.reshape(-1, H, 24, D)
        qt, clipped = seal_with_static(blocks, fmt.key, ks.layer(i))
        assert clipped == 0
        assert float(qt.data.float().abs().max()) <= 448.0
        assert torch.allclose(dequantize(qt), blocks, rtol=0.07, atol=1e-3)


def test_export_writes_files_and_refuses_a_broken_artifact(tmp_path):
    _artifact(tmp_path / "a")
    out = tmp_path / "out"
    summary = export_vllm(tmp_path / "a", out)
    assert summary["layers"] == LAYERS and len(summary["k_scale"]) == LAYERS
    with safe_open(str(out / SCALES_FILE), "pt") as f:
        names = set(f.keys())
        assert names == {vllm_scale_name(i, r) for i in range(LAYERS) for r in "kv"}
        assert f.get_tensor(vllm_scale_name(2, "v")).dtype == torch.float32
        assert float(f.get_tensor(vllm_scale_name(2, "k"))) == summary["k_scale"][2]
    scheme = json.loads((out / SCHEME_FILE).read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    readme = (out / "README.md").read_text()
    assert "--kv-cache-dtype fp8" in readme and "per-channel" in readme  # int8 per-channel keys do not map
    assert json.loads((out / "kvpack_export.json").read_text())["fingerprint"]["num_layers"] == LAYERS
    # corrupted artifact: refused, nothing written
    blob = bytearray((tmp_path / "a" / TENSORS_NAME).read_bytes())
    blob[-1] ^= 0x40
    (tmp_path / "a" / TENSORS_NAME).write_bytes(bytes(blob))
    with pytest.raises(CalibrationError, match="checksum"):
        export_vllm(tmp_path / "a", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_a_layer_without_range_is_refused_not_defaulted(tmp_path):
    data = _keys_values()
    data[1] = (data[1][0], torch.zeros_like(data[1][1]))
    _artifact(tmp_path / "a", data=data)
    with pytest.raises(CalibrationError, match="layer 1"):
        export_vllm(tmp_path / "a", tmp_path / "out")


def test_reasons_name_what_engines_cannot_run():
    assert vllm_reasons_unsupported("fp16") == []
    r = " ".join(vllm_reasons_unsupported("int8"))
    assert "per-channel" in r
    r = " ".join(vllm_reasons_unsupported("k8v4"))
    assert "one dtype for both" in r and "zero-point" in r
    assert "per block" in " ".join(vllm_reasons_unsupported("fp8-plain"))
    assert "without scales" in " ".join(vllm_reasons_unsupported("fp8_e5m2"))


def test_cli_export(tmp_path, capsys):
    _artifact(tmp_path / "a")
    assert main(["export", "vllm", "--artifact", str(tmp_path / "a"), "--out", str(tmp_path / "o")]) == 0
    assert "8 fp8 scales" in capsys.readouterr().out
    assert load_artifact(tmp_path / "a").keys.num_layers == LAYERS
    assert main(["export", "vllm", "--artifact", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpack export: error:") and "kvpack calibrate" in err and "\n" not in err
