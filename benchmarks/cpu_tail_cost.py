"""What a token of the open block (the full-precision tail) costs the CPU decode kernel, against a sealed token.

Times ``kvpack.kernels.decode_attention`` on a cache of ``--batch`` sequences at three lengths: ``B * k`` (every
token sealed, no tail), ``B * k + B - 1`` (a tail of ``B - 1`` tokens) and ``2 * B * k`` (twice the sealed
blocks); the differences per token and kv head are the tail's and a sealed token's cost. The shape is the
embedded model's (3 kv heads, 9 query heads, head_dim 64), what the vLLM backend decodes at every step.

    python benchmarks/cpu_tail_cost.py --format int4,sink=0 --threads 1
    python benchmarks/cpu_tail_cost.py --format int8 --threads 1 --contexts 1,64,300   # us per call at these lengths

``--contexts`` times whole calls at the given lengths instead: a 1-token sequence is almost all per-item fixed work
(one item per sequence and kv head), 64 tokens one sealed block, 300 the lengths of vLLM's quick workload.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpack.cache import PagedKVCache
from kvpack.kernels import decode_attention

H, HQ, D = 3, 9, 64


def _call_us(fmt: str, batch: int, ctx: int, repeats: int) -> float:
    cache = PagedKVCache(fmt, 1, H, D, num_blocks=batch * (ctx // 16 + 2) + 8)
    ids = [cache.add_sequence() for _ in range(batch)]
    for sid in ids:
        cache.append(0, [sid], torch.randn(1, H, ctx, D), torch.randn(1, H, ctx, D))
    kv = cache.view(0, ids)
    q = torch.randn(batch, HQ, D)
    out = torch.empty_like(q)
    for _ in range(5):
        decode_attention(q, kv, out=out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        decode_attention(q, kv, out=out)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int4,sink=0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4, help="sealed blocks per sequence (k)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--contexts", default="", help="comma-separated lengths: time a call at each instead")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.contexts:
        for ctx in (int(c) for c in args.contexts.split(",")):
            us = _call_us(args.format, args.batch, ctx, args.repeats)
            print(f"{args.format}, batch {args.batch}, {args.threads} thread(s), {ctx} tokens: {us:.1f} us per call")
        return
    b = PagedKVCache(args.format, 1, H, D, num_blocks=2).format.block_size
    sealed = b * args.blocks
    base = _call_us(args.format, args.batch, sealed, args.repeats)
    tail = _call_us(args.format, args.batch, sealed + b - 1, args.repeats)
    double = _call_us(args.format, args.batch, 2 * sealed, args.repeats)
    per = args.batch * H
    print(f"{args.format}, batch {args.batch}, {args.threads} thread(s): {sealed} tokens {base:.0f} us, "
          f"+{b - 1} tail {tail:.0f} us, {2 * sealed} tokens {double:.0f} us")  # fmt: skip
    print(f"  a tail token: {1e3 * (tail - base) / (per * (b - 1)):.1f} ns per kv head; "
          f"a sealed token: {1e3 * (double - base) / (per * sealed):.1f} ns")  # fmt: skip


if __name__ == "__main__":
    main()
