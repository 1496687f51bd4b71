"""vLLM's n-gram speculative decoding with and without the kvpack backend, on the embedded model.

The workload of the vLLM engine test (``tests/test_vllm_engine.py``): 12 prompts of real prose sharing a 192-token
prefix plus 40-200 tokens of their own, 64 greedy tokens each, 8 running at most, a KV space of 20 int8 pages per
layer after the tails (vLLM's own float32 cache gets twice the space). Four engines, each in a fresh process: vLLM's
own cache and kvpack ``int8``, each without and with ``ngram`` drafting (``num_speculative_tokens`` 3, lookup of
2-4 tokens); with drafts the kvpack engine gets the space its second tail slots take on top, so that it holds the
same pages. ``--repeat N`` runs the four N times, alternated, and reports the median times. Greedy drafting changes no
greedy token of a given cache, so ``identical_to_stock`` (sequences whose 64
tokens are vLLM's own float32 cache's) moves only through the cache's numbers; ``reserves_reopened`` counts the
sealed blocks that rejected drafts wrote into again.

    python benchmarks/vllm_speculative.py --threads 2 --repeat 3 --out benchmarks/results/vllm_speculative_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np
import torch
from _meta import commit as git_commit

from kvpack import parse_format
from kvpack.bench.vllm import prose_token_ids, workload
from kvpack.fsutil import atomic_write_text
from kvpack.integrations.vllm.config import tail_pool_bytes
from kvpack.integrations.vllm.engine import run_engine
from kvpack.integrations.vllm.layout import PageLayout
from kvpack.models.embedded import ensure_converted

LAYERS, KV_HEADS, HEAD_DIM, SEQS = 30, 3, 64, 8  # SmolLM2-135M, as the engine test runs it
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads of each engine (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the four engines, alternated (default 1)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    path = str(ensure_converted())
    tails = tail_pool_bytes(parse_format("int8"), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)
    space = 20 * PageLayout.build(parse_format("int8"), KV_HEADS, HEAD_DIM, torch.float32).page_bytes * LAYERS + tails
    prompts = workload(prose_token_ids(path), requests=12, prefix=192, extra=(40, 200), seed=3)
    job = {"model": path, "prompts": prompts, "max_tokens": 64, "max_num_seqs": SEQS, "max_model_len": 512,
           "max_num_batched_tokens": 256, "threads": args.threads}  # fmt: skip
    spec = {"engine_kwargs": {"speculative_config": NGRAM}}
    runs = {
        "vllm-default": {"format": None, "kv_bytes": 2 * space},
        "vllm-default + ngram": {"format": None, "kv_bytes": 2 * space, **spec},
        "int8": {"format": "int8", "kv_bytes": space},
        "int8 + ngram": {"format": "int8", "kv_bytes": space + tails, **spec},
    }
    rounds = [{name: run_engine({**job, **extra}) for name, extra in runs.items()} for _ in range(args.repeat)]
    results = rounds[0]  # every column but the times is the same in every round (greedy, one schedule)
    ref = results["vllm-default"]["outputs"]
    rows = []
    for name, r in results.items():
        walls = [rd[name]["wall_s"] for rd in rounds]
        rates = [rd[name]["tokens_per_s"] for rd in rounds]
        rows.append({
            "provider": name, "steps": r["steps"], "wall_s": round(float(np.median(walls)), 2),
            "tokens_per_s": round(float(np.median(rates)), 1), "tokens_per_s_runs": [round(x, 1) for x in rates],
            "kv_capacity_tokens": r["kv_capacity_tokens"],
            "preemptions": r["preemptions"], "identical_to_stock": sum(a == b for a, b in zip(r["outputs"], ref)),
            "sequences": len(ref), "reserves_reopened": r.get("reserves_reopened"), "tails_left": r["tails_left"],
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        commit = git_commit()
        cmd = f"python benchmarks/vllm_speculative.py --threads {args.threads} --repeat {args.repeat} --out {args.out}"
        meta = {"command": cmd,
                "commit": commit, "machine": f"{platform.machine()}, {args.threads} threads", "torch": torch.__version__,
                "speculative_config": NGRAM}  # fmt: skip
        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
