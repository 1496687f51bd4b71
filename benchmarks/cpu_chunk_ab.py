"""Compare two builds of the CPU chunk kernel's compiled loops in one process, call by call.

A change to ``kvpack/kernels/cpu_chunk_numba.py`` needs its own build, and this shared box moves a call by
tens of percent between processes; loading both versions of the module into one process (each under its own
name, each with its own numba disk cache) and alternating them round by round gives ratios that hold up.
Each side is a git revision (the module as committed there) or a file path:

    python benchmarks/cpu_chunk_ab.py --a HEAD~1 --b src/kvpack/kernels/cpu_chunk_numba.py
    python benchmarks/cpu_chunk_ab.py --a HEAD --b HEAD --rows 384,1024 --step 128,256   # tile sizes, one build

Both sides run through the current launcher (``kvpack.kernels.cpu_chunk``: same checks, same arguments), so
the compiled ``chunk`` signature must match it. ``--rows`` / ``--step`` pair up with ``--a`` / ``--b``
(one value: both). Prints each side's median over the rounds (one call per round, after one untimed
call) and the median of the per-round ratios B/A, plus the largest difference between the two outputs.
Shapes: batch 1, 32 q / 8 kv heads, head_dim 128, block 64, shuffled block ids.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvpack.bench.decode import build_paged_kv
from kvpack.kernels import chunk_attention, cpu_chunk


def _source(side: str) -> str:
    if os.path.isfile(side):
        with open(side, encoding="utf-8") as f:
            return f.read()
    return subprocess.run(
        ["git", "show", f"{side}:src/kvpack/kernels/cpu_chunk_numba.py"], check=True, capture_output=True, text=True
    ).stdout


def _load(side: str, tag: str, folder: str):
    name = f"kvpack_chunk_ab_{tag}"
    with open(os.path.join(folder, name + ".py"), "w", encoding="utf-8") as f:
        f.write(_source(side))
    mod = importlib.import_module(name)
    if not hasattr(mod, "variant"):  # builds from before the AMX product: always vdpbf16ps / FMAs
        mod.variant, mod.target_has_amx = (lambda: "bf16"), (lambda: False)
    return mod


def _pair(text: str, flag: str) -> tuple[int, int]:
    vals = [int(x) for x in text.split(",")]
    if len(vals) not in (1, 2) or min(vals) <= 0:
        raise SystemExit(f"{flag} takes one or two positive integers, got {text!r}")
    return (vals[0], vals[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="HEAD", help="git revision or file of side A (default HEAD)")
    ap.add_argument("--b", default="src/kvpack/kernels/cpu_chunk_numba.py", help="side B (default the work tree)")
    ap.add_argument("--format", default="int8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rows", default=str(cpu_chunk.ROWS_PER_TILE), help="rows per tile, A[,B]")
    ap.add_argument("--step", default=str(cpu_chunk.STEP_TOKENS), help="positions per softmax step, A[,B]")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, steps = _pair(args.rows, "--rows"), _pair(args.step, "--step")
    folder = tempfile.mkdtemp(prefix="kvpack-chunk-ab-")
    sys.path.insert(0, folder)
    mods = [_load(args.a, "a", folder), _load(args.b, "b", folder)]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 8, args.context, 128, generator=g)
    v = torch.randn(1, 8, args.context, 128, generator=g)
    kv = build_paged_kv(args.format, k, v, 64, 0)
    q = torch.randn(1, args.chunk, 32, 128, generator=g)
    out = torch.empty_like(q)

    def call(i: int) -> float:
        cpu_chunk._nb = lambda m=mods[i]: m
        cpu_chunk.ROWS_PER_TILE, cpu_chunk.STEP_TOKENS = rows[i], steps[i]
        t0 = time.perf_counter()
        chunk_attention(q, kv, backend="cpu", out=out)
        return time.perf_counter() - t0

    outs = []
    for i in (0, 1):
        call(i)
        outs.append(out.clone())
    times: list[list[float]] = [[], []]
    for _ in range(args.rounds):
        for i in (0, 1):
            times[i].append(call(i))
    ratios = [b / a for a, b in zip(*times)]
    for i, side in enumerate((args.a, args.b)):
        print(f"{'AB'[i]} {side} ({mods[i].variant()}, rows {rows[i]}, step {steps[i]}): "
              f"median {1e3 * statistics.median(times[i]):.1f} ms")  # fmt: skip
    print(f"B/A median ratio {statistics.median(ratios):.3f}; max |A - B| {(outs[0] - outs[1]).abs().max().item():.2e}")
    print(f"{args.format}, context {args.context}, chunk {args.chunk}, {args.threads} thread(s), {args.rounds} rounds")


if __name__ == "__main__":
    main()
