"""Inline term annotations: a source sentence with a target term written after the source word it
translates, so that a model trained on such pairs learns to copy the term into its translation
(Dinu et al., 2019, their "append" annotation, written inline instead of with source factors):

    A man climbs a ladder .   with (ladder, Leiter)   ->   A man climbs a ladder # Leiter # .

Training (``DataConfig.term_share``) annotates a share of the training pairs each epoch with
pseudo-terms: source words and the target words they align to, found once by ``qkv pseudo-terms``
(``qkv.inspect.terms.pseudo_terms``) and read here from its file. Translation with a glossary
(``qkv.infer.terms``) annotates the glossary's terms the same way for a model trained so; users never
see the annotation.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from qkv.errors import QkvError

MARK = "#"  # before and after the target term; one piece ("▁#") in the Multi30k tokenizers


def annotate(sentence: str, spans: list[tuple[int, int, str]]) -> str:
    """``sentence`` with `` # target #`` written after each (start, end, target) character span."""
    out, at = [], 0
    for _, end, target in sorted(spans, key=lambda s: s[1]):
        out += [sentence[at:end], f" {MARK} {target} {MARK}"]
        at = end
    return "".join(out) + sentence[at:]


def word_spans(sentence: str) -> list[tuple[int, int]]:
    """Character spans of ``sentence``'s whitespace-separated words."""
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", sentence)]


def pair_key(src: str, tgt: str) -> str:
    """What a pseudo-terms file knows a training pair by: its text, hashed (a run's training pairs are
    found whatever split, order or filtering made them)."""
    return hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).hexdigest()


def read_pseudo_terms(path: str | Path, src: list[str], tgt: list[str]) -> list[list[tuple[int, str]]]:
    """The pseudo-terms of each training pair (``src``, ``tgt``) from the file ``qkv pseudo-terms``
    writes: one JSON list a line, [pair key, [[source word index, target word], ...]]. A pair the file
    does not hold has none; a file that holds none of the pairs is an error."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise QkvError(f"cannot read the pseudo-terms {path}: {error}") from None
    table = {}
    for number, line in enumerate(lines, 1):
        try:
            key, terms = json.loads(line)
            table[str(key)] = [(int(i), str(t)) for i, t in terms]
        except (ValueError, TypeError):
            raise QkvError(f"{path} line {number} is not a JSON list [pair key, [[source word index, target word], ...]]") from None
    out = [table.get(pair_key(s, t), []) for s, t in zip(src, tgt)]
    if src and not any(pair_key(s, t) in table for s, t in zip(src, tgt)):
        raise QkvError(f"{path} holds none of the {len(src)} training pairs: make it with qkv pseudo-terms from this run's training data")
    return out


def annotated(src: list[str], terms: list[list[tuple[int, str]]], share: float, seed: int) -> list[str]:
    """The training sources with ``share`` of the pairs that have pseudo-terms annotated, one or two
    of their terms each, drawn from ``seed``."""
    rng = random.Random(seed)
    out = list(src)
    for i, candidates in enumerate(terms):
        if not candidates or rng.random() >= share:
            continue
        chosen = rng.sample(candidates, 1 if len(candidates) == 1 or rng.random() < 0.5 else 2)
        spans = word_spans(src[i])
        out[i] = annotate(src[i], [(*spans[w], t) for w, t in chosen if w < len(spans)])
    return out
