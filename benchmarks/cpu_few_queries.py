"""The fused CPU decode and chunk kernels at a few queries per sequence: where the vLLM backend sends a request's
token and its drafts (``kvpack.integrations.vllm.layer.DECODE_QUERIES``).

On the embedded model's shape (3 kv heads, 9 query heads, head_dim 64) over a random cache of ``--batch`` sequences
of 250-450 tokens, times one ``decode_attention`` call (one query per sequence) and one ``chunk_attention`` call
per number of queries in ``--queries``; each the median of five rounds of back-to-back calls, in microseconds. The
decode kernel's cost for T queries is about T decode calls (the backend makes one per query position).

    python benchmarks/cpu_few_queries.py --format int8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvpack.formats import parse_format
from kvpack.kernels import chunk_attention, decode_attention
from kvpack.testing import random_paged_kv

H, HQ, D = 3, 9, 64


def _median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queries", default="1,2,4,8", help="queries per sequence for the chunk kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = [int(n) for n in np.random.default_rng(0).integers(250, 450, args.batch)]
    kv, _, _ = random_paged_kv(parse_format(args.format), lens, kv_heads=H, head_dim=D, seed=0)
    q1 = torch.randn(args.batch, HQ, D)
    row = {"format": args.format, "batch": args.batch, "threads": args.threads}
    row["decode_us"] = round(_median_us(lambda: decode_attention(q1, kv, backend="cpu"), args.calls), 1)
    for t in (int(x) for x in args.queries.split(",")):
        q = torch.randn(args.batch, t, HQ, D)
        row[f"chunk_{t}_us"] = round(_median_us(lambda q=q: chunk_attention(q, kv, backend="cpu"), args.calls), 1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
