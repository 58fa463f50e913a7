"""Where each glossary term went: the alignment check of a translation made with a glossary; and the
pseudo-terms of term-aware training, from the same aligner.

A term found in a translation is *placed* when its words align (``qkv.inspect.align``, the default
reading, ``default_reading``: the alignment head of a model trained with guided alignment, else value
norms at the middle decoder layer) to at least one word of the source term it answers.
A term written somewhere else (say "Hund" for the "dog" of "a dog chases a cat" aligned with "cat")
is found but not placed.
"""

from __future__ import annotations

from collections import Counter

from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.encodings import kept_encodings
from qkv.infer.glossary import Glossary
from qkv.infer.terms import Aligner, GlossaryTranslation
from qkv.infer.terms import translate_with_glossary as _translate_with_glossary
from qkv.infer.translator import Translator
from qkv.inspect.align import align
from qkv.model.transformer import Transformer

MIN_TERM_CHARS = 4  # letters of a pseudo-term's words, each side


def place(model: Transformer, tokenizer: TextTokenizer, results: list[GlossaryTranslation]) -> None:
    """Fill ``aligned_to`` and ``placed`` of every found term of ``results``, in place. One
    teacher-forced pass over each sentence that has a found term."""
    sentences = [s for r in results for s in r.sentences if any(u.found for u in s.uses)]
    if not sentences:
        return
    pairs = align(model, tokenizer, [s.source for s in sentences], [s.translation for s in sentences])
    for sentence, links in zip(sentences, pairs):
        for use in sentence.uses:
            if use.found is None:
                continue
            use.aligned_to = tuple(sorted({s for s, t in links if t in use.target_words}))
            use.placed = bool(set(use.aligned_to) & set(use.source_words))


def alignment_substitution(model, tokenizer: TextTokenizer, encode=None) -> Aligner | None:
    """The ``align`` that ``qkv.infer.terms.translate_with_glossary`` mends a translation with (a missing
    term put in place of the words its source term aligns to): ``align``'s default reading of a model
    trained with guided alignment (its alignment head, each source word linked with the target word that
    attends to it most). None for any other model (an ensemble, a Marian import, a model without the
    head, whose value-norm reading was not measured for this): its sentences that miss a term are searched
    again. ``encode``: as ``align``'s (the search's encoder outputs)."""
    if not isinstance(model, Transformer) or model.config.alignment_layer is None:
        return None
    return lambda sources, targets: align(model, tokenizer, sources, targets, encode=encode)


def translate_with_glossary(translator: Translator, texts: list[str], glossary: Glossary | list[Glossary] | None = None, *,
                            always: bool = False, numbers: bool = False, align: Aligner | None | str = "head") -> list[GlossaryTranslation]:
    """``qkv.infer.terms.translate_with_glossary`` as ``qkv translate --glossary`` runs it (``qkv.translate_with_glossary``):
    ``align="head"``, the default, mends a translation that misses a term by the translator's model's
    alignment head where it has one (``alignment_substitution``); None searches every such sentence
    again; or an ``Aligner`` of your own. With the head, mending reads the encoder outputs the first
    search computed (``qkv.infer.encodings``) rather than encoding the sentences again."""
    if align != "head":
        return _translate_with_glossary(translator, texts, glossary, always=always, numbers=numbers, align=align)
    model = getattr(translator, "model", None)
    encodings = kept_encodings(translator, model) if isinstance(model, Transformer) else None
    head = alignment_substitution(model, translator.tokenizer, encodings.encode if encodings is not None else None)
    if head is None or encodings is None:
        return _translate_with_glossary(translator, texts, glossary, always=always, numbers=numbers, align=head)
    with encodings:
        return _translate_with_glossary(translator, texts, glossary, always=always, numbers=numbers, align=head)


def pseudo_terms(model: Transformer, tokenizer: TextTokenizer, sources: list[str], targets: list[str], *,
                 min_chars: int = MIN_TERM_CHARS) -> list[list[tuple[int, str]]]:
    """For each training pair, the words fit to be pseudo-terms: (source word index, target word) where
    the aligner (``align``'s default reading) links the two one-to-one, and both are words of letters
    only, at least ``min_chars`` long (which leaves out most function words)."""
    out = []
    for source, target, links in zip(sources, targets, align(model, tokenizer, sources, targets)):
        src_words, tgt_words = source.split(), target.split()
        from_src, to_tgt = Counter(s for s, _ in links), Counter(t for _, t in links)
        out.append([(s, tgt_words[t]) for s, t in links if from_src[s] == 1 and to_tgt[t] == 1
                    and _word(src_words[s], min_chars) and _word(tgt_words[t], min_chars)])
    return out


def _word(word: str, min_chars: int) -> bool:
    return word.isalpha() and len(word) >= min_chars
