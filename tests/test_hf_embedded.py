"""The integration on the embedded SmolLM2-135M-Instruct (30 layers, GQA 9:3, head_dim 64): int8 greedy
generation equals the full-precision cache's, the CLI and the generate benchmark run end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import kvpack.hf
from kvpack.bench import generate as bench_generate
from kvpack.cli.main import main
from kvpack.models import embedded

PROMPTS = ["Explain why the sky is blue in simple words.", "Write a short story about a robot who learns to paint."]
NEW = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core box two threads per op
    stall on each other: run this module on one, then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted once per session into a private cache dir (shared with test_models.py by path)."""
    root = tmp_path_factory.getbasetemp() / "kvpack-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPACK_CACHE", str(root))
        return embedded.ensure_converted()


@pytest.fixture(scope="module")
def smol(embedded_dir: Path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPACK_CACHE", str(embedded_dir.parents[1]))
        return kvpack.hf.load_model()


@pytest.fixture()
def use_cache_dir(embedded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPACK_CACHE", str(embedded_dir.parents[1]))
    return embedded_dir


def test_int8_greedy_equals_full_precision_for_64_tokens(smol):
    model, tokenizer = smol
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)  # left padding
    assert (inputs["attention_mask"] == 0).any()
    kwargs = dict(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    try:
        model.set_attn_implementation("sdpa")
        ref = model.generate(**kwargs, **{kvpack.hf.cache_kwarg(model): DynamicCache(config=model.config)})
        cache = kvpack.hf.cache_for(model, "int8", batch_size=2)
        out = model.generate(**kwargs, **{kvpack.hf.cache_kwarg(model): cache})
    finally:
        model.set_attn_implementation("sdpa")
    assert out.shape[1] == inputs["input_ids"].shape[1] + NEW
    assert torch.equal(out, ref), tokenizer.batch_decode(out[:, -NEW:])
    assert cache.fused_decode_calls == (NEW - 1) * 30  # every decode step of every layer: the fused kernel
    report = cache.memory_report()
    assert report.total.used_bytes == report.total.theoretical_bytes and report.used_blocks > 0


def test_generate_command_prints_text_and_cache_bytes(use_cache_dir, capsys):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--format", "int8", "--max-new-tokens", "8"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "Paris" in lines[0]
    assert lines[-1].startswith("cache: ") and "in fp16" in lines[-1] and "format int8" in lines[-1]


def test_generate_command_rejects_bad_input(use_cache_dir, capsys):
    assert main(["generate", "--prompt", "hi", "--format", "int5"]) == 2
    assert "int5" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "0"]) == 2


def test_bench_generate_runs_every_provider(use_cache_dir, capsys):
    parser = argparse.ArgumentParser()
    bench_generate.add_arguments(parser)
    argv = ["--context", "130", "--batch", "1,2", "--new-tokens", "3", "--formats", "int8", "--json"]
    args = parser.parse_args([*argv, "--isolation", "none"])
    assert bench_generate.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    providers = {(r["provider"], r["batch"]) for r in result["rows"]}
    expected = ["dynamic", "kvpack-int8", *result["peers"]]
    assert providers == {(p, b) for p in expected for b in (1, 2)}
    assert result["threads"] == 1 and result["not_run"] == []
    for r in result["rows"]:
        assert r["tokens_per_s"] > 0 and r["cache_bytes"] > 0 and r["steps"] == 3
        if r["provider"] == "kvpack-int8":
            assert abs(r["predicted_error"]) <= 0.02
            assert r["fused_decode_calls"] == 4 * 30
    dyn = {r["batch"]: r["cache_bytes"] for r in result["rows"] if r["provider"] == "dynamic"}
    assert dyn[2] == 2 * dyn[1] == 2 * 30 * 2 * 3 * 64 * 4 * (130 + 4)  # layers, K+V, kv_heads, D, fp32, tokens
    # each row in a fresh process: the same row, and the parent's thread count
    args = parser.parse_args([*argv, "--batch", "1", "--skip", "quantized,kvpack", "--ttft-rounds", "0"])
    assert bench_generate.run(args) == 0
    isolated = json.loads(capsys.readouterr().out)
    assert isolated["isolation"] == "process" and isolated["not_run"] == []
    (row,) = isolated["rows"]
    assert row["provider"] == "dynamic" and row["steps"] == 3 and row["cache_bytes"] == dyn[1]
    # time to first token with each call in a fresh process (no row here has run a kvpack kernel before it)
    args = parser.parse_args([*argv, "--batch", "1", "--skip", "dynamic,quantized,kvpack", "--ttft-rounds", "1"])
    assert bench_generate.run(args) == 0
    ttft = json.loads(capsys.readouterr().out)["ttft"]
    assert [r["provider"] for r in ttft] == ["dynamic", "kvpack-int8"]
    assert all(r["ttft_ms"] > 0 and r["rounds"] == 1 and r["prompt_tokens"] == 130 for r in ttft)
