"""A document translated: its segments through the translator as plain lines, its markup placed back.

``translate_document`` reads a document with its format's reader (``read``), translates the segments'
plain text in one call of the translator (splitting, recasing, loop guard, glossary and numbers as
for lines: ``Translator.translate_lines`` or ``translate_with_glossary``), reads the model's word
alignment of each sentence it wrote (``qkv.inspect.align.word_weight_matrices``: the alignment head
where the model has one), places each segment's markup (``qkv.document.placement``) and writes the
document back with the format's writer. The same placement puts a given translation's markup back
(``place_markup``: ``qkv markup``).
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkv.errors import QkvError
from qkv.document.formats import read
from qkv.document.placement import fallback_weights, place
from qkv.document.segments import Document, Segment
from qkv.infer.encodings import kept_encodings


@dataclass
class SegmentReport:
    """One translated segment: where it is, its source and translation as plain text, and (with
    ``confidence``) the trust pass's confidence and flags for it."""

    where: str
    source: str
    translation: str
    confidence: float | None = None
    flags: list[str] = field(default_factory=list)
    trust: Any = field(default=None, repr=False, compare=False)  # with confidence: the whole verdict (qkv.inspect.trust.Trust)

    def as_dict(self) -> dict:
        out = {"where": self.where, "source": self.source, "translation": self.translation}
        if self.confidence is not None:
            out |= {"confidence": round(self.confidence, 4), "flags": self.flags}
        return out


@dataclass
class TranslatedDocument:
    """The translated document (``text``) and a report per segment."""

    text: str
    segments: list[SegmentReport]


def _word_map(words: list[str], read: list[str]) -> dict[int, int]:
    """Index in ``read`` (the words the model read or wrote) -> index in ``words`` (the segment's), matched
    case-blind in order: recasing, a list marker kept out of the search or a sentence's joining space
    leave the rest in place."""
    matcher = difflib.SequenceMatcher(None, [w.lower() for w in words], [w.lower() for w in read], autojunk=False)
    out = {}
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            out[b + k] = a + k
    return out


def segment_weights(source_text: str, target_text: str, sentences: list[str], outputs: list[str], matrices: list) -> np.ndarray:
    """(target words, source words) weights of a whole segment from its sentences' own matrices (the
    sentences the model read, in order, and its outputs): block-diagonal, in the segment's words."""
    src_words, tgt_words = source_text.split(), target_text.split()
    read_src = [w for s in sentences for w in s.split()]
    read_tgt = [w for t in outputs for w in t.split()]
    src_map, tgt_map = _word_map(src_words, read_src), _word_map(tgt_words, read_tgt)
    weights = np.zeros((len(tgt_words), len(src_words)))
    s_at = t_at = 0
    for sentence, output, matrix in zip(sentences, outputs, matrices):
        n_s, n_t = len(sentence.split()), len(output.split())
        matrix = np.asarray(matrix, dtype=np.float64)
        if matrix.shape != (n_t, n_s) and n_t and n_s:  # the tokenizer's words are not the text's: by position
            matrix = fallback_weights(n_t, n_s)
        if matrix.shape == (n_t, n_s):
            ts = [t for t in range(n_t) if t_at + t in tgt_map]
            ss = [s for s in range(n_s) if s_at + s in src_map]
            if ts and ss:
                weights[np.ix_([tgt_map[t_at + t] for t in ts], [src_map[s_at + s] for s in ss])] = matrix[np.ix_(ts, ss)]
        s_at, t_at = s_at + n_s, t_at + n_t
    for t in range(len(tgt_words)):  # a word the model never wrote (a list marker put back) on its source twin
        if not weights[t].any():
            match = [s for s, w in enumerate(src_words) if w == tgt_words[t]]
            if match:
                weights[t, match[0]] = 1.0
    return weights


def _alignments(model, tokenizer, sentences: list[list[str]], outputs: list[list[str]], encode=None) -> list[list]:
    """Each line's sentence matrices, read in one batched pass."""
    from qkv.inspect.align import word_weight_matrices

    flat_src = [s for line in sentences for s in line]
    flat_tgt = [t for line in outputs for t in line]
    matrices = word_weight_matrices(model, tokenizer, flat_src, flat_tgt, encode=encode)
    out, at = [], 0
    for line in sentences:
        out.append([m.numpy() for m in matrices[at : at + len(line)]])
        at += len(line)
    return out


def alignment_model(translator):
    """The model whose alignment places markup: the translator's own, or an ensemble's first member."""
    from qkv.model.transformer import Transformer

    model = translator.model
    if isinstance(model, Transformer):
        return model
    members = getattr(model, "models", None)
    if members:
        return members[0]
    raise QkvError("documents need a qkv model to align with: translate with a qkv checkpoint")


def translate_segments(translator, segments: list[Segment], *, glossary=None, glossary_always: bool = False,
                       calibration: dict | None = None, confidence: bool = False, model=None,
                       words: bool = True) -> tuple[list[list], list[SegmentReport]]:
    """Each segment's placed translation (a node list) and its report. Segments of the same text are
    translated once. ``model``: the qkv model to align (and judge) with, by default the translator's.
    ``words``: with ``confidence``, each target word's marks too (``assess``'s; False: the light pass)."""
    unique = list(dict.fromkeys(s.text for s in segments if s.text.strip()))
    model = model if model is not None else alignment_model(translator)
    # The search's own encoder outputs, where it runs here on the model that aligns (not in workers, not CTranslate2)
    encodings = kept_encodings(translator, model)
    with encodings if encodings is not None else contextlib.nullcontext():
        if glossary is not None:
            from qkv.inspect.terms import translate_with_glossary  # mends by the model's alignment head

            results = translate_with_glossary(translator, unique, glossary, always=glossary_always) if unique else []
            texts, sentences, outputs = [r.text for r in results], [r.sources for r in results], [r.outputs for r in results]
        else:
            lines = translator.translate_lines(unique) if unique else []
            texts, sentences, outputs = [x.text for x in lines], [x.sentences for x in lines], [x.outputs for x in lines]
    marked = {s.text for s in segments if s.spans}  # a segment without markup needs no alignment
    wanted = [k for k, text in enumerate(unique) if text in marked]
    read = _alignments(model, translator.tokenizer, [sentences[k] for k in wanted], [outputs[k] for k in wanted],
                       encode=encodings.encode if encodings is not None else None)
    matrices: list = [None] * len(unique)
    for k, found in zip(wanted, read):
        matrices[k] = found
    trusts = None
    if confidence and unique:
        from qkv.inspect.trust import assess_lines

        trusts = assess_lines(model, translator.tokenizer, sentences, outputs, calibration=calibration, words=words)
    by_text = {}
    for k, text in enumerate(unique):
        weights = None if matrices[k] is None else segment_weights(text, texts[k], sentences[k], outputs[k], matrices[k])
        by_text[text] = (texts[k], weights, trusts[k] if trusts else None)
    placed, reports = [], []
    for segment in segments:
        if segment.text not in by_text:  # nothing to translate: the markup as it was
            placed.append(place(segment, segment.text, None))
            reports.append(SegmentReport(segment.where, segment.text, segment.text))
            continue
        target, weights, trust = by_text[segment.text]
        placed.append(place(segment, target, weights))
        reports.append(SegmentReport(segment.where, segment.text, target, trust.confidence if trust else None,
                                     list(trust.flags) if trust else [], trust))
    return placed, reports


def translate_document(translator, text: str, format: str, *, target_lang: str | None = None, glossary=None,
                       glossary_always: bool = False, confidence: bool = False, calibration: dict | None = None,
                       model=None) -> TranslatedDocument:
    """``text``, a document in ``format`` (``qkv.document.formats.FORMATS``), translated by ``translator``
    (a ``qkv.Translator``) with its markup, placeholders and structure kept (module docstring).
    ``target_lang``: written into the document where its format says its language (HTML's ``lang``,
    a PO header's ``Language``). ``glossary``: a ``qkv.Glossary`` (or ``qkv.infer.numbers.Numbers``) whose
    terms each segment's translation must hold (``qkv.translate_with_glossary``). ``confidence``: a confidence and flags per segment in the report
    (``calibration`` as for ``qkv.translate_with_confidence``); a PO entry whose segment is flagged is
    marked fuzzy."""
    return translate_read(translator, read(text, format, target_lang=target_lang), glossary=glossary,
                          glossary_always=glossary_always, confidence=confidence, calibration=calibration, model=model)


def translate_read(translator, document: Document, **options) -> TranslatedDocument:
    """A document already read (``qkv.document.formats.read``: the command line reads it before any model
    loads) translated as ``translate_document`` translates one; ``options`` are its keywords."""
    placed, reports = translate_segments(translator, document.segments, **options)
    return TranslatedDocument(document.write(placed, reports), reports)


def read_markup_pair(source: str, translation: str, format: str) -> tuple[Document, list[str]]:
    """``source`` read with its markup, and the text of each block of ``translation`` (the same blocks,
    without inline markup); a QkvError where the blocks do not pair up."""
    document, given = read(source, format), read(translation, format)
    if len(given.segments) != len(document.segments):
        raise QkvError(f"the translation has {len(given.segments)} text blocks where the source has "
                       f"{len(document.segments)}: give a translation of the same blocks, without inline markup")
    return document, [g.text for g in given.segments]


def place_markup(model, tokenizer, source: str, translation: str, format: str) -> str:
    """``translation`` (the document ``source`` translated, block for block, without its inline markup)
    with ``source``'s inline markup placed on it by ``model``'s alignment (``qkv markup``)."""
    return place_read_markup(model, tokenizer, *read_markup_pair(source, translation, format))


def place_read_markup(model, tokenizer, document: Document, targets: list[str]) -> str:
    """``place_markup`` on a pair ``read_markup_pair`` read."""
    sources = [s.text for s in document.segments]
    matrices = _alignments(model, tokenizer, [[s] for s in sources], [[t] for t in targets])
    placed = [place(s, t, m[0]) for s, t, m in zip(document.segments, targets, matrices)]
    return document.write(placed, [SegmentReport(s.where, s.text, t) for s, t in zip(document.segments, targets)])
