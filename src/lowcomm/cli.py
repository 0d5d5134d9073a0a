"""``lowcomm`` command line: one entry point, one subcommand module per tool.

Each subcommand module exposes ``register(subparsers)``; its parsers set ``func=run`` with
``run(args) -> int``. Misuse (a :class:`~lowcomm.errors.UsageError` or an argparse error)
prints one line and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from lowcomm import __version__
from lowcomm.errors import UsageError

# Modules that add subcommands, in help order.
COMMAND_MODULES = [
    "lowcomm.runtime.train_cli",  # train, demo
    "lowcomm.bench.cli",  # bench
    "lowcomm.sim.cli",  # profile, simulate, advise
    "lowcomm.lowrank.cli",  # lowrank summary
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lowcomm",
        description="Communication-efficient distributed training on PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that tool is not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        args._argv = argv
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UsageError as e:
        # Workers we launched all hit the same bad input: rank 0 alone says it.
        if not (os.environ.get("LOWCOMM_LAUNCHED") == "1" and os.environ.get("RANK", "0") != "0"):
            print(f"lowcomm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowcomm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
