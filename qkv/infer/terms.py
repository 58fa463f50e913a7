"""Translating with a glossary: search as usual, check every term, put missing terms in where their
source term aligns, search again with constraints where that cannot be done.

For each sentence, the glossary's terms are found in the source (``Glossary.matches``); the sentence
is translated by the translator as it would be without a glossary, and its translation checked: each
term found in the source must stand in it (one of its forms, as often as the source has the term).
A sentence that fails the check is mended first, where the caller gives an ``align``er (a model
trained with guided alignment: ``qkv.inspect.terms.alignment_substitution``): each missing term's
asked-for form replaces the words of the translation its source words align to (``substitute``). Only
a sentence that still fails the check is searched again, by ``constrained_beam_search``, which places
every term; ``always=True`` searches every sentence with terms that way. Its output replaces the first
translation only if it passes the same check; else the first is kept and the sentence is unplaceable. A sentence without terms is
translated exactly as without the glossary. A term-aware model (trained with ``DataConfig.term_share``)
reads each term's asked-for form written after its source term (``qkv.data.term_annotation``), in both
searches (and is not mended by alignment: its source has words the terms' indices do not count).
``numbers=True`` adds every number the sentence writes in digits as a term whose form is the
number itself (``qkv.infer.numbers``), checked, mended, searched for and reported as the glossary's terms are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from qkv.data.sentences import AS_IS, Line, prepare_line
from qkv.data.term_annotation import annotate
from qkv.infer.constrained import constrained_beam_search
from qkv.infer.glossary import Glossary, Term, TermMatch, answers, missing, word_indices
from qkv.infer.numbers import Numbers, NumberTerm
from qkv.infer.loop_guard import loops, number_pieces
from qkv.infer.translator import Translator, collate_sources, length_batches, suppressed_tokens

# Beams of the constrained search (at least one more than the sentence has terms): Post and Vilar's
# dynamic beam allocation shares them among the banks of hypotheses that have placed 0, 1, ... terms.
# Chosen on Multi30k val (benchmarks/glossary.py, its exact-form term set, the 45-minute En->De model,
# docs/glossary.md): 5 and 10 beams placed every term; 10 gave BLEU 33.08 against 32.06 and more terms
# aligned with their source term (76.8% against 71.3%); with the stopping rule below, 35.62 against 35.03.
CONSTRAINED_BEAM = 10
# The constrained search stops a sentence once it has that many finished hypotheses (DecodeConfig's
# stop_early, CTranslate2's rule) instead of when none can still be beaten: with a strong length
# penalty (runs/en-de1's 1.6) the exhaustive rule keeps lengthening outputs that have placed their terms
# ("... Park. Grünanlage."). Chosen on Multi30k val (docs/glossary.md): BLEU 35.62 against 33.63 on the
# exact-form set and 32.78 against 31.76 on the inflected one, in 0.7x and 0.9x the time, every term placed.
CONSTRAINED_STOP_EARLY = True
# Beams of the constrained search for the sentences mending by alignment left (``align`` given): the
# hard ones, 23 of 287 on val's exact set. Chosen on Multi30k val (the README's model, docs/glossary.md):
# 5 beams gave BLEU 36.98 against 36.71 (exact) and 31.94 against 32.05 (inflected), in 1.26x against
# 1.36x the plain time on the exact set.
MENDED_BEAM = 5
CONSTRAINED_BATCH = 32  # sentences searched together by the constrained search
# A constrained output is at most as long as the first translation, its terms' longest forms and this
# many tokens more: on a hard sentence the search otherwise wrote on to the usual limit (1.5 x the
# source + 10) before it could end, and looped. Chosen on Multi30k val (benchmarks/glossary.py's two
# term sets, the README's model and its 6-1 student, docs/glossary.md) among none, 0, 3, 6 and 10: 3
# lost no BLEU summed over the four (+0.04) and halved the student's constrained decoder steps.
FIRST_SLACK: int | None = 3  # None: no cap but the usual limit

# (sources, translations) -> for each pair, its (source word, target word) links, 0-based over the
# whitespace-separated words (``qkv.inspect.terms.alignment_substitution`` makes one from a model's alignment head).
Aligner = Callable[[list[str], list[str]], list[list[tuple[int, int]]]]
_EDGE = re.compile(r"^(\W*)(.*?)(\W*)$", re.DOTALL)  # a word's leading punctuation, core, trailing punctuation


@dataclass
class TermUse:
    """One term asked for in one source sentence, and what became of it. Word indices are 0-based
    over the whitespace-separated words of the sentence (``source_words``) and of its translation
    (``target_words``). ``aligned_to`` and ``placed`` are filled by ``qkv.inspect.terms.place``: the
    source words the found term's words align to, and whether they include the term's own."""

    term: Term
    source: str  # the term as it stands in the sentence
    source_words: tuple[int, ...]
    found: str | None = None  # the form found in the translation (None: missing)
    target_words: tuple[int, ...] = ()
    aligned_to: tuple[int, ...] | None = None
    placed: bool | None = None
    writable: bool = True  # False: the model's vocabulary cannot write any of its forms (``writable_forms``)

    def as_dict(self) -> dict:
        return {
            "source": self.source, "source_words": list(self.source_words), "asked": self.term.forms[0],
            "accepted": list(self.term.forms), "found": self.found, "target_words": list(self.target_words),
            "aligned_to": None if self.aligned_to is None else list(self.aligned_to), "placed": self.placed,
            "writable": self.writable,
        } | ({"number": True} if isinstance(self.term, NumberTerm) else {})


@dataclass
class SentenceTerms:
    """One searched sentence: its source, translation, the terms it asked for and whether the
    constrained search made the translation."""

    source: str
    translation: str
    uses: list[TermUse] = field(default_factory=list)
    constrained: bool = False  # the constrained search made the translation
    tokens: list[int] = field(default_factory=list)  # the translation's target ids
    # The constrained search ran but found no output with every term within its length limit, or its
    # output still fails the check (``missing``): the first translation is kept (its missing terms
    # reported), not a worse one with some of them.
    unplaceable: bool = False
    substituted: bool = False  # missing terms were put in where their source terms align (``substitute``)


@dataclass
class GlossaryTranslation:
    """One input line translated with a glossary: the ``text`` written out, and its sentences (one,
    unless the translator cuts lines into sentences)."""

    text: str
    sentences: list[SentenceTerms]

    def terms(self) -> list[dict]:
        """Each term asked for, as JSON: ``TermUse.as_dict``, whether the constrained search made its
        sentence's translation, and (where the line was cut into sentences) its sentence's index."""
        split = len(self.sentences) > 1
        terms = []
        for i, s in enumerate(self.sentences):
            for use in s.uses:
                entry = use.as_dict() | {"constrained": s.constrained, "substituted": s.substituted, "unplaceable": s.unplaceable}
                terms.append(entry | {"sentence": i} if split else entry)
        return terms

    def as_dict(self) -> dict:
        return {"translation": self.text, "terms": self.terms()}

    @property
    def sources(self) -> list[str]:
        """Each sentence as the model read it (``TranslatedLine.sentences``), for the trust pass."""
        return [s.source for s in self.sentences]

    @property
    def outputs(self) -> list[str]:
        """The model's translation of each, before the line was recased and joined (``TranslatedLine.outputs``)."""
        return [s.translation for s in self.sentences]


def constraint_forms(term: Term) -> list[str]:
    """The forms a constrained search may write for ``term``: its own, and those starting in lower case
    also with a capital first letter (a sentence's first word), as the check accepts them."""
    forms = list(term.forms)
    forms += [f[:1].upper() + f[1:] for f in term.forms if f[:1].islower()]
    return list(dict.fromkeys(forms))


def word_continuations(tokenizer) -> frozenset[int]:
    """The target ids whose pieces continue the word before them (no leading "▁", a letter or digit
    first): after a term's last piece, one of these would make the term part of a longer word."""
    pieces = tokenizer.pieces(list(range(tokenizer.vocab_size)))
    return frozenset(i for i, p in enumerate(pieces) if p and not p.startswith("\u2581") and p[0].isalnum())


def _constrained(translator: Translator, src_ids: list[list[int]], constraints, joins, config, beam: int,
                 firsts: list[list[int]]) -> list:
    """The constrained search of sentences ``src_ids`` whose first translations were ``firsts`` (target ids):
    each output at most as long as its first, its terms' longest forms and ``FIRST_SLACK`` more."""
    tok, model = translator.tokenizer, translator.model
    src = collate_sources(src_ids, pad_id=tok.pad_id, eos_id=tok.eos_id).to(model.device)
    config = replace(config, stop_early=CONSTRAINED_STOP_EARLY)
    caps = None if FIRST_SLACK is None else [len(first) + FIRST_SLACK for first in firsts]  # the search adds the terms
    return constrained_beam_search(model, src, constraints, bos_id=tok.bos_id, eos_id=tok.eos_id, config=config, joins=joins,
                                   suppress=suppressed_tokens(tok), beam_size=max(beam, config.beam_size), max_lengths=caps)


def writable_forms(tokenizer, term: Term, joins: frozenset[int]) -> list[list[int]]:
    """The target ids of each of ``term``'s forms (``constraint_forms``) that the model can write: its
    pieces decode back to the form (no unknown piece, no character the vocabulary lacks) and it starts a
    word (its first id is not in ``joins``, ``word_continuations``)."""
    out = []
    for form in constraint_forms(term):
        ids = tokenizer.encode_target(form)
        if ids and tokenizer.unk_id not in ids and ids[0] not in joins and tokenizer.decode(ids) == form:
            out.append(ids)
    return out


def substitute(translation: str, misses: list[TermMatch], links: list[tuple[int, int]], keep: set[int] = frozenset()) -> str:
    """``translation`` with each of ``misses`` (terms it lacks) written in place of the words its source
    words align to (``links``: (source word, target word) pairs, 0-based over whitespace-separated
    words), in the form whose ending is most like theirs (``_nearest_form``). A term is left as it was
    (for the constrained search) where its source words align to no word, to words with others between
    them, to a word an earlier term took or to one of ``keep`` (words that answer another term), or to
    punctuation alone. A word keeps its leading
    and trailing punctuation; a number (``NumberTerm``) put in a word that holds digits replaces only
    them ("für55" -> "für25", "3000." -> "3/4/2024."); a form that starts the sentence takes a capital
    where the word it replaces had one."""
    words = translation.split()
    taken, edits = set(keep), []
    for m in misses:
        span = sorted({t for s, t in links if s in m.words and t < len(words)})
        if not span or span[-1] - span[0] + 1 != len(span) or taken & set(span):
            continue
        taken |= set(span)
        edits.append((span[0], span[-1], m.term))
    for a, b, term in sorted(edits, key=lambda e: e[0], reverse=True):  # from the right: the left indices hold
        text = " ".join(words[a : b + 1])
        lead, core, trail = _EDGE.match(text).groups()
        if not core:
            continue
        form = _nearest_form(term.forms, core)
        digits = [k for k, c in enumerate(core) if c.isdigit()]
        if isinstance(term, NumberTerm) and a == b and digits:
            form = core[: digits[0]] + form + core[digits[-1] + 1 :]
        elif a == 0 and form[:1].islower() and core[:1].isupper():
            form = form[:1].upper() + form[1:]
        words[a : b + 1] = [lead + form + trail]
    return " ".join(words)


def _nearest_form(forms: tuple[str, ...], replaced: str) -> str:
    """The form whose ending is most like that of the words it replaces (the longest common suffix,
    ignoring case; the asked-for form where none is longer): the inflection the model chose
    ("Schwimmwesten" -> "Rettungswesten" where both forms are listed)."""
    def shared(form: str) -> int:
        n = 0
        for x, y in zip(reversed(form.lower()), reversed(replaced.lower())):
            if x != y:
                break
            n += 1
        return n
    return max(forms, key=lambda f: (shared(f), -forms.index(f)))


def term_uses(glossary: Glossary, matches: list[TermMatch], sentence: str, translation: str) -> list[TermUse]:
    """Each match with the place that answers it in ``translation`` (``glossary.answers``: one place
    answers one match, so the k-th time a term stands in the source is answered by the k-th place one
    of its forms stands in the translation, and two terms with one form need it twice)."""
    uses = []
    for m, hit in zip(matches, answers(glossary, matches, translation)):
        use = TermUse(m.term, sentence[m.start : m.end], m.words)
        if hit is not None:
            _, start, end = hit
            use.found, use.target_words = translation[start:end], word_indices(translation, start, end)
        uses.append(use)
    return uses


def sentence_matches(glossary: Glossary, written: str, searched: str) -> list[TermMatch]:
    """Where ``glossary``'s terms stand in a sentence: in ``written``, the sentence as its line has it,
    then in ``searched``, the same sentence recased for the search (``prepare_line``: "A Trip To New
    York" -> "A trip to new york"), where no match of the first overlaps. A term with a capital letter
    matches only as written, so matching the recased sentence alone missed "New York" in a Title Case
    line. The two have the same length (lower-casing kept every character; else ``searched`` alone), so
    a match's place is the same in both."""
    if written == searched or len(written) != len(searched):
        return glossary.matches(searched)
    found = glossary.matches(written)
    for m in glossary.matches(searched):  # e.g. a capitalised term that only the recased sentence shows as written
        if not any(m.start < f.end and m.end > f.start for f in found):
            found.append(m)
    return sorted(found, key=lambda m: m.start)


def translate_with_glossary(translator: Translator, texts: list[str], glossary: Glossary | list[Glossary] | None = None, *,
                            always: bool = False, numbers: bool = False, align: Aligner | None = None) -> list[GlossaryTranslation]:
    """``texts`` translated by ``translator`` with every term of ``glossary`` its sources hold (module
    docstring); the unconstrained pass is the translator's own (its batches, workers and engine).
    ``glossary``: one for all texts, or a list of one per text. ``numbers``: also every number the
    sources write in digits, as a term asking for itself (``qkv.infer.numbers``: the rules; "number":
    true in its ``terms()`` record); a glossary's term wins where it overlaps a number. ``align``: links
    the sentences' words with their translations' (``Aligner``); given, a translation that misses a term
    is first mended by ``substitute`` (the module docstring), and searched again only if that fails."""
    tok, model = translator.tokenizer, translator.model
    if glossary is None and not numbers:
        raise ValueError("give a glossary, numbers=True, or both")
    glossaries = glossary if isinstance(glossary, list) else [glossary] * len(texts)
    if len(glossaries) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(glossaries)} glossaries")
    if numbers:
        glossaries = [g if isinstance(g, Numbers) else Numbers(g) for g in glossaries]
    lines = [prepare_line(t, translator.text) if translator.text else Line([t], [], [AS_IS]) for t in texts]
    sentences = [s for line in lines for s in line.sentences]
    owners = [g for line, g in zip(lines, glossaries) for _ in line.sentences]
    # The terms are looked for in the text as written as well as recased (``sentence_matches``).
    as_written = ([prepare_line(t, replace(translator.text, recase=False)) for t in texts]
                  if translator.text and translator.text.recase else lines)
    written = [s for line in as_written for s in line.sentences]
    if len(written) != len(sentences):  # the same cuts either way; should they differ, the recased text alone
        written = sentences
    matches = [sentence_matches(g, w, s) for g, w, s in zip(owners, written, sentences)]
    if getattr(model, "term_aware", False):  # a model trained with inline terms reads each term's form after its source term
        # (not a number's: the source already writes it as asked)
        shown = [annotate(s, [(m.start, m.end, m.term.forms[0]) for m in ms if not isinstance(m.term, NumberTerm)])
                 for s, ms in zip(sentences, matches)]
    else:
        shown = sentences
    src_ids = [translator.encode(s) for s in shown]
    matches = [ms if ids else [] for ms, ids in zip(matches, src_ids)]
    hyps = translator.translate_ids(src_ids)
    tokens = [h[0].tokens for h in hyps]
    joins = word_continuations(tok)
    known: dict[Term, list[list[int]]] = {}
    forms_of = lambda term: known[term] if term in known else known.setdefault(term, writable_forms(tok, term, joins))  # noqa: E731
    # Searched again: a sentence with a term the model can write, if it misses one (or always).
    again = [i for i, (g, m, t) in enumerate(zip(owners, matches, tokens))
             if any(forms_of(x.term) for x in m) and (always or missing(g, m, tok.decode(t)))]
    translations = [tok.decode(t) for t in tokens]
    substituted = set()
    if align is not None and not always and not getattr(model, "term_aware", False) and again:
        for i, links in zip(again, align([sentences[i] for i in again], [translations[i] for i in again])):
            hits = answers(owners[i], matches[i], translations[i])
            keep = {w for h in hits if h is not None for w in word_indices(translations[i], h[1], h[2])}
            misses = [m for m, h in zip(matches[i], hits) if h is None and forms_of(m.term)]
            text = substitute(translations[i], misses, links, keep)
            if text != translations[i] and not missing(owners[i], matches[i], text):
                translations[i], tokens[i] = text, tok.encode_target(text)
                substituted.add(i)
        again = [i for i in again if i not in substituted]
    beam = MENDED_BEAM if align is not None and not always else CONSTRAINED_BEAM
    unplaceable = set()
    order = length_batches([len(src_ids[i]) for i in again], max_tokens=10**9, max_sentences=CONSTRAINED_BATCH)
    config = translator.config
    for batch in ([again[j] for j in group] for group in order):
        constraints = [[forms for m in matches[i] if (forms := forms_of(m.term))] for i in batch]
        found = _constrained(translator, [src_ids[i] for i in batch], constraints, joins, config, beam, [tokens[i] for i in batch])
        if config.loop_guard:  # as ``search``: an output that loops is searched again with no repeated n-gram
            numbers = number_pieces(tok)
            loop = [j for j, best in enumerate(found)
                    if loops(best.tokens, len(best.tokens) + 1, numbers=numbers, source=src_ids[batch[j]])]
            if loop:
                retry = replace(config, no_repeat_ngram_size=config.loop_guard, loop_guard=0)
                for j, best in zip(loop, _constrained(translator, [src_ids[batch[j]] for j in loop],
                                                      [constraints[j] for j in loop], joins, retry, beam,
                                                      [tokens[batch[j]] for j in loop])):
                    if all(best.met):
                        found[j] = best
        for i, best in zip(batch, found):
            # The check that sent the sentence here decides: a constrained output that places every term's
            # tokens but does not pass it (a number placed as "9" before ".5") is no better than the first.
            if all(best.met) and not missing(owners[i], matches[i], tok.decode(best.tokens)):
                tokens[i], translations[i] = best.tokens, tok.decode(best.tokens)
            else:
                unplaceable.add(i)
    out = []
    for i, (sentence, glossary) in enumerate(zip(sentences, owners)):
        translation = translations[i]
        uses = term_uses(glossary, matches[i], written[i], translation)  # each term as the line has it
        for use in uses:
            use.writable = bool(forms_of(use.term))
        out.append(SentenceTerms(sentence, translation, uses, i in again and i not in unplaceable, tokens[i], i in unplaceable,
                                 i in substituted))
    results, start = [], 0
    for line in lines:
        mine = out[start : start + len(line.sentences)]
        start += len(line.sentences)
        results.append(GlossaryTranslation(line.join([s.translation for s in mine]), mine))
    return results
