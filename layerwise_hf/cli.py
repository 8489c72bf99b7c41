"""`layerwise-hf` command line: subcommands are added by the modules that own them.

A subcommand is a module with `register(subparsers)`, which adds its parser and sets `func` (called with the parsed
arguments; its return value is the exit status). Adding one: import the module and list it in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys

from .estimate import cli as estimate_cli
from .integrations import assets, checkpoint
from .plan import cli as plan_cli

SUBCOMMANDS = (estimate_cli, plan_cli, checkpoint, assets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerwise-hf", description="Layer-wise optimizers for Hugging Face Trainer."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
