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
