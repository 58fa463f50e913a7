"""The documentation agrees with the code: README.md and docs/*.md are read as Markdown and checked.

- docs/cli.md is what scripts/cli_reference.py writes from the parser;
- every ``qkv`` command line (fenced shell blocks, and inline code that runs a known subcommand) parses
  with the real parser: no unknown subcommand, flag or choice;
- every relative link and image points at a file of the repository, and every ``#anchor`` at a heading;
- a fenced ``python`` block that claims values (a whole-line comment ``# name = value, name = value``)
  runs, and its variables have those values; the other Python blocks compile.

README.md and docs/ are separate tests, so that each one's failure shows on its own. Fast: no training,
no subprocess, no model.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import math
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

from qkv.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CLI_MD = ROOT / "docs" / "cli.md"
REGENERATE = ".venv/bin/python scripts/cli_reference.py --write"

# Commands in the docs whose arguments are elided with "..." cannot be parsed; they are skipped, and counted.
MAX_ELIDED = 5


def cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


# --- Markdown -------------------------------------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    lang: str
    first_line: int  # line number of the block's first line of content
    lines: list[str]


def split_markdown(text: str) -> tuple[list[Block], str]:
    """The fenced code blocks, and the text outside them with the blocks' lines blanked (line numbers kept)."""
    blocks, outside, block, indent = [], [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if block is None and fence:
            indent, marker = fence.group(1), fence.group(2)
            block = Block(fence.group(3).lower(), number + 1, [])
            outside.append("")
        elif block is not None:
            if line.strip().startswith(marker) and line.strip().strip(marker[0]) == "":
                blocks.append(block)
                block = None
            else:  # content of a block indented in a list item loses the fence's indentation
                block.lines.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            outside.append("")
        else:
            outside.append(line)
    return blocks, "\n".join(outside)


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def paragraphs(outside: str):
    """(line number of its first line, text) of each paragraph: code spans never cross a blank line."""
    start, lines = 1, []
    for number, line in enumerate(outside.split("\n") + [""], 1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            yield start, "\n".join(lines)
            lines = []


def code_spans(outside: str):
    """(line number, content) of each inline code span, its line breaks as spaces."""
    for start, paragraph in paragraphs(outside):
        for match in INLINE_CODE.finditer(paragraph):
            yield start + paragraph.count("\n", 0, match.start()), " ".join(match.group(2).split())


def without_code_spans(outside: str) -> str:
    return INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), outside)


# --- Commands -------------------------------------------------------------------------------------------

SHELL = {"", "bash", "sh", "shell", "console", "zsh"}
CONTROL = {"|", "||", "&&", ";", "&", "|&"}
REDIRECT = {">", ">>", "<", ">&", "&>", ">|", "<<<", "&>>"}
WRAPPERS = {"nohup", "time", "exec", "env", "command"}
SUBCOMMANDS = tuple(build_parser()._subparsers._group_actions[0].choices)  # private: argparse has no public list


@dataclass
class Command:
    path: Path
    line: int
    text: str
    args: list[str] | None  # None: elided with "...", not parsed
    inline: bool = False  # in inline code (prose naming a command), not a shell block
    unparsable: str = ""  # shlex's error (unbalanced quotes)

    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}: {self.text}"


def shell_lines(block: Block):
    """(line number, logical line) of a shell block: continuations joined; when some lines start with a
    ``$`` prompt, only those (the others are output)."""
    prompted = any(line.lstrip().startswith("$ ") for line in block.lines)
    i = 0
    while i < len(block.lines):
        number, line = block.first_line + i, block.lines[i].strip()
        if prompted and not line.startswith("$ "):
            i += 1
            continue
        line = line.removeprefix("$ ")
        while line.endswith("\\") and i + 1 < len(block.lines):
            i += 1
            line = line[:-1] + " " + block.lines[i].strip()
        yield number, line
        i += 1


def qkv_invocations(line: str) -> list[list[str]]:
    """The argument lists of each ``qkv`` the shell line runs: ``qkv ...``, ``nohup qkv ...``,
    ``python -m qkv ...``, ``torchrun ... -m qkv ...``, each cut at pipes, ``&&``, ``;`` and without its
    redirections. Raises ValueError on unbalanced quotes."""
    line = re.sub(r"(?<![\w-])\d+(?=>)", "", line)  # the descriptor of 2>/dev/null
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True  # `#` starts a comment only at the start of a word
    segments, tokens, skip = [[]], list(lexer), False
    for token in tokens:
        if skip:
            skip = False
        elif token in CONTROL:
            segments.append([])
        elif token in REDIRECT:
            skip = True  # and its file
        else:
            segments[-1].append(token)
    invocations = []
    for words in segments:
        while words and (re.match(r"[A-Za-z_]\w*=", words[0]) or words[0] in WRAPPERS):
            words = words[1:]  # OMP_NUM_THREADS=1, nohup
        if words and Path(words[0]).name == "qkv":
            invocations.append(words[1:])
        elif words and re.fullmatch(r"python[\d.]*|torchrun", Path(words[0]).name):
            for i in range(len(words) - 1):
                if words[i] == "-m" and words[i + 1] == "qkv":
                    invocations.append(words[i + 2:])
                    break
    return invocations


MENTIONS_QKV = re.compile(r"(^|[\s|;&/])qkv(\s|$)")
# Inline code that runs qkv: it starts with qkv (or has it after a pipe, && or ;), then a known subcommand or
# an option; or it runs `-m qkv`. Not `qkv COMMAND: error: ...`, nor a message that mentions a command.
RUNS_A_COMMAND = re.compile(rf"(^|[|;&]\s*)(nohup\s+)?(\S*/)?qkv\s+({'|'.join(SUBCOMMANDS)}|--?[a-z])(\s|$)|-m qkv\s")


def commands(path: Path) -> list[Command]:
    """The qkv commands of a Markdown file: in shell blocks (bash, sh, console or no language), and in
    inline code that runs a known subcommand (``qkv translate -i FILE``; not ``qkv COMMAND: error``)."""
    text = path.read_text(encoding="utf-8")
    blocks, outside = split_markdown(text)
    found = []

    def add(number: int, line: str, inline: bool) -> None:
        try:
            invocations = qkv_invocations(line)
        except ValueError as error:  # unbalanced quotes
            found.append(Command(path, number, line, [], inline, unparsable=str(error)))
            return
        for args in invocations:
            if inline and not args:
                continue
            elided = any("..." in arg for arg in args)
            found.append(Command(path, number, line, None if elided else args, inline))

    for block in blocks:
        if block.lang in SHELL:
            for number, line in shell_lines(block):
                if MENTIONS_QKV.search(line):  # not `curl ...`, nor output that shlex could not split
                    add(number, line, inline=False)
    for number, span in code_spans(outside):
        span = span.replace("\\|", "|")  # a pipe inside a table cell
        if RUNS_A_COMMAND.search(span):
            add(number, span, inline=True)
    return sorted(found, key=lambda command: command.line)


def lenient_parser():
    """The real parser with every argument optional: argparse reports missing required arguments before
    unknown ones, so an abbreviated example (``qkv translate -o F``, no --checkpoint) would hide a wrong flag.
    What is left to fail: an unknown subcommand or flag, a bad choice or value, a flag without its value."""
    parser = build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        for action in sub._actions:
            action.required = False
    return parser


def parse_error(parser, args: list[str]) -> str | None:
    """argparse's error for ``qkv ARGS``, or None; parsed as on a 64-CPU machine (--workers N has the
    CPU count as its bound) and with help printed to nowhere."""
    stderr = io.StringIO()
    with redirect_stderr(stderr), redirect_stdout(io.StringIO()), \
         mock.patch("os.sched_getaffinity", return_value=set(range(64)), create=True), \
         mock.patch("os.cpu_count", return_value=64):  # fmt: skip
        try:
            parser.parse_args(args)
        except SystemExit as exit:
            if exit.code not in (0, None):  # 0: --help
                lines = stderr.getvalue().strip().splitlines()
                message = lines[-1] if lines else f"exit {exit.code}"
                if "the following arguments are required" not in message:  # not with lenient_parser
                    return message
    return None


# Not errors: a placeholder as a number (`--beam K`), and, in prose only, an option named without its value
# (`qkv train --tensorboard`). A shell block's command must be complete.
PLACEHOLDER = re.compile(r"invalid \w+ value: '[A-Z][A-Z0-9_]*'$")
NO_VALUE = re.compile(r"expected (one|at least one) argument$")


def command_problems(paths: list[Path]) -> tuple[list[str], list[Command], list[Command]]:
    parser, problems, checked, elided = lenient_parser(), [], [], []
    for path in paths:
        for command in commands(path):
            if command.args is None:
                elided.append(command)
                continue
            checked.append(command)
            error = f"cannot split it as the shell would: {command.unparsable}" if command.unparsable else (
                parse_error(parser, command.args))
            if error and not PLACEHOLDER.search(error) and not (command.inline and NO_VALUE.search(error)):
                problems.append(f"{command.where()}\n    {error}")
    return problems, checked, elided


def test_the_command_checker_rejects_made_up_commands_and_accepts_abbreviated_ones(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "qkv translate --no-such-flag\n"  # 2: unknown flag
        "qkv transmogrify --checkpoint runs/x\n"  # 3: unknown subcommand
        "echo hi | nohup qkv export --format onnx > log.txt  # comment\n"  # 4: bad choice
        "torchrun --nproc_per_node=2 -m qkv train --preset tiny \\\n    --bogus\n"  # 5: after a continuation
        "qkv translate -o out.txt < in.txt 2>/dev/null && qkv average A B --out C\n"  # 7: fine, required missing
        "python -m qkv translate --help\n"  # 8: fine
        "qkv train --out ... --bf16\n"  # 9: elided
        "```\n"
        "Inline: `qkv evaluate --beam many` (11: not a number), `qkv COMMAND: error: ...` (not a command),\n"
        "| `printf x \\| qkv score -i F --nope` |\n"  # 12: in a table
        "`qkv evaluate --beam K --save` and `then run qkv train --resume RUN's last` (13: fine, and not a command)\n"
        "```\nqkv align --checkpoint C -i x.txt --pieces 'unclosed\nqkv translate --force --output\n```\n",  # 15, 16
        encoding="utf-8",
    )
    for text, args in [("qkv translate --no-such-flag", ["translate", "--no-such-flag"])]:
        assert qkv_invocations(text) == [args]
    problems, checked, elided = command_problems([page])
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "5", "11", "12", "15", "16"], problems
    assert "unrecognized arguments: --no-such-flag" in problems[0]
    assert "invalid choice: 'transmogrify'" in problems[1]
    assert len(checked) == 12 and len(elided) == 1


def check_commands(paths: list[Path], minimum: int) -> None:
    problems, checked, elided = command_problems(paths)
    heading = f"{len(problems)} of {len(checked)} qkv command lines do not parse (see `qkv COMMAND --help`):"
    assert not problems, "\n".join([heading, *problems])
    assert len(checked) >= minimum, f"only {len(checked)} qkv command lines found: is the checker seeing them?"
    assert len(elided) <= MAX_ELIDED, "commands elided with '...', not checked:\n" + "\n".join(c.where() for c in elided)


def test_docs_commands_parse():
    check_commands([p for p in DOCS if p != CLI_MD], minimum=50)  # cli.md is the parser's own output


def test_readme_commands_parse():
    check_commands([README], minimum=10)


# An extra a block's commands need, and what its install line names (the default install holds the rest).
EXTRAS = {"marian": lambda args: args[:2] == ["import", "marian"] or (args[:1] == ["export"] and "marian" in args)}


def extra_problems(paths: list[Path]) -> list[str]:
    """Recipe blocks (shell blocks without a ``$`` prompt: what a reader copies and runs) that run a command
    needing an extra without a ``pip install`` line naming it in the same block."""
    problems = []
    for path in paths:
        for block in split_markdown(path.read_text(encoding="utf-8"))[0]:
            if block.lang not in SHELL or any(line.lstrip().startswith("$ ") for line in block.lines):
                continue
            lines = list(shell_lines(block))
            installs = " ".join(line for _, line in lines if line.startswith("pip install"))
            for number, line in lines:
                for args in qkv_invocations(line) if MENTIONS_QKV.search(line) else []:
                    problems += [f"{rel(path)}:{number}: {line}\n    needs pip install -e '.[{extra}]' in its block"
                                 for extra, needs in EXTRAS.items() if needs(args) and f"[{extra}]" not in installs]
    return problems


def test_the_extra_checker_finds_a_block_without_its_install_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nqkv import marian ./m --out x\n```\n\n```\npip install -e '.[marian]'\n"
                    "qkv export --checkpoint x --format marian --out y\n```\n\n```\n$ qkv import marian m --out x\n```\n",
                    encoding="utf-8")
    assert [p.split("\n")[0] for p in extra_problems([page])] == [f"{page}:2: qkv import marian ./m --out x"]


def test_every_block_that_needs_an_extra_installs_it():
    assert not extra_problems([README, *DOCS]), "\n".join(extra_problems([README, *DOCS]))


def test_the_readme_command_table_names_every_command():
    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Commands"):].split("\n## ")[0]
    named = set(re.findall(r"^\| `qkv ([\w-]+)", table, re.M))
    assert not set(SUBCOMMANDS) - named, f"commands missing from the README's table: {sorted(set(SUBCOMMANDS) - named)}"
    assert not named - set(SUBCOMMANDS), f"the README's table names no such command: {sorted(named - set(SUBCOMMANDS))}"


# --- Links ----------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=[\"']([^\"']+)[\"']", re.I)


def links(path: Path):
    """(line number, target) of each link, image, reference definition and HTML href/src outside code."""
    _, outside = split_markdown(path.read_text(encoding="utf-8"))
    outside = without_code_spans(outside)
    for pattern in (LINK, REFERENCE, HTML):
        for match in pattern.finditer(outside):
            yield outside.count("\n", 0, match.start()) + 1, match.group(1)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, outside = split_markdown(path.read_text(encoding="utf-8"))
    found, seen = set(), {}
    for heading in re.findall(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", outside, re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    found.update(re.findall(r"<a\s[^>]*\b(?:name|id)=[\"']([^\"']+)[\"']", outside))
    return found


def link_problems(paths: list[Path]) -> tuple[list[str], int]:
    problems, count = [], 0
    for path in paths:
        for number, target in links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http(s), mailto
            count += 1
            where = f"{rel(path)}:{number}: ({target})"
            file, _, anchor = unquote(target).partition("#")
            resolved = (path.parent / file.split("?")[0]).resolve() if file else path
            if ROOT not in resolved.parents and resolved != ROOT:
                problems.append(f"{where} leaves the repository")
            elif not resolved.exists():
                problems.append(f"{where} no such file: {rel(resolved)}")
            elif anchor and resolved.suffix == ".md" and anchor.lower() not in anchors(resolved):
                problems.append(f"{where} no heading with the anchor #{anchor} in {rel(resolved)}")
    return problems, count


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# A `page`: here\n\n## Two\n\n## Two\n\n"
        "[ok](#a-page-here) [ok](page.md#two-1) ![ok](page.md) [web](https://example.com/x.md)\n"
        "| a | [gone](missing.md) |\n"  # 8
        "[bad anchor](#three) `[in code](nowhere.md)`\n"  # 9
        "```\n[in a block](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    with mock.patch.dict(globals(), {"ROOT": tmp_path}):
        problems, count = link_problems([page])
    assert count == 5 and [p.split(":")[1] for p in problems] == ["8", "9"], problems
    assert slug("`qkv demo`: attention you can check by eye") == "qkv-demo-attention-you-can-check-by-eye"
    assert slug("De→En and En→Fr with the preset") == "deen-and-enfr-with-the-preset"


def check_links(paths: list[Path], minimum: int) -> None:
    problems, count = link_problems(paths)
    assert not problems, f"{len(problems)} of {count} relative links are broken:\n" + "\n".join(problems)
    assert count >= minimum, f"only {count} relative links found"


def test_docs_links_resolve():
    check_links(DOCS, minimum=10)


def test_readme_links_resolve():
    check_links([README], minimum=1)


# --- Python snippets ------------------------------------------------------------------------------------

CLAIM = re.compile(r"^#\s*([A-Za-z_]\w*\s*=.+)$")


def claims(code: str) -> dict[str, tuple[object, str]]:
    """``name: (value, its text)`` from the block's whole-line comments ``# name = value, name = value``
    whose values are Python literals (other comments are prose)."""
    found = {}
    for line in code.splitlines():
        if match := CLAIM.match(line.strip()):
            try:
                pairs = [part.split("=", 1) for part in re.split(r",\s*(?=[A-Za-z_]\w*\s*=)", match.group(1))]
                found.update({name.strip(): (ast.literal_eval(text.strip()), text.strip()) for name, text in pairs})
            except (ValueError, SyntaxError):
                continue
    return found


def same(actual, claimed, tolerance: float) -> bool:
    actual = actual.tolist() if hasattr(actual, "tolist") else actual
    if isinstance(claimed, (list, tuple)):
        return isinstance(actual, (list, tuple)) and len(actual) == len(claimed) and all(
            same(a, c, tolerance) for a, c in zip(actual, claimed))
    if isinstance(claimed, float) or isinstance(actual, float):
        return isinstance(actual, (int, float)) and math.isclose(actual, claimed, abs_tol=tolerance)
    return actual == claimed


def snippet_problems(paths: list[Path]) -> tuple[list[str], int, int, list[str]]:
    problems, run, compiled, skipped = [], 0, 0, []
    for path in paths:
        for block in split_markdown(path.read_text(encoding="utf-8"))[0]:
            if block.lang not in ("python", "py"):
                continue
            code, where = "\n".join(block.lines), f"{rel(path)}:{block.first_line}"
            try:
                compiled_code = compile(code, where, "exec")
            except SyntaxError as error:
                problems.append(f"{where}: does not compile: {error}")
                continue
            expected = claims(code)
            if not expected:
                compiled += 1
                continue
            if "runs/" in code:  # needs a trained checkpoint: too slow for this test
                skipped.append(where)
                continue
            run += 1
            namespace: dict = {}
            try:
                exec(compiled_code, namespace)
            except Exception as error:  # noqa: BLE001 - any failure of the snippet is the finding
                problems.append(f"{where}: raises {type(error).__name__}: {error}")
                continue
            for name, (value, text) in expected.items():
                decimals = max((len(d) for d in re.findall(r"\.(\d+)", text)), default=0)
                if name not in namespace:
                    problems.append(f"{where}: claims {name} = {text}, but the snippet defines no {name}")
                elif not same(namespace[name], value, 0.5 * 10 ** -decimals if decimals else 1e-9):
                    problems.append(f"{where}: claims {name} = {text}, the snippet gives {namespace[name]!r}")
    return problems, run, compiled, skipped


def test_the_snippet_checker_catches_a_wrong_claim(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = [0.25 * 2, 3]\n# x = [0.5, 3], y = 1\n```\n"
                    "```python\nz = 1\n# z = 2  (claimed)\n```\n", encoding="utf-8")
    problems, run, _, _ = snippet_problems([page])
    assert run == 1 and len(problems) == 1 and "no y" in problems[0], problems


def check_snippets(paths: list[Path], minimum: int) -> None:
    problems, run, _, _ = snippet_problems(paths)
    assert not problems, "\n".join(problems)
    assert run >= minimum, f"only {run} Python snippets with claimed values ran"


def test_docs_python_snippets_give_what_they_claim():
    check_snippets(DOCS, minimum=1)


def test_readme_python_snippets_give_what_they_claim():
    check_snippets([README], minimum=0)


# --- The generated reference ----------------------------------------------------------------------------

def test_docs_cli_md_is_generated_from_the_parser():
    expected = cli_reference().render()
    assert CLI_MD.is_file(), f"docs/cli.md is missing: run {REGENERATE}"
    assert CLI_MD.read_text(encoding="utf-8") == expected, f"docs/cli.md is out of date: run {REGENERATE}"


def test_the_cli_reference_names_every_command_and_option():
    text, parser = cli_reference().render(), build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        assert f"\n## qkv {name}\n" in text and f"(#qkv-{name})" in text
        section = text.split(f"\n## qkv {name}\n")[1].split("\n## ")[0]
        for action in sub._actions:
            assert all(f"`{flag}`" in section for flag in action.option_strings if flag not in ("-h", "--help"))
    assert "\x1b" not in text and "usage:" not in text  # nothing from argparse's terminal formatter


def test_the_cli_reference_check_mode_and_machine_dependent_defaults(tmp_path, monkeypatch, capsys):
    reference = cli_reference()
    monkeypatch.setattr(reference, "OUT", tmp_path / "cli.md")
    (tmp_path / "cli.md").write_text("stale\n", encoding="utf-8")
    assert reference.main(["--check"]) == 1 and REGENERATE in capsys.readouterr().err
    assert reference.main(["--write"]) == 0 and reference.main(["--check"]) == 0

    import os

    import qkv.cli.main

    def with_a_cpu_count_default():
        parser = build_parser()
        translate = parser._subparsers._group_actions[0].choices["translate"]
        translate.add_argument("--threads", type=int, default=os.cpu_count(), help="default: the CPU count")
        return parser

    monkeypatch.setattr(qkv.cli.main, "build_parser", with_a_cpu_count_default)
    row = next(line for line in reference.render().splitlines() if line.startswith("| `--threads`"))
    assert reference.MACHINE_DEPENDENT in row and "default: the CPU count" in row


# --- The generated API and config references ---------------------------------------------------------------

def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_api_md_is_generated_from_the_docstrings_of_the_stable_names():
    reference = script("api_reference")
    assert reference.OUT.is_file() and reference.OUT.read_text(encoding="utf-8") == reference.render(), (
        f"docs/api.md is out of date: run {reference.COMMAND}")
    import qkv

    text = reference.render()
    for name in qkv.__all__:  # every stable name has its section, with its docstring's first line
        assert f"\n## qkv.{name}\n" in text and inspect.cleandoc(getattr(qkv, name).__doc__).splitlines()[0] in text


def test_docs_config_md_is_generated_from_the_config_dataclasses_and_every_key_says_what_it_does():
    import dataclasses

    reference = script("config_reference")
    assert reference.OUT.is_file() and reference.OUT.read_text(encoding="utf-8") == reference.render(), (
        f"docs/config.md is out of date: run {reference.COMMAND}")
    for table, cls in reference.sections().items():
        comments = reference.field_comments(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if not comments.get(f.name)]
        assert not undocumented, f"[{table}] keys without a comment saying what they do: {undocumented}"


def test_every_range_the_config_reference_states_is_the_one_the_dataclass_enforces():
    import dataclasses

    from qkv.model.config import ConfigError

    reference, checked = script("config_reference"), 0
    for table, cls in reference.sections().items():
        comments, default = reference.field_comments(cls), cls()
        for field in dataclasses.fields(cls):
            stated = reference.stated_range(comments[field.name])
            if not stated:
                continue
            step = 1 if isinstance(getattr(default, field.name), int) else 1e-6

            def accepts(value, name=field.name) -> bool:
                try:
                    dataclasses.replace(default, **{name: type(getattr(default, name))(value)})
                    return True
                except ConfigError:
                    return False

            if interval := re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", stated):
                low, high = float(interval.group(2)), float(interval.group(3))
                assert accepts(low) == (interval.group(1) == "[") and not accepts(low - step), (table, field.name, stated)
                assert accepts(high) == (interval.group(4) == "]") and not accepts(high + step), (table, field.name, stated)
            else:
                sign, bound = stated.split()
                bound = float(bound)
                assert accepts(bound) == sign.endswith("=") and not accepts(bound - step), (table, field.name, stated)
                assert accepts(bound + step) and accepts(bound + 1), (table, field.name, stated)
            checked += 1
    assert checked >= 40, checked
