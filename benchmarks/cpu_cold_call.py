"""What a CPU decode call costs when the caches are cold, as in a serving engine between two calls of a layer.

Times ``kvpack.kernels.decode_attention`` on the embedded model's shape (3 kv heads, 9 query heads, head_dim 64)
three ways, each the median of the calls after ten warm ones: ``hot`` (called back to back), ``flush`` (64 MiB
written before each call: nothing of the cache, the Python around the kernel or its code is left in the caches)
and ``gemm`` (twenty small float32 matrix products before each call, about what a layer's projections do).

    python benchmarks/cpu_cold_call.py --format int4 --batch 32 --context 320 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpack.cache import PagedKVCache
from kvpack.kernels import decode_attention

H, HQ, D = 3, 9, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cache = PagedKVCache(args.format, 1, H, D, num_blocks=args.batch * (args.context // 16 + 2) + 8)
    ids = [cache.add_sequence() for _ in range(args.batch)]
    for sid in ids:
        cache.append(0, [sid], torch.randn(1, H, args.context, D), torch.randn(1, H, args.context, D))
    kv = cache.view(0, ids)
    q = torch.randn(args.batch, HQ, D)
    out = torch.empty_like(q)
    big = torch.zeros(64 * 2**20 // 4)
    w, x = torch.randn(576, 1536), torch.randn(32, 576)
    row = []
    for mode in ("hot", "flush", "gemm"):
        times = []
        for _ in range(args.calls):
            if mode == "flush":
                big.add_(1.0)
            elif mode == "gemm":
                for _ in range(20):
                    x @ w
            t0 = time.perf_counter()
            decode_attention(q, kv, out=out)
            times.append(time.perf_counter() - t0)
        row.append(f"{mode} {1e6 * statistics.median(times[10:]):.0f} us")
    print(f"{args.format}, batch {args.batch} x {args.context} tokens, {args.threads} thread(s): " + ", ".join(row))


if __name__ == "__main__":
    main()
