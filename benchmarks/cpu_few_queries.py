"""The fused CPU decode and chunk kernels at a few queries per sequence: where the vLLM backend sends a request's
token and its drafts (``kvpack.integrations.vllm.layer.DECODE_QUERIES``).

On the embedded model's shape (3 kv heads, 9 query heads, head_dim 64) over a random cache of ``--batch`` sequences
of 250-450 tokens, times one ``decode_attention`` call (one query per sequence) and, per number of queries ``T``
in ``--queries``, one ``chunk_attention`` call (``chunk_T_us``), ``T`` decode calls, one per position, each history
cut to its position (``calls_T_us``: what the vLLM backend did for a token and its drafts), and one decode call with
the ``T`` positions as query heads (``fused_T_us``, ``kvpack.kernels.decode_positions``: what it does now); each the median of five rounds
of back-to-back calls, in microseconds. Every query lies in its sequence's open block: the lengths are moved to
leave ``max(T) - 1`` tail rows at least.

    python benchmarks/cpu_few_queries.py --format int8 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvpack.formats import parse_format
from kvpack.kernels import chunk_attention, decode_attention, decode_positions
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
    fmt = parse_format(args.format)
    counts = [int(x) for x in args.queries.split(",")]
    b, most = fmt.block_size, max(counts) - 1
    lens = [int(n) for n in np.random.default_rng(0).integers(250, 450, args.batch)]
    lens = [n if n % b >= most else n + most - n % b for n in lens]  # every query in the open block
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=H, head_dim=D, seed=0)
    q1 = torch.randn(args.batch, HQ, D)
    row = {"format": args.format, "batch": args.batch, "threads": args.threads}
    row["decode_us"] = round(_median_us(lambda: decode_attention(q1, kv, backend="cpu"), args.calls), 1)
    for t in counts:
        q = torch.randn(args.batch, t, HQ, D)
        row[f"chunk_{t}_us"] = round(_median_us(lambda q=q: chunk_attention(q, kv, backend="cpu"), args.calls), 1)
        if t == 1:
            continue
        cuts = [dataclasses.replace(kv, seq_lens=kv.seq_lens - (t - 1 - j)) for j in range(t)]

        def calls(q=q, cuts=cuts):
            for j, at in enumerate(cuts):
                decode_attention(q[:, j], at, backend="cpu")

        cut = torch.arange(t - 1, -1, -1, dtype=torch.int32).expand(args.batch, -1).contiguous()
        row[f"calls_{t}_us"] = round(_median_us(calls, args.calls), 1)
        row[f"fused_{t}_us"] = round(_median_us(lambda q=q, cut=cut: decode_positions(q, kv, cut), args.calls), 1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
