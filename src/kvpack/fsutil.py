"""Files and folders written so that a crash never leaves a half-written result or destroys a good one.

Every writer here builds its output under a temporary name beside the destination (same file system, so the
final step is a ``rename``) and only then puts it in place: a reader sees the old content or the new, never
a mix. :func:`check_output_dir` refuses an unusable destination before any long work starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from kvpack.errors import ConfigError

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_output_dir", "replace_dir"]

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and ``os.replace``."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode())


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


@contextlib.contextmanager
def _temp_dir_beside(final: Path) -> Iterator[Path]:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(final: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Build a folder with ``fill(tmp)`` in a temporary folder beside ``final``, then put it in place.

    A new ``final`` appears with one ``rename``; an existing one is swapped with the new folder in one step
    where the system allows it (Linux), else renamed aside first (a crash in between leaves the old folder
    beside it, as ``.NAME.*.old``). Files in an existing ``final`` that ``fill`` did not write are dropped.
    If ``fill`` raises, ``final`` is untouched.

    Raises:
        ConfigError: ``final`` exists and is not a folder.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise ConfigError(f"{final} is a file, not a folder; pass a folder path (it is created if missing)")
    with _temp_dir_beside(final) as tmp:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
        if not final.exists():
            os.rename(tmp, final)
        elif _exchange(tmp, final):  # tmp now holds the old folder and is removed on exit
            pass
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.rename(final, old / "prev")
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    return final


def check_output_dir(path: str | os.PathLike | None, flag: str = "--out") -> Path:
    """Refuse, before any work, an output folder that cannot be written: an empty path, an existing file, a
    path under a file, or a folder where nothing can be created (read-only, ``/proc``). Creates nothing.

    Raises:
        ConfigError: naming ``flag`` and what to pass instead.
    """
    if path is None or not str(path).strip():
        raise ConfigError(f"{flag} is empty; pass the folder to write, e.g. {flag} out/")
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: is a file, not a folder; pass a folder path (created if missing)")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag} {path}: {probe} is a file, so no folder can be created under it")
    try:  # the only reliable test (permissions, read-only mounts, pseudo file systems): try it
        os.rmdir(tempfile.mkdtemp(prefix=".kvpack-probe.", dir=probe))
    except OSError as e:
        raise ConfigError(
            f"{flag} {path}: cannot create anything in {probe} ({e.strerror or e}); pass a writable folder"
        ) from None
    return p
