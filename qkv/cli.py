"""The ``qkv`` command line: parses arguments into configs and calls library functions.

Errors a user can fix are printed as one line and exit with status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, args: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``fn(namespace) -> exit code`` as a subcommand; ``args`` declares its options."""

    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, args, fn)
        return fn

    return register


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


@command("doctor", "self-checks of the attention mechanism and the model on this install", _doctor_args)
def doctor(args: argparse.Namespace) -> int:
    from qkv.checks import run_checks

    results = run_checks()
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.detail}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed}/{len(results)} checks passed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command][2](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (for example `| head -1`): stop quietly, as Unix tools do.
        sys.stderr.close()
        return 0
    except (ValueError, OSError, RuntimeError) as error:
        if args.debug:
            raise
        print(f"qkv {args.command}: error: {error}", file=sys.stderr)
        return 2
