"""Inputs that provoke pathologies, made from Multi30k val sources (lines 151 on, seeded): the natural
half of the trust benchmark (benchmarks/trust.py; labels in benchmarks/gold/trust-natural).

    .venv/bin/python -m benchmarks.trust_inputs --out /tmp/natural.tsv     # kind, val line(s), input

Ten kinds, 40 lines each: ``control`` (a caption untouched), ``joined2`` and ``joined3`` (two or
three captions on one line), ``long`` (five to seven), ``fragment`` (one to three words of a caption),
``typos`` (three characters swapped, dropped or doubled), ``caps`` (ALL CAPITALS), ``numbers``
(a date, a time, a price or a count added), ``list`` (a numbered list of three captions' first
words), ``mixed`` (a caption's first half in English, the second half of the French caption).
Nothing here is copied into the project: the inputs are rebuilt from Multi30k by this script.
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
KINDS = ("control", "joined2", "joined3", "long", "fragment", "typos", "caps", "numbers", "list", "mixed")
PER_KIND = 40
FIRST = 150  # val lines 1-150 are the alignment gold set's


def _typos(text: str, rng: random.Random) -> str:
    chars = list(text)
    for _ in range(3):
        i = rng.randrange(1, max(2, len(chars) - 1))
        op = rng.choice(("swap", "drop", "double"))
        if op == "swap" and i + 1 < len(chars):
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        elif op == "drop":
            del chars[i]
        else:
            chars.insert(i, chars[i])
    return "".join(chars)


def _numbers(text: str, rng: random.Random) -> str:
    extra = rng.choice([
        f" on {rng.randint(1, 28)} {rng.choice(['May', 'June', 'March', 'October'])} {rng.randint(1950, 2024)}",
        f" at {rng.randint(1, 12)}:{rng.choice(['00', '15', '30', '45'])} pm",
        f" for ${rng.randint(2, 99)}.{rng.randint(10, 99)}",
        f" with {rng.randint(3, 9999):,} others",
    ])
    return text.rstrip(" .") + extra + "."


def make(data_dir: Path, seed: int = 1) -> list[tuple[str, str, str]]:
    """(kind, val line numbers, input) for every kind, in a seeded order."""
    read = lambda lang: gzip.open(data_dir / f"val.{lang}.gz", "rt", encoding="utf-8").read().splitlines()  # noqa: E731
    en, fr = read("en"), read("fr")
    rng = random.Random(seed)
    pool = list(range(FIRST, len(en)))
    rng.shuffle(pool)
    take = iter(pool * 20)
    rows = []
    for kind in KINDS:
        for _ in range(PER_KIND):
            k = {"joined2": 2, "joined3": 3, "long": rng.randint(5, 7), "list": 3}.get(kind, 1)
            lines = [next(take) for _ in range(k)]
            caps = [en[i].strip() for i in lines]
            if kind == "fragment":
                words = caps[0].split()
                n = rng.randint(1, min(3, len(words)))
                start = rng.randrange(0, len(words) - n + 1)
                text = " ".join(words[start : start + n]).strip(".,")
            elif kind == "typos":
                text = _typos(caps[0], rng)
            elif kind == "caps":
                text = caps[0].upper()
            elif kind == "numbers":
                text = _numbers(caps[0], rng)
            elif kind == "list":
                text = " ".join(f"{n}. {' '.join(c.split()[:4]).rstrip('.,')};" for n, c in enumerate(caps, 1))
            elif kind == "mixed":
                e, f = caps[0].split(), fr[lines[0]].split()
                text = " ".join(e[: len(e) // 2] + f[len(f) // 2 :])
            else:  # control, joined, long
                text = " ".join(c if c.endswith((".", "!", "?")) else c + "." for c in caps) if k > 1 else caps[0]
            rows.append((kind, ",".join(str(i + 1) for i in lines), text))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(DATA))
    parser.add_argument("--out", required=True, help="a TSV: kind, val line numbers (1-based), input")
    args = parser.parse_args()
    rows = make(Path(args.data_dir))
    Path(args.out).write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
