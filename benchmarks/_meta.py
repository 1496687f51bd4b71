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
