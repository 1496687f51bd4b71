"""Write-path cost of the paged cache: one decode step's append for every layer, and a prefill.

    python benchmarks/cache_append.py [--layers 30] [--batch 8] [--steps 128] [--threads 1] [--rounds 3 --json out.json]

Shapes: SmolLM2-135M (3 kv heads, head_dim 64) and a Llama-8B-like layer (8 kv heads, head_dim 128);
formats fp16 (passthrough baseline), int8 and int4; fp16 tails. Each decode step appends one token per
sequence to all layers, layer 0 first, as a model's forward does. Sequences start from a 1000-token
prompt, so every 64th step seals a block in every row. Columns:

* ``step``: median microseconds of a step that seals nothing (the common decode step);
* ``mean``: mean over all steps (seals amortized);
* ``seal``: median of the sealing steps, and ``quant``: the same blocks through ``quant.quantize`` alone
  (the part of a seal that is the reference quantizer, not the cache's gather / scatter);
* ``views``: ``cache.view`` for all layers (what attention asks for each step);
* ``prefill``: tokens per second appending the 1000-token prompt of every row to all layers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from _meta import commit as git_commit

from kvpack.cache import PagedKVCache
from kvpack.fsutil import atomic_write_text
from kvpack.quant import quantize

SHAPES = {"smollm2 (3x64)": (3, 64), "llama-8b (8x128)": (8, 128)}
FORMATS = ["fp16", "int8", "int4"]


def bench(fmt: str, kv_heads: int, head_dim: int, layers: int, batch: int, steps: int, prompt: int) -> dict:
    blocks = batch * ((prompt + steps) // 64 + 2) + 1
    cache = PagedKVCache(fmt, layers, kv_heads, head_dim, blocks, tail_dtype=torch.float16, max_seqs=batch)
    sids = [cache.add_sequence() for _ in range(batch)]
    kp = torch.randn(batch, kv_heads, prompt, head_dim, dtype=torch.float16)
    t0 = time.perf_counter()
    for layer in range(layers):
        cache.append(layer, sids, kp, kp)
    prefill_tok_s = batch * prompt / (time.perf_counter() - t0)
    ks = torch.randn(steps, batch, kv_heads, 1, head_dim, dtype=torch.float16)
    times, seal_times = [], []
    for step in range(steps):
        k = ks[step]
        seals = (cache.seq_len(sids[0]) + 1) % 64 == 0
        t0 = time.perf_counter()
        for layer in range(layers):
            cache.append(layer, sids, k, k)
        dt = (time.perf_counter() - t0) * 1e6
        (seal_times if seals else times).append(dt)
    t0 = time.perf_counter()
    for _ in range(20):
        for layer in range(layers):
            cache.view(layer, sids)
    view_us = (time.perf_counter() - t0) * 1e6 / 20
    x = torch.randn(batch, kv_heads, 64, head_dim, dtype=torch.float16)
    quant = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _layer in range(layers):
            quantize(x, cache.format.key)
            quantize(x, cache.format.value)
        quant.append((time.perf_counter() - t0) * 1e6)
    return {
        "median_us": statistics.median(times),
        "mean_us": statistics.mean(times + seal_times),
        "seal_us": statistics.median(seal_times) if seal_times else float("nan"),
        "quant_us": statistics.median(quant),
        "view_us": view_us,
        "prefill_tok_s": prefill_tok_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--prompt", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="measure every row this many times, alternated; medians")
    p.add_argument("--json", help="write the rows (medians) and every round's here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"append, {args.layers} layers x batch {args.batch}, fp16 tails, {args.steps} decode steps after a "
        f"{args.prompt}-token prompt, {args.threads} thread(s); microseconds per step (all layers)"
    )
    print(
        f"{'shape':18} {'format':6} {'step':>7} {'mean':>7} {'seal':>8} {'quant':>8} {'views':>6} {'prefill tok/s':>14}"
    )
    cases = [(shape, h, d, fmt) for shape, (h, d) in SHAPES.items() for fmt in FORMATS]
    rounds = [
        [{"shape": shape, "format": fmt, **bench(fmt, h, d, args.layers, args.batch, args.steps, args.prompt)}
         for shape, h, d, fmt in cases]
        for _ in range(args.rounds)
    ]  # fmt: skip
    rows = []
    for i, (shape, _, _, fmt) in enumerate(cases):
        r = {k: statistics.median(rnd[i][k] for rnd in rounds) for k in rounds[0][i] if k not in ("shape", "format")}
        rows.append({"shape": shape, "format": fmt, **r})
        print(
            f"{shape:18} {fmt:6} {r['median_us']:7.0f} {r['mean_us']:7.0f} {r['seal_us']:8.0f} "
            f"{r['quant_us']:8.0f} {r['view_us']:6.0f} {r['prefill_tok_s']:14.0f}"
        )
    if args.json:
        commit = git_commit()
        flags = " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "json")
        meta = {"command": f"python benchmarks/cache_append.py {flags}", "commit": commit,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__}  # fmt: skip
        atomic_write_text(args.json, json.dumps({**meta, "rows": rows, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
