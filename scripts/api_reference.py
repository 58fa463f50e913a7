"""Write docs/api.md, the reference of qkv's stable Python API, from the docstrings of the names in ``qkv.__all__``.

    .venv/bin/python scripts/api_reference.py > docs/api.md   # print it
    .venv/bin/python scripts/api_reference.py --write         # write docs/api.md
    .venv/bin/python scripts/api_reference.py --check         # exit 1 if docs/api.md is out of date

Each name gets its signature (annotations as written in the source, defaults as Python writes them) and
its docstring; a class, its public methods and properties with theirs. A config dataclass's fields are
described in docs/config.md (scripts/config_reference.py), which the page links to instead of listing
them twice. tests/unit/test_docs.py checks that docs/api.md is what this script writes.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):  # run from anywhere, installed or not; cli_reference beside it
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from cli_reference import write_or_check  # noqa: E402

OUT = ROOT / "docs" / "api.md"
COMMAND = ".venv/bin/python scripts/api_reference.py --write"
CONFIG_SECTIONS = {"ModelConfig": "model", "TrainConfig": "train", "DataConfig": "data", "DecodeConfig": "decode"}


def parameters(function, *, drop_first: bool) -> str:
    """``(a: int, *, b: str = 'x')``: the signature with each annotation as its source writes it."""
    signature = inspect.signature(function)
    parts, keyword_only_marked = [], False
    params = list(signature.parameters.values())[1 if drop_first else 0:]
    params = [p for p in params if not p.name.startswith("_")]  # private: for qkv's own callers
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not keyword_only_marked:
            parts.append("*")
            keyword_only_marked = True
        if p.kind is p.VAR_POSITIONAL:
            keyword_only_marked = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    result = signature.return_annotation
    returns = "" if result is signature.empty or result in ("None", None) else f" -> {result}"
    return f"({', '.join(parts)}){returns}"


def docstring(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def members(cls) -> list[tuple[str, object]]:
    """The public methods and properties ``cls`` itself defines, in source order."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value) or isinstance(value, property):
            found.append((name, value))
    return found


def member_lines(cls_name: str, name: str, value) -> list[str]:
    if isinstance(value, property):
        header = f"`{cls_name}.{name}` (property)"
        text = docstring(value)
    else:
        function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        header = f"`{cls_name}.{name}{parameters(function, drop_first=not isinstance(value, staticmethod))}`"
        text = docstring(function)
    lines = [f"- {header}"]
    if text:
        lines += [("  " + line) if line else "" for line in text.splitlines()]
    return lines


def section(name: str, obj) -> list[str]:
    lines = [f"## qkv.{name}", ""]
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            signature = f"qkv.{name}(*, KEY=VALUE, ...)"
        elif issubclass(obj, Exception):
            signature = f"qkv.{name}(message: str)"
        else:
            signature = f"qkv.{name}{parameters(obj.__init__, drop_first=True)}"
    else:
        signature = f"qkv.{name}{parameters(obj, drop_first=False)}"
    lines += ["```text", signature, "```", ""]
    if text := docstring(obj):
        lines += [text, ""]
    if inspect.isclass(obj) and not issubclass(obj, Exception):
        init_doc = docstring(obj.__init__) if "__init__" in vars(obj) and obj.__init__.__doc__ else ""
        if init_doc:
            lines += [init_doc, ""]
        if name in CONFIG_SECTIONS:
            anchor = CONFIG_SECTIONS[name]
            lines += [f"Its keys, with types, defaults, ranges and what each does: [config.md](config.md#{anchor}).", ""]
        listed = members(obj)
        if listed:
            lines += ["Methods and properties:", ""]
            for member_name, value in listed:
                lines += member_lines(name, member_name, value)
            lines.append("")
    return lines


def render() -> str:
    import qkv

    lines = [
        "# Python API reference",
        "",
        f"<!-- Generated by scripts/api_reference.py from qkv's docstrings: do not edit. Regenerate: {COMMAND} -->",
        "",
        "The stable names of `qkv.__all__`, importable from `qkv` itself (`import qkv`, then `qkv.Translator`, ...). "
        f"Generated from their docstrings by `{COMMAND}`; `tests/unit/test_docs.py` fails when this page is out "
        "of date. What each is for, and the promises the library keeps: [model.md](model.md#the-python-api). "
        "Other modules of the package are reachable but not promised.",
        "",
        "| name | what it is |",
        "|---|---|",
    ]
    for name in qkv.__all__:
        first = docstring(getattr(qkv, name)).split("\n\n")[0].replace("\n", " ")
        lines.append(f"| [`qkv.{name}`](#qkv{name.lower()}) | {first.replace('|', chr(92) + '|')} |")
    lines.append("")
    for name in qkv.__all__:
        lines += section(name, getattr(qkv, name))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, render(), COMMAND, argv, "Write docs/api.md from the docstrings of qkv.__all__ (default: print it).")


if __name__ == "__main__":
    raise SystemExit(main())
