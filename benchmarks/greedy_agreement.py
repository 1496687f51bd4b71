"""Greedy agreement of kvpack formats with transformers' DynamicCache on the embedded model.

The share of prompts whose greedy continuation is token for token the full-precision cache's, and where the
others first differ. The prompts are those of the vLLM engine test (``tests/test_vllm_engine.py``: real prose
sharing a 192-token prefix, plus 40-200 tokens of their own), 12 per seed, one at a time (batch 1, no padding),
through kvpack's transformers cache. Storage in float16 or bfloat16 (``kv=fp16``, ``kv=bf16``) shows how often a
near tie flips on rounding alone.

    python benchmarks/greedy_agreement.py --seeds 3,4,5,6 --formats "int8;kv=fp16" --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

import kvpack.hf
from kvpack.bench.vllm import prose_token_ids, workload
from kvpack.fsutil import atomic_write_text
from kvpack.models.embedded import ensure_converted


def _continuations(model, prompts: list[list[int]], fmt: str | None, new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (``fmt`` None: DynamicCache)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        model.set_attn_implementation("sdpa")  # cache_for switches it to kvpack; DynamicCache needs it back
        extra = {}
        if fmt is not None:
            cache = kvpack.hf.cache_for(model, format=fmt, max_tokens=len(p) + new_tokens + 16)
            extra = {kvpack.hf.cache_kwarg(model): cache}
        out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, **extra)
        outs.append(out[0, len(p) :].tolist())
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="3,4,5,6", help="workload seeds, 12 prompts each (3: the vLLM test's)")
    ap.add_argument("--formats", default="int8;kv=fp16;kv=bf16", help="kvpack formats, separated by ';'")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(ensure_converted())
    model, _ = kvpack.hf.load_model()
    ids = prose_token_ids(path)
    prompts = []
    for seed in (int(s) for s in args.seeds.split(",")):
        prompts += workload(ids, requests=12, prefix=192, extra=(40, 200), seed=seed)
    reference = _continuations(model, prompts, None, args.new_tokens)
    rows = []
    for fmt in args.formats.split(";"):
        t0 = time.perf_counter()
        outs = _continuations(model, prompts, fmt, args.new_tokens)
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs, reference)]
        diverged = sorted(f for f in first if f is not None)
        rows.append({"format": fmt, "identical": len(prompts) - len(diverged), "prompts": len(prompts),
                     "first_divergence": diverged, "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(
            f"{fmt:45s} {rows[-1]['identical']}/{len(prompts)} identical; first divergences at {diverged}", flush=True
        )
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        flags = " ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in vars(args).items() if k != "json")
        meta = {
            "command": f"python benchmarks/greedy_agreement.py {flags}",
            "commit": commit,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        }
        atomic_write_text(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
