"""Honest evaluation: sacreBLEU BLEU (cased and lowercased) and chrF on real, detokenized translations."""

from __future__ import annotations

from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from qkv.errors import QkvError


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus BLEU (cased), BLEU lowercased (as the Multi30k literature reports) and chrF, with signatures."""
    if len(hypotheses) != len(references):
        raise QkvError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, bleu_lc, chrf = BLEU(), BLEU(lowercase=True), CHRF()
    b, b_lc, c = (m.corpus_score(hypotheses, [references]) for m in (bleu, bleu_lc, chrf))
    return {
        "bleu": round(b.score, 2),
        "bleu_lc": round(b_lc.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_lc_signature": str(bleu_lc.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(hypotheses),
        # BLEU's length terms (cased tokenization): a ratio below 1 means translations shorter than the
        # references, which the brevity penalty exp(1 - ref/hyp) charges for.
        "length_ratio": round(b.ratio, 4),
        "brevity_penalty": round(b.bp, 4),
        "hyp_len": b.sys_len,
        "ref_len": b.ref_len,
    }


def sentence_chrf(hypotheses: list[str], references: list[str]) -> list[float]:
    """sacreBLEU's chrF (0-100) of each hypothesis against its one reference, one metric object for all."""
    if len(hypotheses) != len(references):
        raise QkvError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    chrf = CHRF()
    return [chrf.sentence_score(h, [r]).score for h, r in zip(hypotheses, references)]


def format_scores(scores: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"BLEU      {scores['bleu']:6.2f}   {scores['bleu_signature']}",
            f"BLEU (lc) {scores['bleu_lc']:6.2f}   {scores['bleu_lc_signature']}",
            f"chrF      {scores['chrf']:6.2f}   {scores['chrf_signature']}",
            f"length    ratio {scores['length_ratio']:.3f} (translations {scores['hyp_len']:,} / references "
            f"{scores['ref_len']:,} tokens), brevity penalty {scores['brevity_penalty']:.3f}",
        ]
    )
