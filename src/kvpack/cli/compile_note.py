"""One line on stderr before the CPU kernels' first compile, and how long it took (the commands that run them)."""

from __future__ import annotations

import sys


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def compile_cpu_kernels(backend: str = "cpu") -> float | None:
    """Compile the CPU kernels now when numba's disk cache lacks them and ``backend`` (``auto``/``cpu``) will
    run them on the CPU, saying so on stderr (:func:`kvpack.kernels.warmup.compile_if_cold`)."""
    if backend not in ("auto", "cpu"):
        return None
    from kvpack.kernels.warmup import compile_if_cold

    return compile_if_cold(_stderr)
