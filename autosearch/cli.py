"""The `autosearch` command line. Each subcommand lives in `autosearch/commands/<name>.py` and
exposes `register(subparsers)`; this file only wires them and turns user errors into one clear
message with exit status 2 (never a traceback)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

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


def main(argv: list[str] | None = None) -> int:
    command = "autosearch"
    interrupts = _count_interrupts()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = f"autosearch {args.command}"
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return _interrupted(command)
    except SpecError as exc:
        if interrupts.count:
            return _interrupted(command)
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `autosearch ... | head`
        return 0
    except OSError as exc:
        # The file system refused a path the user gave (read-only, full, a folder in the way):
        # one message naming the path; the commands check their outputs before any work, so
        # this is the net for what changes while they run.
        if interrupts.count:  # a library turned the Ctrl-C into another error on its way out
            return _interrupted(command)
        if exc.filename is None:
            raise
        print(f"{command}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception:
        if interrupts.count:
            return _interrupted(command)
        raise
    finally:
        interrupts.restore()


def _interrupted(command: str) -> int:
    # A new line first: a progress bar may be on the current one.
    print(f"\n{command}: interrupted", file=sys.stderr)
    return 130


class _count_interrupts:
    """Counts Ctrl-C (SIGINT) while a command runs and raises KeyboardInterrupt as Python does,
    so that an error a library raises while it unwinds from the interrupt is reported as the
    interrupt. Only in the main thread, and only where SIGINT has Python's default handler."""

    def __init__(self) -> None:
        self.count = 0
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.count += 1
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


if __name__ == "__main__":
    sys.exit(main())
