"""Scores are sacreBLEU's, and the length terms are printed beside them."""

from __future__ import annotations

import math

from sacrebleu.metrics import BLEU

from qkv.evaluate import format_scores, score

REFS = ["a man rides a red bike down the street", "two dogs play in the deep snow", "a woman reads a book"]


def test_short_translations_show_a_length_ratio_below_one_and_its_brevity_penalty():
    hyps = ["a man rides a bike", "two dogs play", "a woman reads a book"]  # 13 tokens against 21
    scores = score(hyps, REFS)
    assert (scores["hyp_len"], scores["ref_len"]) == (13, 21)
    assert scores["length_ratio"] == round(13 / 21, 4)
    assert scores["brevity_penalty"] == round(math.exp(1 - 21 / 13), 4)
    assert scores["bleu"] == round(BLEU().corpus_score(hyps, [REFS]).score, 2)
    assert format_scores(scores).splitlines()[-1] == (
        "length    ratio 0.619 (translations 13 / references 21 tokens), brevity penalty 0.540"
    )
    full = score(REFS, REFS)
    assert full["brevity_penalty"] == 1.0 and full["length_ratio"] == 1.0 and full["bleu"] == 100.0
