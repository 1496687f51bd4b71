"""What the benchmark scripts record beside their rows (imported as ``_meta``: the scripts run from this folder)."""

from __future__ import annotations

import subprocess


def commit() -> str:
    """The checkout's short commit hash, or ``unknown`` outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def write_results(out: str, fields: dict, t0: float) -> dict:
    """Write ``fields`` as JSON to ``out`` (atomically), with the commit, the machine, torch's version and the
    seconds since ``t0`` beside them; print where it went. Returns what was written."""
    import json
    import platform
    import time
    from pathlib import Path

    import torch

    from kvpack.fsutil import atomic_write_text

    doc = {
        **fields,
        "commit": commit(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
    }
    atomic_write_text(Path(out), json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out} ({doc['seconds']} s)")
    return doc


def write_simulate_results(out: str, name: str, args, offsets: list[int], rows: dict, t0: float) -> dict:
    """:func:`write_results` for a simulate-engine benchmark over pooled windows: its name, the engine, the tokens
    and offsets of the windows, the threads (``args.tokens``, ``args.threads``) and the rows."""
    fields = {
        "benchmark": name,
        "engine": "simulate",
        "tokens": args.tokens,
        "offsets": offsets,
        "threads": args.threads,
        "results": rows,
    }
    return write_results(out, fields, t0)
