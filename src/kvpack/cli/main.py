"""Entry point of the ``kvpack`` command.

Each subcommand lives in its own module ``kvpack.cli.<name>`` exposing ``add_parser(subparsers)`` (light:
no heavy imports at module level) and ``run(args) -> int``. Errors derived from
:class:`kvpack.errors.KVPackError` print one clear line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpack.errors import KVPackError

SUBCOMMANDS = ["size", "eval", "bench", "generate", "calibrate", "export"]


def _available() -> dict[str, object]:
    mods = {}
    for name in SUBCOMMANDS:
        try:
            mods[name] = importlib.import_module(f"kvpack.cli.{name}_cmd")
        except ModuleNotFoundError as e:
            if e.name != f"kvpack.cli.{name}_cmd":
                raise
    return mods


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    from kvpack import __version__

    parser = argparse.ArgumentParser(
        prog="kvpack",
        description="Quantized, paged KV cache: capacity planning, evaluation and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"kvpack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mods = _available()
    for mod in mods.values():
        mod.add_parser(sub)
    return parser, mods


def main(argv: list[str] | None = None) -> int:
    parser, mods = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(mods[args.command].run(args) or 0)
    except KVPackError as e:
        print(f"kvpack {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
