"""Sequence-level knowledge distillation (Kim and Rush, 2016): a teacher translates the training
sources with beam search, and a student learns from those translations instead of the references.

``qkv distill`` joins three stages in one directory; each resumes where a killed run stopped:

    DIR/qkv-distill.json            the settings: the marker, compared when the command runs again
    DIR/distilled/part-NNNNNN.tsv   the teacher's translation and score of each source of part N
                                    (``part_size`` sources each, written whole or not at all)
    DIR/distilled/train.src, .tgt   the student's training pairs: the parts, filtered, mixed
    DIR/student/                    the student's run (``qkv train``'s layout)
    DIR/report.json, report.md      teacher and student on validation and test: BLEU (cased and lowercased), chrF, size, speed

The translations are exactly ``qkv translate``'s with the same settings (one line per source, a
sentence's line breaks joined with spaces); the student is ``qkv train`` on the two files.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.infer.bleu import score
from qkv.infer.translator import Translator
from qkv.io.checkpoint import sha256
from qkv.io.outputs import replace_whole

MARKER, REPORT = "qkv-distill.json", "report.json"
PARTS, STUDENT, TRAINED = "distilled", "student", "student.json"


@dataclass(frozen=True)
class Filtering:
    """What the student trains on, from the teacher's translations."""

    min_score: float | None = None  # drop pairs whose translation scored below this (the beam's ranking key, below)
    mix_original: bool = False  # also train on the original (source, reference) pairs


@dataclass
class Corpus:
    """The student's pairs: where they are, and how many of the teacher's were kept and dropped."""

    src: Path
    tgt: Path
    distilled: int
    dropped_score: int
    dropped_empty: int
    original: int


def lines_sha256(lines: Sequence[str] | None) -> str | None:
    import hashlib

    if lines is None:
        return None
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def fingerprint(teachers: Sequence[Path], sources: Sequence[str], **sets: Sequence[str] | None) -> dict[str, Any]:
    """What the results depend on besides the settings: each teacher's weights (not the path it was
    named by), the sources, and the other sets' text (original targets, validation, test)."""
    return {
        "teachers_sha256": [sha256(t / "model.safetensors") for t in teachers],
        "sources": len(sources), "sources_sha256": lines_sha256(sources),
        **{f"{name}_sha256": lines_sha256(lines) for name, lines in sets.items()},
    }


def refuse_foreign(out: Path) -> None:
    """The cheap half of ``open_directory``'s checks, before any data is read: a file, or a
    non-empty directory that is not a distillation, is refused."""
    if out.exists() and not out.is_dir():
        raise QkvError(f"--out {out} is a file, not a directory")
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise QkvError(f"--out {out} is not empty and holds no qkv distillation: choose a new or empty directory")


def open_directory(out: Path, settings: dict[str, Any]) -> bool:
    """Make ``out`` a distillation directory with ``settings``, or check that it is one with the same
    settings (a run to continue); True when it continues. Anything else there is refused, untouched."""
    marker = out / MARKER
    refuse_foreign(out)
    if marker.is_file():
        try:
            saved = json.loads(marker.read_text(encoding="utf-8"))
        except ValueError:
            raise QkvError(f"{marker} is damaged: choose a new --out") from None
        changed = [key for key in sorted(set(saved) | set(settings)) if saved.get(key) != settings.get(key)]
        if changed:
            raise QkvError(
                f"--out {out} holds a distillation with other settings ({', '.join(changed[:4])}): run the command "
                "that started it again to continue it, or choose a new --out"
            )
        return True
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(marker, json.dumps(settings, indent=2) + "\n")
    return False


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or is as it was (``qkv.io.outputs.replace_whole``)."""
    replace_whole(path, text.encode("utf-8"))


def translate_sources(
    out: Path, sources: Sequence[str], translator: Translator, *, part_size: int = 2000, progress: bool = True
) -> list[tuple[str, float]]:
    """The teacher's (translation, score) of every source, in order, part by part: parts already in
    ``out/distilled/`` (a killed run's) are read, not translated again."""
    from qkv.train.progress import progress as show_progress

    parts = out / PARTS
    parts.mkdir(exist_ok=True)
    results: list[tuple[str, float]] = []
    bar = show_progress(total=len(sources), enabled=progress, unit="sentence")
    for k in range(math.ceil(len(sources) / part_size)):
        chunk = sources[k * part_size : (k + 1) * part_size]
        path = parts / f"part-{k:06d}.tsv"
        done = _read_part(path) if path.is_file() else None
        if done is None or len(done) != len(chunk):  # a part is written whole; another length is not ours to trust
            found = translator.translate_nbest(list(chunk))
            done = [(" ".join(nbest[0].text.splitlines()), nbest[0].score) for nbest in found]
            _write_atomically(path, "".join(f"{text}\t{value!r}\n" for text, value in done))
        results.extend(done)
        bar.update(len(chunk))
    bar.close()
    return results


def _read_part(path: Path) -> list[tuple[str, float]] | None:
    try:
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            text, value = line.rsplit("\t", 1)
            rows.append((text, float(value)))
        return rows
    except (ValueError, UnicodeDecodeError):
        return None


def student_corpus(
    out: Path, sources: Sequence[str], translations: Sequence[tuple[str, float]], *, originals: Sequence[str] | None,
    filtering: Filtering,
) -> Corpus:
    """Write the student's training pairs: each source with the teacher's translation (those scored
    below ``min_score`` and empty ones dropped), then, with ``mix_original``, every original pair."""
    if filtering.mix_original and originals is None:
        raise QkvError("mixing in the original pairs needs their targets")
    pairs, low, empty = [], 0, 0
    for src, (text, value) in zip(sources, translations, strict=True):
        if not src.strip() or not text.strip():
            empty += 1
        elif filtering.min_score is not None and value < filtering.min_score:
            low += 1
        else:
            pairs.append((src, text))
    n_distilled = len(pairs)
    if filtering.mix_original:
        pairs += [(s, t) for s, t in zip(sources, originals or []) if s.strip() and t.strip()]
    if not pairs:
        raise QkvError(f"no distilled pair is left to train on ({low} scored below --min-score, {empty} empty)")
    corpus = Corpus(out / PARTS / "train.src", out / PARTS / "train.tgt", n_distilled, low, empty, len(pairs) - n_distilled)
    _write_atomically(corpus.src, "".join(s + "\n" for s, _ in pairs))
    _write_atomically(corpus.tgt, "".join(t + "\n" for _, t in pairs))
    return corpus


def measure(translator: Translator, sources: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """BLEU (cased and lowercased), chrF and sentences/s of ``translator`` on one set, timed after a warm-up on its first
    sentences (which starts the decoding workers, if any, and warms the allocator)."""
    translator.translate(list(sources[:64]))
    started = time.perf_counter()
    hypotheses = translator.translate(list(sources))
    seconds = time.perf_counter() - started
    scores = score(hypotheses, list(references))
    return {"bleu": scores["bleu"], "bleu_lc": scores["bleu_lc"], "chrf": scores["chrf"],
            "sentences_per_s": round(len(sources) / max(seconds, 1e-9), 1)}


def write_report(out: Path, rows: dict[str, dict[str, Any]], corpus: Corpus, settings: dict[str, Any], how: dict[str, Any]) -> str:
    """``report.json`` and ``report.md``: one row per model (teacher, student) and set; returns the table."""
    sets = [name for name in ("valid", "test") if all(name in row for row in rows.values())]
    lines = [
        "| model | parameters | length penalty | "
        + " | ".join(f"{s} BLEU | {s} BLEU (lc) | {s} chrF | {s} sentences/s" for s in sets) + " |",
        "|---|---:|---:|" + "---:|" * (4 * len(sets)),
    ]
    for name, row in rows.items():
        cells = [f"{row[s]['bleu']:.2f} | {row[s]['bleu_lc']:.2f} | {row[s]['chrf']:.2f} | {row[s]['sentences_per_s']:,.1f}"
                 for s in sets]
        lines.append(f"| {name} | {row['parameters']:,} | {row['length_penalty']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    notes = (f"Student trained on {corpus.distilled:,} distilled pairs ({corpus.dropped_score:,} dropped by --min-score, "
             f"{corpus.dropped_empty:,} empty) and {corpus.original:,} original pairs. Both models decoded at beam "
             f"{settings['decode']['beam_size']} on {how['device']}{', int8' if how['int8'] else ''}, {how['workers']} worker(s), "
             f"{how['threads']} thread(s), one after the other in one process, each timed after a warm-up; an ensemble's "
             "parameters are its members' together.\n")
    # report.md first: report.json is what says the distillation is complete.
    _write_atomically(out / "report.md", table + "\n" + notes)
    _write_atomically(out / REPORT, json.dumps({"models": rows, "measured": how,
                                                "corpus": asdict(corpus) | {"src": str(corpus.src), "tgt": str(corpus.tgt)}},
                                               indent=2) + "\n")
    return table + notes
