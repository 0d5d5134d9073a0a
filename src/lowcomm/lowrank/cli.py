"""``lowcomm lowrank summary --model M``: what Pufferfish factorization does to a model.

The model is built on PyTorch's ``meta`` device (shapes only, no memory, no SVD), so even
Wide-ResNet-50-2 or the 86M-parameter LSTM report in about a second.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch

from lowcomm.errors import UsageError, check_fraction


def register(subparsers: Any) -> None:
    """Add ``lowcomm lowrank`` to the CLI."""
    p = subparsers.add_parser("lowrank", help="Pufferfish low-rank factorization tools")
    sub = p.add_subparsers(dest="lowrank_command", metavar="SUBCOMMAND")
    s = sub.add_parser("summary", help="parameters, multiply-adds and gradient bytes before/after")
    s.add_argument("--model", required=True, help="registered model name (see lowcomm.models)")
    s.add_argument("--rank-ratio", type=float, default=0.25, help="rank as a fraction of min(out, in)")
    s.add_argument("--full-rank", default=None,
                   help="regex of modules kept dense (default: the model's hybrid preset; 'none': no module)")
    s.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="model keyword argument (int/float/str), repeatable")
    s.add_argument("--layers", action="store_true", help="also list every factorized layer and its rank")
    s.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    s.set_defaults(func=run)
    p.set_defaults(func=_missing_subcommand)


def _missing_subcommand(args: argparse.Namespace) -> int:
    """``lowcomm lowrank`` alone is misuse like any other: one line, exit 2."""
    raise UsageError("lowcomm lowrank needs a subcommand; valid: summary (see lowcomm lowrank --help)")


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def build_summary(model_name: str, rank_ratio: float, full_rank: str | None, model_args: dict[str, Any]) -> dict[str, Any]:
    """The ``lowcomm lowrank summary`` numbers for a registered model (before and after factorizing)."""
    from lowcomm import models
    from lowcomm.lowrank.factorize import factorize
    from lowcomm.lowrank.summary import example_input, summary

    check_fraction("--rank-ratio", rank_ratio)
    if model_args:
        from lowcomm.runtime.train_cli import check_model_args

        check_model_args(model_name, model_args)  # a rejected value is one line, not a traceback
    with torch.device("meta"):
        dense = models.create(model_name, **model_args)
        fact = models.create(model_name, **model_args)
    spec: Any = None if full_rank is None else ([] if full_rank.lower() == "none" else full_rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fact = factorize(fact, rank_ratio, spec, inplace=True)  # our own meta copy
    example = example_input(dense)
    result = summary(dense, fact, example=example)
    result.update(model=model_name, rank_ratio=rank_ratio, full_rank=full_rank or "preset",
                  example_input_shape=list(example.shape) if example is not None else None)
    return result


def _fmt(n: Any) -> str:
    return "-" if n is None else f"{n:,}"


def run(args: argparse.Namespace) -> int:
    """``lowcomm lowrank ...``: print the summary (or JSON)."""
    model_args = {}
    for item in args.model_arg:
        if "=" not in item:
            raise UsageError(f"--model-arg {item!r} must look like key=value")
        k, v = item.split("=", 1)
        if not k.strip():
            raise UsageError(f"--model-arg {item!r} must look like key=value (the key is empty)")
        model_args[k.strip()] = _parse_value(v.strip())
    result = build_summary(args.model, args.rank_ratio, args.full_rank, model_args)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Pufferfish low-rank: {args.model} (rank ratio {args.rank_ratio})")
    for col in ("", "before", "after", "reduction"):
        table.add_column(col, justify="right" if col else "left")
    for key, label in (("params", "parameters"), ("macs", "multiply-adds / sample"),
                       ("grad_bytes_per_step", "gradient bytes / step")):
        e = result[key]
        red = e.get("reduction")
        table.add_row(label, _fmt(e["before"]), _fmt(e["after"]), f"{red:.2f}x" if red else "-")
    console = Console()
    console.print(table)
    console.print(f"{result['layers_factorized']} layers factorized")
    if args.layers:
        for name, spec in result["ranks"].items():
            console.print(f"  {name}: {spec}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
