"""``kvpack bench decode``: the sweep's rows, its cache builder and baselines, and the CLI (tiny shapes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kvpack.bench import decode as bench
from kvpack.bench.membw import measure_read_bandwidth
from kvpack.cli.main import main
from kvpack.errors import ConfigError
from kvpack.formats import PRESETS
from kvpack.kernels import cpu_decode, decode_attention, reference
from kvpack.testing import assert_close, cpu_kernel_tolerance

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
    assert_close(decode_attention(q, kv, backend="cpu"), ref, *cpu_kernel_tolerance(kv), msg="kernel")  # rotates q
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
    for r in rows:  # kernel rows carry their cache's block-read ceiling, the others none
        assert ("block_read_ms" in r) == (r["kind"] == "kvpack") and r["block_order"] == "shuffled"
        if r["kind"] == "kvpack":
            assert r["block_read_ms"] > 0 and r["block_read_gbps"] > 0
            assert r["pct_block_read"] == pytest.approx(100 * r["block_read_ms"] / r["median_ms"])
    table = bench.format_table(rows, bw)
    assert "kvpack-kivi2" in table and "vs sdpa-bf16" in table and "context 70 tokens" in table
    assert "% ceil" in table and "shuffled block ids" in table


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("order", ["shuffled", "ascending"])
def test_block_read_probe_reads_every_line_the_kernel_reads(name: str, order: str) -> None:
    """The probe's XOR per work item is the XOR of the first word of every 64-byte line of that item's key and
    value rows: it reads exactly the kernel's blocks (released ones skipped, also inside a run), each once."""
    import numpy as np

    from kvpack.bench.blockread import BlockRead

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 700, 128, generator=g), torch.randn(3, 2, 700, 128, generator=g)
    kv = bench.build_paged_kv(name, k, v, 16, seed=2, block_order=order)
    ids = kv.block_tables[:, :43]
    if order == "ascending":
        assert torch.equal(ids.reshape(-1), torch.arange(1, 3 * 43 + 1, dtype=torch.int32))
    else:
        assert ids.unique().numel() == 3 * 43 and not torch.equal(ids.reshape(-1).sort().values, ids.reshape(-1))
    kv.block_tables[1, 5] = 0  # a released block is never read
    probe = BlockRead(kv, threads=2)
    got = probe.run().copy()
    words = [t.contiguous().view(torch.uint8).reshape(t.shape[0], 2, -1).numpy().view(np.uint64)[:, :, ::8]
             for t in (kv.k_data, kv.v_data)]  # fmt: skip
    assert len(probe.items) > 1
    assert probe.blocks_per_run == cpu_decode.MULTI_TOKENS // 16  # keys of a run's blocks, then their values
    for i, (b, h, j0, j1, _) in enumerate(probe.items):
        blk = kv.block_tables[b, j0:j1].numpy()
        blk = blk[blk > 0]
        want = np.bitwise_xor.reduce(np.concatenate([w[blk, h].ravel() for w in words]))
        assert int(got[i]) == int(want), (i, b, h, j0, j1)
    row_bytes = kv.k_data.shape[-1] + kv.v_data.shape[-1]
    assert probe.nbytes == int(sum(j1 - j0 for _, _, j0, j1, _ in probe.items)) * 16 * row_bytes


def test_block_order_is_validated() -> None:
    with pytest.raises(ConfigError, match="block_order"):
        bench.DecodeConfig(block_order="random")
    with pytest.raises(ConfigError, match="block_order"):
        bench.build_paged_kv("int8", torch.randn(1, 1, 20, 64), torch.randn(1, 1, 20, 64), 16, block_order="x")


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
            "--membw-mb", "8", "--block-order", "ascending", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    assert "kvpack-int8" in capsys.readouterr().out
    data = json.loads(path.read_text())
    row = data["rows"][-1]
    for key in ("provider", "format", "context", "median_ms", "gbps", "memory_bandwidth_gbps"):
        assert key in row
    assert row["provider"] == "kvpack-int8" and row["format"] == "int8" and row["context"] == 40
    assert row["block_order"] == "ascending" and row["block_read_ms"] > 0


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


def _run_script(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> list[str]:
    """``benchmarks/<name>.py`` run in this process with ``argv``; its output lines (torch's threads restored)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["x", *argv])
    old = torch.get_num_threads()
    try:
        mod.main()
    finally:
        torch.set_num_threads(old)
    return capsys.readouterr().out.splitlines()


def test_spec_ab_script_times_each_setting_and_restores_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/cpu_spec_ab.py`` (settings of a spec parameter alternated in one process) on a small
    context: one row per setting, ratios to the first, and the parameter set back afterwards."""
    states = []
    prepare = cpu_decode._prepare
    monkeypatch.setattr(cpu_decode, "_prepare", lambda kv: states.append(prepare(kv)) or states[-1])
    argv = ["--values", "16,1", "--context", "1024", "--rounds", "2", "--threads", "1"]
    lines = _run_script("cpu_spec_ab", argv, monkeypatch, capsys)
    assert "P_MULTI" in lines[0] and "ns per (token, kv head)" in lines[0]
    rows = [ln.split() for ln in lines[1:]]  # median, setting, "ratios", one ratio per round
    assert [r[1] for r in rows] == ["16", "1"] and all(float(r[0]) > 0 for r in rows)
    assert rows[0][3:] == ["1.00", "1.00"]  # the first setting is the reference of every round
    nbm = cpu_decode._nb()
    assert int(states[0].kp[nbm.P_MULTI]) == cpu_decode.MULTI_TOKENS // 64 == int(states[0].vp[nbm.P_MULTI])


def test_format_ab_script_times_each_format_on_the_same_data(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/cpu_format_ab.py`` (formats alternated in one process): one row per format in the order
    given, each timed in every round, ratios to the first."""
    argv = ["--formats", "int8;k=int8,v=int8,sink=1", "--context", "1024", "--rounds", "3", "--threads", "2"]
    lines = _run_script("cpu_format_ab", argv, monkeypatch, capsys)
    assert lines[0] == "context 1024: ms, 2 threads"
    rows = [ln.split() for ln in lines[1:]]
    assert [r[1] for r in rows] == ["int8", "k=int8,v=int8,sink=1"] and all(float(r[0]) > 0 for r in rows)
    assert rows[0][3:] == ["1.00"] * 3 and len(rows[1][3:]) == 3


def test_cycle_blocks_points_every_sequence_at_its_first_blocks_over_and_over() -> None:
    """``cycle_blocks`` (the benchmarks' ``--hot-blocks``): each sequence's sealed blocks become its first ``N``
    ids repeated, the tail is left alone, and the result is still a cache the kernel reads like the reference."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 200, 64, generator=g), torch.randn(2, 2, 200, 64, generator=g)
    kv = bench.build_paged_kv("int8", k, v, 16)
    before = kv.block_tables.clone()
    bench.cycle_blocks(kv, 3)
    for b in range(2):
        assert kv.block_tables[b, :12].tolist() == before[b, :3].tolist() * 4
        assert torch.equal(kv.block_tables[b, 12:], before[b, 12:])
    q = torch.randn(2, 8, 64, generator=g)
    got = decode_attention(q, kv, backend="cpu", out=torch.full_like(q, float("nan")))
    assert_close(got, reference.decode_attention(q, kv), *cpu_kernel_tolerance(kv), "cycled blocks")
