"""Is ``kvpack bench generate``'s DynamicCache row as fast as transformers itself makes DynamicCache?

Two fresh processes each, alternated: the bench's own ``dynamic`` row (its worker: the context prefilled once at
batch 1, its keys and values repeated over the batch, then greedy decode steps), and ``model.generate`` on the
same prompt repeated over the batch (its own prefill of the whole batch, then its own decode loop), whose
per-step time comes from the gaps between the calls of a logits processor (one call per new token). Prints
the median ms per decode step of each and their ratio; ``--json`` prints the rounds as JSON.

    python benchmarks/generate_baseline.py --context 4096 --batch 8 --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _generate_child(context: int, batch: int, steps: int, threads: int) -> float:
    """Median ms per decode step of ``model.generate`` with DynamicCache (SDPA), in this process."""
    torch.set_num_threads(threads)
    from transformers import LogitsProcessor, LogitsProcessorList

    from kvpack.bench.generate import _prompt
    from kvpack.models import load_model

    model, tokenizer = load_model(None)
    model.set_attn_implementation("sdpa")
    ids = _prompt(tokenizer, context).expand(batch, -1).contiguous()
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2, do_sample=False,
                       min_new_tokens=steps + 2, logits_processor=LogitsProcessorList([Stamp()]),
                       pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # after the prefill and one warm-up step
    return 1000 * statistics.median(gaps)


def _bench_child(context: int, batch: int, steps: int, threads: int) -> float:
    """Median ms per decode step of ``kvpack bench generate``'s dynamic row (each row its own fresh process)."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpack", "bench", "generate", "--context", str(context), "--batch", str(batch),
         "--new-tokens", str(steps), "--skip", "quantized,kvpack", "--ttft-rounds", "0", "--threads", str(threads),
         "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (row,) = json.loads(out.stdout)["rows"]
    return float(row["ms_per_step_median"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps (default 16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=("generate",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"ms": _generate_child(args.context, args.batch, args.steps, args.threads)}))
        return 0
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    common = ["--context", str(args.context), "--batch", str(args.batch), "--steps", str(args.steps),
              "--threads", str(args.threads)]  # fmt: skip
    rounds = []
    for _ in range(args.rounds):
        gen = subprocess.run([sys.executable, __file__, "--child", "generate", *common], check=True,
                             capture_output=True, text=True, env=env)  # fmt: skip
        rounds.append({"generate_ms": json.loads(gen.stdout.splitlines()[-1])["ms"],
                       "bench_ms": _bench_child(args.context, args.batch, args.steps, args.threads)})  # fmt: skip
    gen_ms = statistics.median(r["generate_ms"] for r in rounds)
    bench_ms = statistics.median(r["bench_ms"] for r in rounds)
    if args.json:
        print(json.dumps({"args": vars(args), "rounds": rounds, "generate_ms": gen_ms, "bench_ms": bench_ms}, indent=1))
    else:
        print(f"context {args.context}, batch {args.batch}, {args.threads} thread(s), {args.rounds} round(s):")
        print(f"  model.generate (DynamicCache)       {gen_ms:8.1f} ms/step")
        print(f"  kvpack bench generate, dynamic row  {bench_ms:8.1f} ms/step  ({bench_ms / gen_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
