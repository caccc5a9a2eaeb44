"""The `autosearch` command line. Each subcommand lives in `autosearch/commands/<name>.py` and
exposes `register(subparsers)`; this file only wires them and turns user errors into one clear
message with exit status 2 (never a traceback)."""

from __future__ import annotations

import argparse
import importlib
import sys

from autosearch import __version__
from autosearch.core.errors import SpecError

# Subcommand modules, in the order `autosearch --help` lists them.
COMMANDS = ["estimate", "models", "hardware"]
OPTIONAL_COMMANDS = ["tune", "sweep", "export", "calibrate", "validate"]  # added by later modules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autosearch",
        description="Find the fastest parallel strategy to train a model on a cluster.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"autosearch {__version__}",
        help="print the version",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS + OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(f"autosearch.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"autosearch.commands.{name}" and name in OPTIONAL_COMMANDS:
                continue
            raise
        module.register(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None) is not None:
            # A config file gives the subcommand's defaults; the flags given override them.
            sub = _subparser(parser, args.command)
            sub.set_defaults(**args.read_config(args.config, sub))
            args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except SpecError as exc:
        print(f"autosearch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # A new line first: a progress bar may be on the current one.
        print(f"\nautosearch {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autosearch ... | head`
        return 0
    except OSError as exc:
        # The file system refused a path the user gave (read-only, full, a folder in the way):
        # one message naming the path; the commands check their outputs before any work, so
        # this is the net for what changes while they run.
        if exc.filename is None:
            raise
        print(
            f"autosearch {args.command}: error: {exc.filename}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
