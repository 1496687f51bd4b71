"""``kvpack bench prefill``: the sweep's rows and the CLI (tiny shapes)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpack.bench import prefill as bench
from kvpack.cli.main import main
from kvpack.errors import ConfigError

pytest.importorskip("numba")

TINY = dict(contexts=(150,), chunks=(7,), batches=(2,), q_heads=4, kv_heads=2, head_dim=64, block_size=16,
            formats=("int8",), repeats=1, warmup=0)  # fmt: skip


def test_sdpa_baseline_is_causal_grouped_attention() -> None:
    """The baseline computes what the reference does over a full-precision history."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16)
    mask = (torch.arange(30).view(1, -1) <= torch.arange(25, 30).view(-1, 1)).repeat(2, 1)
    out = bench._sdpa(q, k, v, mask)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # [2, 4, 30, 16]
    s = (q.transpose(1, 2) @ kk.transpose(2, 3)) / 4.0
    s = s.masked_fill(~mask[:5], float("-inf"))
    want = (s.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_sweep_rows() -> None:
    rows = bench.run_sweep(bench.PrefillConfig(**TINY))
    assert [r["provider"] for r in rows] == [
        "sdpa-fp32",
        "sdpa-bf16",
        "reference-int8",
        "dequant-sdpa-int8",
        "kvpack-int8",
    ]
    for r in rows:
        assert (r["context"], r["chunk"], r["batch"]) == (150, 7, 2) and r["median_ms"] > 0
        assert r["vs_sdpa_fp32"] > 0
    kern = rows[-1]
    assert kern["extra_mb"] is None or kern["extra_mb"] > 0  # at least the kernel's scratch
    assert rows[0]["vs_sdpa_fp32"] == 1.0
    assert "kvpack-int8" in bench.format_table(rows)


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="longer than the history"):
        bench.PrefillConfig(contexts=(100,), chunks=(512,))
    with pytest.raises(ConfigError, match="multiple"):
        bench.PrefillConfig(q_heads=6, kv_heads=4)


def test_cli_prints_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "prefill", "--context", "200", "--chunk", "1,64", "--batch", "1", "--formats", "int4",
               "--no-reference", "--repeats", "1", "--json"])  # fmt: skip
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["provider"], r["chunk"]) for r in rows] == [
        (p, c) for c in (1, 64) for p in ("sdpa-fp32", "sdpa-bf16", "dequant-sdpa-int4", "kvpack-int4")
    ]
    assert main(["bench", "prefill", "--chunk", "abc"]) == 2
    assert "--chunk" in capsys.readouterr().err
