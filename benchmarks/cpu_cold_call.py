"""What a CPU decode call costs when the caches are cold, as in a serving engine between two calls of a layer.

Times ``kvpack.kernels.decode_attention`` on the embedded model's shape (3 kv heads, 9 query heads, head_dim 64)
three ways, each the median of the calls after ten warm ones: ``hot`` (called back to back), ``flush`` (64 MiB
written before each call: nothing of the cache, the Python around the kernel or its code is left in the caches)
and ``gemm`` (twenty small float32 matrix products before each call, about what a layer's projections do).

    python benchmarks/cpu_cold_call.py --format int4 --batch 32 --context 320 --threads 2

``--dispatch`` times what any compiled call pays before its work instead, the same three ways: an empty numba
function given 3 and given 7 arrays, and the vLLM backend's tail rows' call (``kvpack.kernels.cpu_seal.write_rows``:
32 rows of the step's keys and values, views of the fused projection as vLLM hands them over, into their tails).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
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
    ap.add_argument("--dispatch", action="store_true", help="time empty compiled calls and the tail rows' call")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.dispatch:
        _dispatch(args.calls)
        return
    cache = PagedKVCache(args.format, 1, H, D, num_blocks=args.batch * (args.context // 16 + 2) + 8)
    ids = [cache.add_sequence() for _ in range(args.batch)]
    for sid in ids:
        cache.append(0, [sid], torch.randn(1, H, args.context, D), torch.randn(1, H, args.context, D))
    kv = cache.view(0, ids)
    q = torch.randn(args.batch, HQ, D)
    out = torch.empty_like(q)
    row = _three_ways(lambda: decode_attention(q, kv, out=out), args.calls)
    print(f"{args.format}, batch {args.batch} x {args.context} tokens, {args.threads} thread(s): {row}")


def _three_ways(call: Callable[[], object], calls: int) -> str:
    """The median time of ``call`` hot, after a 64 MiB flush and after small matrix products (ten warm calls out)."""
    big = torch.zeros(64 * 2**20 // 4)
    w, x = torch.randn(576, 1536), torch.randn(32, 576)
    row = []
    for mode in ("hot", "flush", "gemm"):
        times = []
        for _ in range(calls):
            if mode == "flush":
                big.add_(1.0)
            elif mode == "gemm":
                for _ in range(20):
                    x @ w
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        row.append(f"{mode} {1e6 * statistics.median(times[10:]):.1f} us")
    return ", ".join(row)


def _dispatch(calls: int) -> None:
    from numba import njit

    from kvpack.kernels import cpu_seal

    @njit(nogil=True)
    def empty3(a, b, c):
        return 0

    @njit(nogil=True)
    def empty7(a, b, c, d, e, f, g):
        return 0

    tails = (torch.zeros(32, H, 64, D), torch.zeros(32, H, 64, D))
    qkv = torch.randn(32, (HQ + 2 * H) * D)  # the step's rows: views of the fused projection
    new = (qkv[:, HQ * D : (HQ + H) * D].view(32, H, D), qkv[:, (HQ + H) * D :].view(32, H, D))
    toks, offs = np.arange(32), np.full(32, 17)
    arrays = tuple(t.numpy() for t in (*tails, *new))
    print("empty, 3 arrays:", _three_ways(lambda: empty3(arrays[0], arrays[2], toks), calls))
    print("empty, 7 arrays:", _three_ways(lambda: empty7(*arrays, toks, toks, offs), calls))
    print("write_rows, 32 rows:", _three_ways(lambda: cpu_seal.write_rows(tails, new, toks, toks, offs), calls))


if __name__ == "__main__":
    main()
