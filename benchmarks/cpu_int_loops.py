"""Time the CPU kernel's two integer loops alone, on rows that sit in L1 or L2.

The decode kernel spends its time in three places: the key loop (``_kdot_ir``: int16 query x codes, one
score per row and head), the value loop (``_vdot_ir``: int16 weights x codes into the accumulators) and
the per-block work around them (scales, the int16 query, max, exp2, the int16 weights). This script calls
the two loops directly, block after block over a buffer of ``--blocks`` blocks (1: 8 KiB of int8 rows,
in L1; 16: 128 KiB, in L2), for 4 query heads of one kv head, head_dim 128, block 64, nothing prefetched,
and prints nanoseconds per token (and cycles, given ``--ghz``). Against the kernel's per-core time it tells
how much of a token's time the loops' own instructions take when no memory stalls them::

    python benchmarks/cpu_int_loops.py --format int8 --ghz 4.2

Codes are random bytes, queries and weights random int16 in the ranges the kernel produces.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvpack.kernels import cpu_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int8", choices=("int8", "fp8"), help="one code per byte: int8 or fp8 e4m3")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens timed per measurement")
    ap.add_argument("--ghz", type=float, default=0.0, help="core clock, to print cycles per token too")
    args = ap.parse_args()

    from numba import njit

    nbm = cpu_decode._nb()
    kind = nbm.S8 if args.format == "int8" else nbm.E4M3
    d, bs = 128, 64
    u64 = np.uint64

    @njit
    def keys(pay, q16, qinv, sc, mx, reps, nblk):  # pragma: no cover - compiled
        for _ in range(reps):
            for j in range(nblk):
                nbm._kdot_int(kind, pay, u64(j * bs * d), u64(d), bs // 4, q16, 0, d // 32, qinv, 0, sc, 0, bs, 0,
                              mx, 0, u64(0), u64(0))  # fmt: skip

    @njit
    def values(pay, w16, acc, winv, reps, nblk):  # pragma: no cover - compiled
        for _ in range(reps):
            for j in range(nblk):
                nbm._vdot_int(kind, pay, u64(j * bs * d), u64(d), bs // 2, w16, 0, 2 * bs, acc, 0, d, d, winv, 0, d,
                              0, u64(0), u64(0))  # fmt: skip

    rng = np.random.default_rng(0)
    for nblk in args.blocks:
        pay = rng.integers(0, 256, nblk * bs * d, dtype=np.uint8)
        q16 = rng.integers(-20000, 20000, 4 * d, dtype=np.int16)
        w16 = rng.integers(0, 20000, 4 * bs, dtype=np.int16)
        qinv, winv, mx = np.ones(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.float32)
        sc, acc = np.zeros((4, bs), np.float32), np.zeros((4, d), np.float32)
        keys(pay, q16, qinv, sc, mx, 1, nblk)  # compile and warm
        values(pay, w16, acc, winv, 1, nblk)
        reps = max(1, args.tokens // (nblk * bs))
        ns = []
        for fn, arrs in ((keys, (pay, q16, qinv, sc, mx)), (values, (pay, w16, acc, winv))):
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                fn(*arrs, reps, nblk)
                best = min(best, time.perf_counter() - t)
            ns.append(best / (reps * nblk * bs) * 1e9)
        line = f"{nblk * bs * d // 1024:4d} KiB of rows: key loop {ns[0]:.2f} ns/token"
        line += f" ({ns[0] * args.ghz:.1f} cycles)" if args.ghz else ""
        line += f", value loop {ns[1]:.2f} ns/token" + (f" ({ns[1] * args.ghz:.1f} cycles)" if args.ghz else "")
        print(line)


if __name__ == "__main__":
    main()
