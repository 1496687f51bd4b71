"""Launch options of the Triton decode kernel on a GPU, per format: codes, warps, stages, splits, registers.

    python benchmarks/gpu_tune.py --out gpu_tune.json            # an NVIDIA GPU (about 2 minutes on an H200)
    TRITON_INTERPRET=1 python benchmarks/gpu_tune.py --smoke      # CPU: tiny shapes, every code path once

For each format and batch at one context (default 32k, the targets' context) the cache is built once on the
device, then timed the way ``gpu_decode.py`` times (CUDA graph replay, median):

1. at the default launch (:func:`kvpack.kernels.triton_decode.launch_config`, ``default_num_splits``), each
   way codes become numbers (``--codes``; the library's default first);
2. with the fastest of those, warps x stages x split count (``--warps``, ``--stages``, ``--split-factors``
   times the default);
3. the fastest so far again with ``--max-registers`` (default 128), where it used more registers.

Every variant's output (NaN-poisoned buffer) is compared with the converter path's output, and its registers
and spills are recorded. Per format, the variant with the lowest geometric mean of (time / default time) over
the batches is chosen; the JSON's ``chosen`` feeds ``gpu_decode.py --tuned``. A short table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode as gd  # (puts src/ on the path)

from kvpack.kernels import triton_decode as td
from kvpack.rotation import key_rotation, rotate

MAX_ERR = 1e-2  # fp16 outputs of the same function, splits merged in another order


def tune_one(args, device, timer, copy_gbps, fmt_name: str, batch: int, deadline: float) -> list[dict]:
    """Rows for every variant of one (format, batch); the default launch first."""
    fmt, sink = gd.bench_format(fmt_name, args.block)
    seq_len = args.context - 1  # a partly filled tail
    kv = gd.build_cache(fmt, batch, seq_len, args.kv_heads, args.head_dim, device, sink=sink)
    q = torch.randn(batch, args.q_heads, args.head_dim, device=device, dtype=torch.float16)
    if fmt.key.rotate:  # rotated keys: the dispatcher rotates the query (outside the timed call here)
        q = rotate(q, key_rotation(args.head_dim, device))
    nbytes = gd.cache_read_bytes(kv, seq_len)
    base_splits = td.default_num_splits(kv)
    base = td.launch_config(args.head_dim, args.block, args.q_heads // args.kv_heads)
    want = td.decode_attention(q, kv, codes="convert").float()  # the converter: no bit tricks in the reference
    coded = any(not s.is_passthrough for s in (fmt.key, fmt.value))  # integer codes or fp8: codes matter
    rows = []

    def run(variants, default_first: bool) -> None:
        for warps, stages, splits, codes, cap in variants:
            rows.append(time_variant(warps, stages, splits, codes, cap, default=default_first and not rows))

    def time_variant(warps, stages, splits, codes, cap, default):
        row = {"format": fmt_name, "batch": batch, "context": args.context, "num_warps": warps,
               "num_stages": stages, "num_splits": splits, "split_factor": splits / base_splits,
               "codes": codes, "max_registers": cap, "default": default}  # fmt: skip
        if time.monotonic() > deadline:
            return {**row, "error": "time budget"}
        try:
            launches, out = td.build_launches(
                q, kv, num_splits=splits, num_warps=warps, num_stages=stages, codes=codes, max_registers=cap
            )
            out.fill_(float("nan"))  # poisoned: every element must be written
            compiled = launches[0].run()
            for launch in launches[1:]:
                launch.run()
            err = float((out.float() - want).abs().max())
            row.update(max_abs_err=err, ok=err <= MAX_ERR)
            row.update(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
            row.update(timer(lambda launches=launches: [launch.run() for launch in launches]))
        except Exception as e:  # a variant that does not compile or launch (too much shared memory, say)
            return {**row, "error": f"{type(e).__name__}: {e}"[:300]}
        row["gbps"] = nbytes / (row["median_ms"] * 1e-3) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / copy_gbps
        print(f"  {fmt_name} b{batch} w{warps} s{stages} splits {splits} {codes} cap {cap}: {row['median_ms']:.3f} ms "
              f"{row['pct_copy']:.0f}% copy, err {err:.1e}, regs {row['n_regs']}", flush=True)  # fmt: skip
        return row

    # 1. how codes become numbers, at the default launch (the library's default first)
    first = base["num_warps"], base["num_stages"], base_splits
    run([(*first, c, None) for c in (args.codes if coded else [None])], True)
    timed = [r for r in rows if r.get("ok")]
    codes = min(timed, key=lambda r: r["median_ms"])["codes"] if timed else None
    # 2. warps x stages x splits with the fastest codes
    grid = []
    for warps, stages, factor in itertools.product(args.warps, args.stages, args.split_factors):
        v = (warps, stages, max(1, round(base_splits * factor)), codes, None)
        if v not in grid and v != (*first, codes, None):
            grid.append(v)
    run(grid, False)
    # 3. the fastest so far with a register cap, where it used more (more programs per SM)
    timed = [r for r in rows if r.get("ok")]
    best = min(timed, key=lambda r: r["median_ms"]) if timed else None
    if best and args.max_registers and (best.get("n_regs") or 0) > args.max_registers:
        run([(best["num_warps"], best["num_stages"], best["num_splits"], best["codes"], args.max_registers)], False)
    return rows


def choose(rows: list[dict], batches: list[int]) -> dict[str, dict]:
    """Per format, the variant (warps, stages, split factor) with the lowest geometric mean of time relative
    to the default launch over all batches; only variants that ran correctly at every batch count."""
    chosen = {}
    for fmt_name in dict.fromkeys(r["format"] for r in rows):
        base = {
            r["batch"]: r["median_ms"] for r in rows if r["format"] == fmt_name and r["default"] and "median_ms" in r
        }
        scores: dict[tuple, list[float]] = {}
        for r in rows:
            if r["format"] == fmt_name and r.get("ok") and r["batch"] in base:
                key = (r["num_warps"], r["num_stages"], round(r["split_factor"], 3), r["codes"], r["max_registers"])
                scores.setdefault(key, []).append(r["median_ms"] / base[r["batch"]])
        full = {k: v for k, v in scores.items() if len(v) == len(base) == len(batches)}
        if not full:
            continue
        key, ratios = min(full.items(), key=lambda kv: statistics.geometric_mean(kv[1]))
        gain = statistics.geometric_mean(ratios)
        chosen[fmt_name] = {"num_warps": key[0], "num_stages": key[1], "split_factor": key[2], "codes": key[3],
                            "max_registers": key[4],
                            "time_vs_default": gain}  # fmt: skip
    return chosen


def table(rows: list[dict], chosen: dict[str, dict]) -> str:
    head = f"{'format':<10} {'batch':>5} {'default ms':>10} {'%copy':>6} {'best ms':>8} {'%copy':>6}  best launch"
    lines = [head, "-" * len(head)]
    for fmt_name in dict.fromkeys(r["format"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows if r["format"] == fmt_name):
            mine = [r for r in rows if r["format"] == fmt_name and r["batch"] == batch and r.get("ok")]
            dflt = next((r for r in mine if r["default"]), None)
            if not mine or dflt is None:
                lines.append(f"{fmt_name:<10} {batch:>5}  (no correct default run)")
                continue
            best = min(mine, key=lambda r: r["median_ms"])
            lines.append(
                f"{fmt_name:<10} {batch:>5} {dflt['median_ms']:>10.3f} {dflt['pct_copy']:>6.1f} "
                f"{best['median_ms']:>8.3f} {best['pct_copy']:>6.1f}  warps {best['num_warps']} stages "
                f"{best['num_stages']} splits {best['num_splits']} codes {best['codes']}"
            )
    for fmt_name, c in chosen.items():
        lines.append(f"chosen {fmt_name}: {c}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (TRITON_INTERPRET=1 on a CPU)")
    p.add_argument("--out", default="gpu_tune.json")
    p.add_argument("--formats", nargs="+", default=["int8", "fp8", "int4", "kivi2"])
    p.add_argument("--codes", nargs="+", default=["ptx", "bits", "convert"], help="for quantized formats")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--context", default="32k")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--split-factors", type=float, nargs="+", default=[0.5, 1, 2, 4])
    p.add_argument("--max-registers", type=int, default=128, help="cap tried on the fastest variant (0: none)")
    gd.add_layer_args(p, budget_s=100.0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if args.smoke:
        if not gd.smoke_possible():
            return 2
        args.formats, args.batches, args.context, args.warps, args.stages = ["int8", "int4"], [2], "72", [4], [1]
        args.split_factors, args.kv_heads, args.q_heads, args.head_dim, args.block = [1, 2], 2, 4, 32, 16
        args.codes = ["bits", "convert"]  # no PTX under the interpreter
        args.reps = 2
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke and TRITON_INTERPRET=1 to exercise the code paths", file=sys.stderr)
        return 2
    args.context = gd.parse_tokens(args.context)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    timer = gd.Timer(device, warmup=1 if args.smoke else 5, reps=args.reps)
    copy = gd.copy_bandwidth(device, (1 << 20) if args.smoke else (4 << 30), timer)
    print(f"device copy: {copy['gbps']:.1f} GB/s (read + write)", flush=True)
    rows = []
    for fmt_name in args.formats:
        for batch in args.batches:
            rows += tune_one(args, device, timer, copy["gbps"], fmt_name, batch, t0 + args.budget_s)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the cache built for this format and batch is gone
    chosen = choose(rows, args.batches)
    bad = [r for r in rows if r.get("ok") is False]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "args": vars(args), "copy": copy, "rows": rows, "chosen": chosen,
              "elapsed_s": time.monotonic() - t0}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in bad:
        print(f"WRONG OUTPUT: {r}")
    print(f"results: {args.out} ({result['elapsed_s']:.0f}s)")
    print(table(rows, chosen))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
