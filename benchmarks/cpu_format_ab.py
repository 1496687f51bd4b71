"""Compare formats on the CPU decode kernel in one process, call by call, over the same keys and values.

Between processes this shared box moves a 32k decode call by +-10%; formats alternated in one process, round by
round, give ratios that spread over a few percent. Each format's cache is built from the same float32 keys and
values (the decode sweep's case: batch 4, 32 q / 8 kv heads, head_dim 128, block 64, shuffled block ids).

    python benchmarks/cpu_format_ab.py --formats "int8;k=int8:channel:asym,v=int8:token,sink=1"      # ms, 2 threads
    python benchmarks/cpu_format_ab.py --formats "int8;int4" --threads 1 --hot-blocks 8   # ns per (token, kv head)

One thread reports that thread's CPU time per (token, kv head), the best of 5 calls per round; more threads
report the median wall time of 5 calls. The output gives each format's median over the rounds and its ratio to
the first format in every round.
"""

from __future__ import annotations

import argparse

import torch

from kvpack.bench.decode import DecodeConfig, _make_case, ab_report, ab_round, build_paged_kv, cycle_blocks
from kvpack.kernels import decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8;int4", help="';'-separated formats; ratios are to the first")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot-blocks", type=int, default=0, help="each sequence cycles over its first N blocks (8: in L2)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = [f.strip() for f in args.formats.split(";") if f.strip()]
    cfg = DecodeConfig(contexts=(args.context,), formats=tuple(formats))
    case = _make_case(cfg, args.context)
    kvs = [build_paged_kv(f, case.k, case.v, cfg.block_size) for f in formats]
    for kv in kvs:
        if args.hot_blocks:
            cycle_blocks(kv, args.hot_blocks)
    out = torch.empty_like(case.q)
    pairs = case.k.shape[0] * case.k.shape[1] * args.context  # (token, kv head) pairs in one call
    res: dict[str, list[float]] = {f: [] for f in formats}
    for kv in kvs:
        decode_attention(case.q, kv, backend="cpu", out=out)  # compile and check once, outside the timing
    for _ in range(args.rounds):
        for f, kv in zip(formats, kvs):
            res[f].append(
                ab_round(lambda kv=kv: decode_attention(case.q, kv, backend="cpu", out=out), args.threads, pairs)
            )
    ab_report(f"context {args.context}{', hot' if args.hot_blocks else ''}", args.threads, res)


if __name__ == "__main__":
    main()
