"""The CPU kernels' first compile: tell whether numba's disk cache holds them, and compile them on purpose.

The fused CPU kernels (:mod:`kvpack.kernels.cpu_decode_numba`, :mod:`kvpack.kernels.cpu_chunk_numba`) are numba
functions cached on disk (``cache=True``): the first run on a machine compiles them (about 4 minutes on one core),
later runs load them in about a second. One compile serves every format (pools arrive as flat typed views and
the payload kinds are all compiled at once), so a run can compile them up front, where it can say so, instead
of inside the first attention call while a progress bar sits at 0%.

:func:`cold_entries` answers without importing numba: it looks for the cache index (``.nbi``) of each
kernel's entry point where numba would put it (named after the function and its first line) (``NUMBA_CACHE_DIR``, else the module's ``__pycache__``, else
the user-wide cache folder) and calls it cold when there is none newer than its source file (numba drops an
index whose source changed). :func:`warm_up` runs one tiny decode and one tiny chunk through the CPU
backend, which compiles (or loads) everything a run needs.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ENTRIES", "cache_dirs", "cold_entries", "compile_if_cold", "warm_up"]

# (module file, compiled entry point): the functions whose first call compiles a kernel (``launch`` is the
# decode kernel on several threads, ``launch_one`` on one)
ENTRIES = (("cpu_decode_numba.py", "launch_one"), ("cpu_decode_numba.py", "launch"), ("cpu_chunk_numba.py", "chunk"))


def cache_dirs(source: Path) -> list[Path]:
    """Where numba looks for the cache of functions defined in ``source``, in its own order."""
    folder = source.resolve().parent
    # numba's cache subfolder outside the tree: the parent folder's name and a sha1 of its path
    sub = f"{folder.name}_{hashlib.sha1(str(folder).encode()).hexdigest()}"
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        return [Path(user) / sub]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return [folder / "__pycache__", Path(xdg) / "numba" / sub]


def _first_line(source: Path, entry: str) -> int | None:
    """``co_firstlineno`` of the function ``entry`` in ``source`` (its first decorator's line), which numba puts
    in the cache file names."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry:
            return min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return None


def _fresh_index(source: Path, entry: str) -> Path | None:
    """The cache index of ``entry`` if it exists and is not older than ``source`` (None: numba will compile)."""
    line = _first_line(source, entry)
    if line is None:
        return None
    src_mtime = source.stat().st_mtime
    name = f"{source.stem}.{entry}-{line}.py{sys.version_info[0]}{sys.version_info[1]}{sys.abiflags}.nbi"
    for d in cache_dirs(source):
        try:
            if (d / name).stat().st_mtime >= src_mtime:
                return d / name
        except OSError:
            continue
    return None


def cold_entries() -> list[str]:
    """The CPU kernel entry points numba's disk cache does not hold yet (``["cpu_decode_numba.launch", ...]``; empty:
    a run loads them instead of compiling). Cheap: a few ``stat`` calls, numba is not imported."""
    here = Path(__file__).parent
    return [f"{Path(f).stem}.{e}" for f, e in ENTRIES if _fresh_index(here / f, e) is None]


def warm_up() -> float:
    """Compile (or load from numba's cache) the CPU decode and chunk kernels now; returns the seconds it took.

    Runs one decode and one chunk call on a tiny random cache of a format with a sink (so the sink's
    kernel compiles too).

    Raises:
        UnsupportedError: the CPU backend cannot run here (numba missing), with the reasons.
    """
    import torch

    from kvpack.formats import preset
    from kvpack.kernels import chunk_attention, decode_attention
    from kvpack.testing import random_paged_kv

    t0 = time.perf_counter()
    fmt = preset("int4").with_block_size(16)
    kv, _, _ = random_paged_kv(fmt, [2 * 16 + 5], kv_heads=1, head_dim=64, seed=0, sink=1)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    wide, _, _ = random_paged_kv(fmt, [48 * 16, 48 * 16], kv_heads=1, head_dim=64, seed=1, sink=1)
    try:
        torch.set_num_threads(1)  # one thread: launch_one
        decode_attention(torch.randn(1, 2, 64, generator=gen), kv, backend="cpu")
        chunk_attention(torch.randn(1, 3, 2, 64, generator=gen), kv, backend="cpu")
        torch.set_num_threads(max(2, threads))  # enough blocks for two threads: launch
        decode_attention(torch.randn(2, 2, 64, generator=gen), wide, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    return time.perf_counter() - t0


def compile_if_cold(notify: Callable[[str], None]) -> float | None:
    """When numba's disk cache lacks the CPU kernels: say so through ``notify`` (one line), compile them now
    (:func:`warm_up`), then say how long it took. Returns those seconds; None when nothing was compiled (the
    cache holds them, numba is missing, or the CPU backend cannot run here: the run then says why itself).
    """
    if importlib.util.find_spec("numba") is None:
        return None
    cold = cold_entries()
    if not cold:
        return None
    from kvpack.errors import UnsupportedError

    notify(
        "kvpack: compiling the CPU attention kernels (numba; once per machine, a minute or more; later runs "
        "load them from numba's disk cache)"
    )
    try:
        seconds = warm_up()
    except UnsupportedError as e:
        notify(f"kvpack: the CPU kernels cannot be compiled here ({e})")
        return None
    notify(f"kvpack: CPU kernels compiled in {seconds:.0f} s")
    return seconds
