"""Entry point of the ``kvpack`` command.

Each subcommand lives in its own module ``kvpack.cli.<name>`` exposing ``add_parser(subparsers)`` (light:
no heavy imports at module level) and ``run(args) -> int``. A bad argument (refused while parsing, by the
types of :mod:`kvpack.cli.args`) and errors derived from :class:`kvpack.errors.KVPackError` print one
clear line and exit with status 2. Anything else is a bug in kvpack: one line saying so, status 1, and the
traceback only with ``KVPACK_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
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


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: ``kvpack size: error: argument --context: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    from kvpack import __version__

    parser = _Parser(
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a refused argument (status 2), --help or --version (0): a status, not an exit
        return e.code if isinstance(e.code, int) else 2
    if not args.command:
        parser.print_help()
        return 2
    try:
        status = int(mods[args.command].run(args) or 0)
        sys.stdout.flush()  # a reader that left (`kvpack size ... | head`) shows here, inside this try
        return status
    except BrokenPipeError:  # stop quietly, as other Unix tools do; stdout to /dev/null so exit's flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe stopped
    except KVPackError as e:
        print(f"kvpack {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: say so in one line; the traceback is for KVPACK_DEBUG=1
        if os.environ.get("KVPACK_DEBUG"):
            raise
        print(
            f"kvpack {args.command}: internal error ({type(e).__name__}: {e}); this is a bug in kvpack: rerun with "
            "KVPACK_DEBUG=1 for the traceback and report it",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
