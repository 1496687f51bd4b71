"""Argument types of the ``kvpack`` command: each checks its value when the command line is parsed, so a bad
value is refused before any model loads, in one line that names the argument (argparse adds
``argument --flag:``). Light: nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from kvpack.errors import KVPackError

__all__ = ["count", "counts", "fmt", "int_in", "out_dir", "out_file", "real_in"]


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (``hi=None``: no upper bound)."""

    def parse(text: str) -> int:
        try:
            n = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be an integer {where}, got {text!r}")
        return n

    return parse


def real_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and inf are refused."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
            raise argparse.ArgumentTypeError(
                f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text!r}"
            )
        return x

    return parse


def count(text: str) -> int:
    """A token count such as ``8192``, ``8k`` or ``1m`` (:func:`kvpack.sizing.parse_count`)."""
    from kvpack.sizing import parse_count

    try:
        return parse_count(text, "the count")
    except KVPackError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def counts(text: str) -> list[int]:
    """A comma list of token counts: ``1k,4k,16384``."""
    out = [count(p) for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected token counts like 1024,2k,4k, got {text!r}")
    return out


def fmt(text: str) -> str:
    """A kvpack format string, checked (:func:`kvpack.formats.parse_format`) and returned as given."""
    from kvpack.formats import parse_format

    try:
        parse_format(text)
    except KVPackError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def out_dir(text: str) -> str:
    """A folder that can be created or written (:func:`kvpack.fsutil.check_output_dir`)."""
    from kvpack.fsutil import check_output_dir

    try:
        check_output_dir(text, "folder")
    except KVPackError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def out_file(text: str) -> str:
    """A file path whose folder exists and can be written, and which is not itself a folder."""
    from pathlib import Path

    from kvpack.fsutil import check_output_dir

    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; pass a file to write")
    p = Path(text).expanduser()
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file path")
    try:
        check_output_dir(str(p.parent), "the folder")
    except KVPackError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {p.parent} does not exist; create it first")
    return text
