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
from typing import NoReturn, Sequence

from lowcomm import __version__
from lowcomm.errors import UsageError

# Modules that add subcommands, in help order.
COMMAND_MODULES = [
    "lowcomm.runtime.train_cli",  # train, demo
    "lowcomm.bench.cli",  # bench
    "lowcomm.sim.cli",  # profile, simulate, advise
    "lowcomm.lowrank.cli",  # lowrank summary
    "lowcomm.fl.cli",  # fl
    "lowcomm.split.cli",  # split
    "lowcomm.elastic.cli",  # elastic train|search|extract
]
#: which module registers each command: ``lowcomm CMD ...`` imports only that one, so a
#: launcher that only starts workers (``fl``) does not load torch (~220 MB) for nothing.
COMMAND_OWNERS = {
    "train": "lowcomm.runtime.train_cli", "demo": "lowcomm.runtime.train_cli",
    "bench": "lowcomm.bench.cli", "profile": "lowcomm.sim.cli", "simulate": "lowcomm.sim.cli",
    "advise": "lowcomm.sim.cli", "lowrank": "lowcomm.lowrank.cli", "fl": "lowcomm.fl.cli",
    "split": "lowcomm.split.cli", "elastic": "lowcomm.elastic.cli",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lowcomm`` parser; each tool module registers its subcommand (a missing optional tool is skipped).

    ``command``: build only what that command needs (its owner in :data:`COMMAND_OWNERS`);
    unknown or None: every command (help, and argparse's "invalid choice" message).
    """
    parser = _Parser(
        prog="lowcomm",
        description="Communication-efficient distributed training on PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    owner = COMMAND_OWNERS.get(command or "")
    for name in COMMAND_MODULES:
        if owner is not None and name != owner:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that tool is not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``lowcomm ...``: bad input is one ``lowcomm: error:`` line and exit code 2, never a traceback."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser(argv[0] if argv else None)
        args = parser.parse_args(argv)
        args._argv = argv
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UsageError as e:
        # Workers we launched usually all hit the same bad input: each hands its message to
        # the launcher, which prints one line (see lowcomm.runtime.launch).
        from lowcomm.runtime.launch import report_usage_error

        if not report_usage_error(str(e)):
            print(f"lowcomm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowcomm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # A worker we launched whose peer died sees its next collective fail: the launcher
        # names the rank that died first, so this one says why it stopped in one line instead
        # of a gloo/NCCL traceback. Anywhere else (torchrun, in-process) the traceback stays.
        if _lost_peer(e) and os.environ.get("LOWCOMM_LAUNCHED") == "1":
            from lowcomm.runtime.launch import peer_reported_usage_error

            if peer_reported_usage_error():
                return 1  # the peer stopped on bad input: the launcher prints that reason alone
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"lowcomm: worker rank {os.environ.get('RANK', '?')} stopped: lost contact "
                  f"with a peer ({first[:200]})", file=sys.stderr)
            return 1
        raise


def _lost_peer(e: BaseException) -> bool:
    """True for the errors torch.distributed raises when a peer process has gone away."""
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


if __name__ == "__main__":
    raise SystemExit(main())
