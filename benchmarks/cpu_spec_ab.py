"""Compare settings of a CPU kernel spec parameter in one process, call by call.

Between processes this shared box moves a 32k decode call by +-10%; settings alternated in one process,
round by round, give ratios that spread over a few percent. Only parameters that are data to the compiled
kernel can be compared this way (a spec's ``P_*`` entries, e.g. ``P_MULTI``: blocks per softmax step,
``P_FAR``: prefetch distance); a change to the code needs separate builds.

    python benchmarks/cpu_spec_ab.py --param P_MULTI --values 16,1,8               # wall ms, 2 threads
    python benchmarks/cpu_spec_ab.py --param P_MULTI --values 16,1 --threads 1     # CPU ns per (token, kv head)
    python benchmarks/cpu_spec_ab.py --param P_MULTI --values 16,1 --threads 1 --hot-blocks 8  # data in L2

One thread reports that thread's CPU time per (token, kv head), the best of 5 calls per round; more threads
report the median wall time of 5 calls. Both print each setting's median over the rounds and its ratio to the
first setting in every round. Shapes: batch 4, 32 q / 8 kv heads, head_dim 128, block 64, shuffled block ids.
"""

from __future__ import annotations

import argparse

import torch

from kvpack.bench.decode import ab_report, ab_round, add_case_options, case_from_options
from kvpack.kernels import cpu_decode, decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--param", default="P_MULTI", help="a spec parameter of kvpack.kernels.cpu_decode_numba (P_*)")
    ap.add_argument("--values", default="16,1", help="comma-separated settings; ratios are to the first")
    ap.add_argument("--role", choices=("key", "value", "both"), default="both", help="which spec gets the setting")
    ap.add_argument("--rounds", type=int, default=5)
    add_case_options(ap, threads=2)
    args = ap.parse_args()
    case, kv = case_from_options(args)
    n = args.context
    out = torch.empty_like(case.q)

    def call() -> None:
        decode_attention(case.q, kv, backend="cpu", out=out)

    call()
    state, index = cpu_decode._prepare(kv), getattr(cpu_decode._nb(), args.param)
    specs = [s for r, s in (("key", state.kp), ("value", state.vp)) if args.role in (r, "both")]
    old = [int(s[index]) for s in specs]
    values = [int(v) for v in args.values.split(",")]
    res: dict[str, list[float]] = {str(v): [] for v in values}
    pairs = case.k.shape[0] * case.k.shape[1] * n  # (token, kv head) pairs in one call
    try:
        for _ in range(args.rounds):
            for v in values:
                for s in specs:
                    s[index] = v
                res[str(v)].append(ab_round(call, args.threads, pairs))
    finally:
        for s, o in zip(specs, old):
            s[index] = o
    ab_report(f"{args.format}, context {n}{', hot' if args.hot_blocks else ''}: {args.param}", args.threads, res)


if __name__ == "__main__":
    main()
