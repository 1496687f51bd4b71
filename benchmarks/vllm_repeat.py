"""`kvpack bench vllm` several times in a row, the medians kept: the table the docs quote, with every run's numbers.

Each run already starts every provider in a fresh process, one after another, so the providers alternate across
runs. `tokens_per_s` and `wall_s` are the medians of the runs (their values per run in `*_runs`); every other column
(capacity, running requests, preemptions, greedy agreement) must be the same in all runs, and a column that is not
is kept per run too (`<column>_runs`) and named on stderr.

    python benchmarks/vllm_repeat.py --repeat 3 --out benchmarks/results/vllm_quick_cpu_blocks.json -- \\
        --quick --dtype bfloat16 --kv-mib 96 --formats 'vllm-default,int8,int8,block=16'

Everything after ``--`` goes to `kvpack bench vllm` (which gets `--json` added).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from _meta import commit

TIMED = ("tokens_per_s", "wall_s")


def merge(runs: list[list[dict]]) -> list[dict]:
    """One row per provider: the median of the timed columns, each run's values beside them."""
    names = [r["format"] for r in runs[0]]
    if any([r["format"] for r in run] != names for run in runs):
        raise SystemExit("vllm_repeat: the runs did not give the same providers in the same order")
    rows = []
    for i, name in enumerate(names):
        per_run = [run[i] for run in runs]
        row = dict(per_run[0])
        for col in TIMED:
            vals = [r[col] for r in per_run]
            row[col] = statistics.median(vals)
            row[f"{col}_runs"] = vals
        for col in list(row):
            if col in TIMED or col.endswith("_runs"):
                continue
            vals = [r.get(col) for r in per_run]
            if any(v != vals[0] for v in vals):
                row[f"{col}_runs"] = vals
                print(f"vllm_repeat: {name}: {col} differs between runs: {vals}", file=sys.stderr)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs of the whole provider list (default 3)")
    p.add_argument("--out", type=Path, help="write the merged rows and how they were made here (JSON)")
    p.add_argument("--note", default="", help="a line on the machine's state (quiet, loaded) for the JSON")
    args = p.parse_args(own)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    kvpack = Path(sys.executable).with_name("kvpack")
    cmd = [str(kvpack) if kvpack.exists() else "kvpack", "bench", "vllm", *bench, "--json"]
    runs = []
    for i in range(args.repeat):
        print(f"vllm_repeat: run {i + 1} of {args.repeat}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stderr[-4000:])
            raise SystemExit(f"vllm_repeat: run {i + 1} failed with status {out.returncode}")
        try:
            runs.append(json.loads(out.stdout[out.stdout.index("[") :]))
        except ValueError as e:
            raise SystemExit(
                f"vllm_repeat: run {i + 1} printed no JSON rows ({e}); its output: {out.stdout[-2000:]}"
            ) from None
    rows = merge(runs)
    for r in rows:
        print(
            f"{r['format']:28s} capacity {r['kv_capacity_tokens']:>7,}  running {r['max_running']:>3}  "
            f"preempted {r['preemptions']:>3}  {r['tokens_per_s']:7.1f} tok/s ({', '.join(f'{v:.1f}' for v in r['tokens_per_s_runs'])})"
            f"  greedy {r['greedy_match']:.2f}"
        )
    if args.out is not None:
        from kvpack.fsutil import atomic_write_text

        doc = {
            "command": f"{shlex.join(cmd[1:])}, {args.repeat} runs in a row; rows: the median tokens_per_s and wall_s, "
            "each run's in *_runs",
            "commit": commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + (f"; {args.note}" if args.note else ""),
            "date": datetime.date.today().isoformat(),
            "rows": rows,
        }
        atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
