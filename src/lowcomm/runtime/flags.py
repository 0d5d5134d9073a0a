"""Which ``lowcomm train`` settings the user typed, as opposed to left at their defaults.

Why: a method may need other optimizer settings than the trainer's defaults (Signum: no SGD
momentum). It may change a default, but never a value the user chose; argparse alone cannot
tell ``--momentum 0.9`` from the default 0.9, so the command line is parsed a second time
with every default suppressed: what is left was given explicitly. Torch-free (the CLI's
usage errors stay fast).
"""

from __future__ import annotations

import argparse
import ast
from typing import Any, Sequence


def key_value(text: str) -> tuple[str, Any]:
    """``--model-arg KEY=VALUE`` (``train``, ``fl``): the value as a Python literal where it
    is one (``hidden=256`` -> 256), else the text."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    if not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value with a name as key, got {text!r}")
    key = key.strip()
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def explicit_train_flags(argv: Sequence[str] | None) -> list[str]:
    """Destinations (``lr``, ``momentum``, ...) of the ``lowcomm train`` options in ``argv``.

    ``argv`` is the command line after the program name (the subcommand word may lead, and
    is ignored); abbreviations (``--mom``) and ``--opt=value`` count like argparse counts
    them. Returns ``[]`` when ``argv`` is None (nothing typed: a Python caller). If the
    second parse fails (it should not: the real parser accepted the same ``argv``), every
    option counts as typed, so that no method changes a value the user may have chosen.
    """
    if not argv:
        return []
    from lowcomm.runtime.train_cli import add_train_arguments

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_train_arguments(parser)
    dests = {a.dest for a in parser._actions}  # noqa: SLF001 - argparse has no public API for this
    for action in parser._actions:  # noqa: SLF001
        action.default = argparse.SUPPRESS
    try:
        ns, _ = parser.parse_known_args(list(argv))
    except (argparse.ArgumentError, SystemExit, ValueError, TypeError):
        return sorted(dests)
    return sorted(vars(ns))
