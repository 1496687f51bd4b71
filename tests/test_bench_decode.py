"""``kvpack bench decode``: the sweep's rows, its cache builder and baselines, and the CLI (tiny shapes)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvpack.bench import decode as bench
from kvpack.bench.membw import measure_read_bandwidth
from kvpack.cli.main import main
from kvpack.errors import ConfigError
from kvpack.formats import PRESETS
from kvpack.kernels import decode_attention, reference
from kvpack.testing import assert_close

TINY = dict(contexts=(70,), batch=2, q_heads=4, kv_heads=2, head_dim=64, block_size=16, formats=("int8", "kivi2"),
            dequant_formats=("int4",), repeats=2, slow_repeats=1, warmup=1, membw_bytes=8 * 2**20)  # fmt: skip


@pytest.mark.parametrize("name", ["int8", "int4", "fp8-plain", "fp8", "kivi2"])
def test_built_cache_agrees_with_reference_and_dequant_baseline(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 83, 64, generator=g), torch.randn(2, 2, 83, 64, generator=g)
    kv = bench.build_paged_kv(name, k, v, 16, seed=1)
    assert kv.block_tables[:, :5].unique().numel() == 10 and int(kv.block_tables.min()) >= 0  # shuffled, distinct
    q = torch.randn(2, 8, 64, generator=g)
    ref = reference.decode_attention(q, kv)
    assert_close(bench.dequant_then_sdpa(q, kv), ref, 1e-4, 1e-3, msg="dequantize-then-SDPA")
    assert_close(decode_attention(q, kv, backend="cpu"), ref, 2e-4, 2e-3, msg="kernel")  # rotates q for fp8
    # the stored cache is close to the dense one it came from (quantization error only)
    dense = bench._sdpa(q, k, v)
    assert (dense - ref).abs().max() < {"int8": 0.05, "fp8-plain": 0.1, "fp8": 0.1}.get(name, 0.6)


def test_cache_bytes_is_the_format_accounting() -> None:
    k = torch.randn(3, 2, 100, 64)
    kv = bench.build_paged_kv("int4", k, k.clone(), 16)
    fmt = PRESETS["int4"].with_block_size(16)
    sealed = 3 * (100 // 16) * fmt.block_bytes(2, 64)
    tail = 3 * 2 * (100 % 16) * 2 * 64 * 4  # K and V tail tokens, float32
    sink = 3 * 2 * 1 * 2 * 64 * 4  # the preset's one sink position, read instead of its block row
    assert fmt.sink == 1 and kv.sink == 1
    assert bench.cache_bytes(kv) == sealed + tail + sink


def test_sweep_rows_have_every_column() -> None:
    cfg = bench.DecodeConfig(**TINY)
    seen = []
    rows, bw = bench.run_sweep(cfg, progress=seen.append)
    assert bw > 0 and any("bandwidth" in s for s in seen)
    names = [r["provider"] for r in rows]
    assert names == ["sdpa-fp32", "sdpa-bf16", "dequant-sdpa-int4", "kvpack-int8", "kvpack-kivi2"]
    for r in rows:
        assert r["context"] == 70 and r["median_ms"] > 0 and r["gbps"] > 0
        assert r["memory_bandwidth_gbps"] == bw
        assert r["pct_bandwidth"] == pytest.approx(100 * r["gbps"] / bw)
        for base in ("sdpa-fp32", "sdpa-bf16", "dequant-sdpa-int4"):
            base_ms = next(x["median_ms"] for x in rows if x["provider"] == base)
            assert r[f"speedup_vs_{base}"] == pytest.approx(base_ms / r["median_ms"])
    fp32 = rows[0]
    assert fp32["cache_bytes"] == 2 * 2 * 2 * 70 * 64 * 4
    table = bench.format_table(rows, bw)
    assert "kvpack-kivi2" in table and "vs sdpa-bf16" in table and "context 70 tokens" in table


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="multiple"):
        bench.DecodeConfig(q_heads=6, kv_heads=4)
    assert bench.parse_tokens("8k") == 8192 and bench.parse_tokens("300") == 300
    with pytest.raises(ConfigError):
        bench.parse_tokens("lots")


def test_bandwidth_probe_restores_threads() -> None:
    old = torch.get_num_threads()
    assert measure_read_bandwidth(4 * 2**20, repeats=2, threads=1) > 0.1
    assert torch.get_num_threads() == old


def test_cli_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "rows.json"
    argv = ["bench", "decode", "--contexts", "40", "--formats", "int8", "--dequant-formats", "", "--batch", "1",
            "--q-heads", "2", "--kv-heads", "1", "--head-dim", "64", "--block-size", "16", "--repeats", "1",
            "--membw-mb", "8", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    assert "kvpack-int8" in capsys.readouterr().out
    data = json.loads(path.read_text())
    row = data["rows"][-1]
    for key in ("provider", "format", "context", "median_ms", "gbps", "memory_bandwidth_gbps"):
        assert key in row
    assert row["provider"] == "kvpack-int8" and row["format"] == "int8" and row["context"] == 40


def test_cli_bad_arguments_exit_2(capsys) -> None:
    assert main(["bench", "decode", "--q-heads", "3", "--kv-heads", "2", "--contexts", "8"]) == 2
    assert "multiple" in capsys.readouterr().err


def test_bench_generate_delegates_or_explains(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as e:  # the module's own parser answers --help
        main(["bench", "generate", "--help"])
    assert e.value.code == 0
    assert "--new-tokens" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "kvpack.bench.generate", None)  # as if the module were not installed
    assert main(["bench", "generate", "--quick"]) == 2
    assert "not available" in capsys.readouterr().err
