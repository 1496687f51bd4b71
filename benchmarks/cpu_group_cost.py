"""What the CPU decode kernel's call costs against the number of query heads per kv head (the GQA group).

    python benchmarks/cpu_group_cost.py [--formats int4,int8] [--groups 1,2,3,4,5,8] [--threads 1]

One decode call over ``--batch`` sequences of ``--context`` tokens, 3 kv heads of head_dim 64 (the embedded model's
shape, whose group is 3), 32-token blocks (what the vLLM backend serves in the quick workload); the median of
``--calls`` calls per group, rounds alternated over the groups, the median over rounds. Where the time barely moves
with the group, the cost is in reading and unpacking each token's codes, not in the query heads' dot products.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpack.formats import PRESETS
from kvpack.kernels import decode_attention
from kvpack.testing import random_paged_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4,int8", help="presets, comma list")
    ap.add_argument("--groups", default="1,2,3,4,5,8", help="query heads per kv head, comma list")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import numba

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",")]
    print(f"us per call, {args.batch} x {args.context} tokens, 3 kv heads, head_dim 64, {args.threads} thread(s)")
    print(f"{'format':8s} " + " ".join(f"{f'G={g}':>7s}" for g in groups))
    for name in args.formats.split(","):
        fmt = PRESETS[name].with_block_size(32)
        kv, _, _ = random_paged_kv(fmt, [args.context] * args.batch, kv_heads=3, head_dim=64, seed=0, sink=1)
        times: dict[int, list[float]] = {g: [] for g in groups}
        for _ in range(args.rounds):
            for g in groups:
                q = torch.randn(args.batch, 3 * g, 64)
                for _ in range(5):
                    decode_attention(q, kv, backend="cpu")
                calls = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    decode_attention(q, kv, backend="cpu")
                    calls.append(time.perf_counter() - t0)
                times[g].append(statistics.median(calls) * 1e6)
        print(f"{name:8s} " + " ".join(f"{statistics.median(times[g]):7.0f}" for g in groups))


if __name__ == "__main__":
    main()
