"""Where each glossary term went: the alignment check of a translation made with a glossary.

A term found in a translation is *placed* when its words align (``qkv.inspect.align``, the default
reading: value norms at the middle decoder layer) to at least one word of the source term it answers.
A term written somewhere else (say "Hund" for the "dog" of "a dog chases a cat" aligned with "cat")
is found but not placed.
"""

from __future__ import annotations

from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.terms import GlossaryTranslation
from qkv.inspect.align import align
from qkv.model.transformer import Transformer


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
