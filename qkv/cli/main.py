"""The ``qkv`` command line: parses arguments into configs and calls library functions.

Errors a user can fix (``qkv.errors.QkvError``, and OS errors such as a missing file) are printed as
one line and exit with status 2; ``--debug`` shows the traceback. Anything else (a PyTorch failure,
a bug) is reported as what it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# Each module registers its commands; `qkv --help` lists them in ORDER.
from qkv.cli import decode as cli_decode
from qkv.cli import distill as cli_distill
from qkv.cli import document as cli_document  # noqa: F401
from qkv.cli import glossary as cli_glossary  # noqa: F401
from qkv.cli import inspect as cli_inspect
from qkv.cli import interop as cli_interop
from qkv.cli import serve as cli_serve
from qkv.cli import train as cli_train  # noqa: F401
from qkv.cli import trust as cli_trust  # noqa: F401
from qkv.cli.common import COMMANDS
from qkv.errors import QkvError

# What `qkv --help` opens with: for a user, not this module's docstring (which is for a developer).
DESCRIPTION = "train, translate with, inspect and serve Transformer translation models"
EPILOG = "qkv COMMAND --help lists a command's options; docs/cli.md is the whole reference."

ORDER = ("doctor", "split", "prepare", "train", "distill", "translate", "markup", "evaluate", "calibrate", "pseudo-terms", "shortlist", "average", "serve", "export", "import",
         "explain", "score", "align", "attend", "demo")  # fmt: skip


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors (a missing option, a bad value, an unknown one) are one line
    naming the command, as qkv's own errors, with status 2 (``--help`` shows the usage)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qkv", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in sorted(COMMANDS, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        help_text, add_args, _ = COMMANDS[name]
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would name qkv's usage: name the command's, whose options these are not
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        (commands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not args.debug:  # warnings as one plain line, without the source line that raised them
        warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "beam", 0) is None:  # decoding commands: beam 5, or 1 when sampling
        args.beam = 1 if getattr(args, "sampling", False) else 5
    try:
        return COMMANDS[args.command][2](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (for example `| head -1`): stop quietly, as Unix tools do. Point stdout
        # at /dev/null so that Python's own flush at exit does not fail on the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (QkvError, OSError) as error:  # what the user can fix; a PyTorch failure or a bug shows as itself
        if args.debug:
            raise
        print(f"qkv {args.command}: error: {error}", file=sys.stderr)
        return 2

