"""Write docs/cli.md, the reference of every ``qkv`` command and option, from the real argparse parser.

    .venv/bin/python scripts/cli_reference.py > docs/cli.md   # print it
    .venv/bin/python scripts/cli_reference.py --write         # write docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check         # exit 1 if docs/cli.md is out of date

The layout is this script's own, not argparse's help formatter (which wraps to the terminal's width), so
the output is the same on every machine. A default that depends on the machine (the parser is built
twice, as if on machines with different CPU counts, and the two defaults differ) is not printed: its
help says what it is. tests/unit/test_docs.py checks that docs/cli.md is what this script writes.

It reads argparse's private attributes (``parser._subparsers``, ``_actions``, ``_mutually_exclusive_groups``):
argparse has no public way to walk a parser, and a script that regenerates a doc can afford to follow
argparse if they ever change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere, installed or not
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "cli.md"
COMMAND = ".venv/bin/python scripts/cli_reference.py --write"
MACHINE_DEPENDENT = "depends on the machine (see description)"


def build_parser_on(cpus: int) -> argparse.ArgumentParser:
    """``qkv.cli.main.build_parser()`` as it would be on a machine with ``cpus`` CPUs."""
    from qkv.cli.main import build_parser

    with mock.patch("os.cpu_count", return_value=cpus), \
         mock.patch("os.sched_getaffinity", return_value=set(range(cpus)), create=True):  # fmt: skip
        return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subparsers, in the order ``qkv --help`` lists them (private attribute: see the module's doc)."""
    return dict(parser._subparsers._group_actions[0].choices)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of a parser, positionals first, without -h/--help (every command has it)."""
    actions = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    return [a for a in actions if not a.option_strings] + [a for a in actions if a.option_strings]


def is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0  # store_true, store_false, store_const, count...


def metavar(action: argparse.Action) -> str:
    """What follows the option on a command line: its metavar, {a,b} for choices, else its name in capitals."""
    if action.metavar is not None:
        name = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        name = action.dest.upper()
    return {"*": f"[{name} ...]", "+": f"{name} [{name} ...]", "?": f"[{name}]"}.get(action.nargs, name)


def value_name(action: argparse.Action) -> str:
    """The table's value column: the choices one by one, or the metavar; with the type when it is a number."""
    if is_flag(action):
        return ""
    if action.choices is not None and action.metavar is None:
        name = ", ".join(f"`{c}`" for c in action.choices)
    else:
        name = f"`{metavar(action)}`"
    if action.type in (int, float):
        name += f" ({action.type.__name__})"
    return name


def default_text(action: argparse.Action, other: argparse.Action | None) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._AppendAction):
        return "" if action.default is None else f"`{action.default}`"
    if other is not None and other.default != action.default:
        return MACHINE_DEPENDENT
    if is_flag(action):
        return "off" if action.default in (False, None) else f"`{action.default}`"
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""  # none, or computed when the command runs: the help says which
    return f"`{action.default}`"


def help_text(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(prog)s, %%
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = parser.prog
        text = text % params
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            others = [o.option_strings[-1] for o in group._group_actions if o is not action]
            text += "; not with " + ", ".join(f"`{o}`" for o in others)
    return cell(text)


def cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    """``qkv NAME`` with the positionals and required options; ``[options]`` for the rest."""
    parts = ["qkv", name]
    for action in options(parser):
        if not action.option_strings:
            parts.append(metavar(action))
        elif action.required:
            parts.append(f"{action.option_strings[0]} {metavar(action)}")
    if any(a.option_strings and not a.required for a in options(parser)):
        parts.append("[options]")
    return " ".join(parts)


def render() -> str:
    parser, other_machine = build_parser_on(2), build_parser_on(97)
    commands, others = subcommands(parser), subcommands(other_machine)
    lines = [
        "# Command reference",
        "",
        f"<!-- Generated by scripts/cli_reference.py from qkv's parser: do not edit. Regenerate: {COMMAND} -->",
        "",
        f"Generated from the parser itself (`qkv.cli.main.build_parser()`) by `{COMMAND}`; "
        "`tests/unit/test_docs.py` fails when it is out of date. `qkv COMMAND --help` prints the same options.",
        "",
        "Usage: `qkv [--debug] COMMAND [options]`. `--debug` shows the full traceback of an error instead of "
        "one line; an error you can fix exits with status 2. Options of every command: `-h`, `--help`.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name, sub in commands.items():
        lines.append(f"| [`qkv {name}`](#qkv-{name}) | {cell(sub.description or '')} |")
    for name, sub in commands.items():
        other = {a.dest: a for a in options(others[name])}
        description = (sub.description or "").rstrip(".")
        lines += ["", f"## qkv {name}", "", description[:1].upper() + description[1:] + ".", "",
                  "```", synopsis(name, sub), "```", ""]
        rows = [(a, other.get(a.dest)) for a in options(sub)]
        if not rows:
            lines.append("No options.")
            continue
        lines += ["| option | value | default | description |", "|---|---|---|---|"]
        for action, twin in rows:
            flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            lines.append(f"| {flags} | {value_name(action)} | {default_text(action, twin)} | {help_text(action, sub)} |")
    return "\n".join(lines) + "\n"


def write_or_check(out: Path, text: str, command: str, argv: list[str] | None, description: str) -> int:
    """The command line of a script that generates one page: print it, ``--write`` it to ``out``, or
    ``--check`` that ``out`` holds it (exit 1, naming ``command``, when it does not). The API and config
    references (scripts/api_reference.py, scripts/config_reference.py) use it too."""
    cli = argparse.ArgumentParser(description=description)
    mode = cli.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {out.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {out.name} differs from what it would write")
    args = cli.parse_args(argv)
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            shown = out.relative_to(ROOT) if ROOT in out.parents else out
            print(f"{shown} is out of date: run {command}", file=sys.stderr)
            return 1
        return 0
    if args.write:
        out.write_text(text, encoding="utf-8")
        return 0
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, render(), COMMAND, argv, "Write docs/cli.md from qkv's parser (default: print it).")


if __name__ == "__main__":
    raise SystemExit(main())
