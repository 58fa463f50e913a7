"""A request's JSON answer in ``qkv serve``: its texts' translations from the hypotheses of the sentences
it searched, and what it asked for besides (n-best lists with scores, confidence, attention).

Made in a model thread (a batch's, or a continuous search's lane), never on the event loop; long
weight arrays are written a row at a time so that the thread gives the GIL back often.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor

from qkv.data.sentences import AS_IS, Line
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.score import target_log_probs
from qkv.infer.search import DecodeConfig, Hypothesis, length_penalty, max_output_length
from qkv.infer.translator import collate_sources, joined_nbest
from qkv.inspect.contributions import contributions
from qkv.inspect.trust import assess_lines
from qkv.model.transformer import Transformer


class Answers:
    """Writes answers with ``model`` (float32: confidence and attention read it), ``search_model`` (what
    searched: scores a greedy or sampled output), the checkpoint's ``calibration`` and ``max_tokens``
    source tokens a pass."""

    def __init__(self, model: Transformer, tokenizer: TextTokenizer, search_model: Transformer,
                 calibration: dict | None, max_tokens: int) -> None:
        self.model, self.tokenizer, self.search_model = model, tokenizer, search_model
        self.calibration, self.max_tokens = calibration, max_tokens

    def answer(self, job: Any, hyps: list[list[Hypothesis]], config: DecodeConfig, terms: list | None = None) -> bytes:
        """One request's JSON body from the hypotheses of the sentences it searched, best first (and with a
        glossary, ``terms``: each text's terms, ``GlossaryTranslation.terms``). Each text's translation is
        its sentences' joined back (``job.lines``: split, recased; never with max_length); its confidence
        and attention read the sentences as the model read and wrote them."""
        outputs = [self.tokenizer.decode(h[0].tokens) for h in hyps]  # one a sentence searched
        lines = job.lines or [Line([text], [], [AS_IS]) for text in job.texts]
        spans, start = [], 0  # each text's sentences: outputs[a:b], job.src_ids[a:b]
        for line in lines:
            spans.append((start, start + len(line.sentences)))
            start += len(line.sentences)
        translations = [line.join(outputs[a:b]) for line, (a, b) in zip(lines, spans)]
        answer: dict[str, Any] = {"translations": translations}
        if job.settings.n_best is not None:
            nbest = [h[: job.settings.n_best] for h in hyps]
            scores = self._scores(job.src_ids, nbest, config)
            # a text's n best joined from its sentences' as qkv translate --n-best joins them; a search that gives
            # no log-probability (greedy, sampling) has it from the teacher-forced pass's score
            alpha = config.length_penalty
            scored = [[Hypothesis(h.tokens, s, h.log_prob if math.isfinite(h.log_prob) else s * length_penalty(len(h.tokens) + 1, alpha))
                       for h, s in zip(hs, ss)] for hs, ss in zip(nbest, scores)]
            answer["n_best"] = [[{"translation": t.text, "score": round(t.score, 4)}
                                 for t in joined_nbest(line, scored[a:b], self.tokenizer.decode, alpha)]
                                for line, (a, b) in zip(lines, spans)]
        if job.settings.confidence:  # each sentence judged as translated, then each text, as qkv translate --confidence
            trusts = assess_lines(self.model, self.tokenizer, [line.sentences for line in lines],
                                  [outputs[a:b] for a, b in spans], calibration=self.calibration, max_tokens=self.max_tokens)
            answer["confidence"] = [t.to_json() for t in trusts]
        if terms is not None:
            answer["terms"] = terms
        body = _compact(answer)
        if job.settings.attention:  # the weights of each sentence searched; a text of several holds its sentences'
            captures = []
            for text, translation, line, (a, b) in zip(job.texts, translations, lines, spans):
                if job.abandoned:  # nobody waits: skip its remaining sentences
                    break
                mine = [self._attention_json(sentence, job.src_ids[k], hyps[k][0].tokens)
                        for sentence, k in zip(line.sentences, range(a, b))]
                if len(mine) == 1:
                    captures.append(mine[0])
                else:
                    captures.append(_compact({"source": text, "translation": translation})[:-1] + f',"sentences":[{",".join(mine)}]}}')
            body = body[:-1] + f',"attention":[{",".join(captures)}]}}'
        return body.encode("utf-8")

    def _scores(self, src_ids: list[list[int]], nbest: list[list[Hypothesis]], config: DecodeConfig) -> list[list[float]]:
        """Each hypothesis's score. Where the search gives none (greedy search, sampling), the same
        length-normalised log-probability from one teacher-forced pass: a hypothesis shorter than its
        text's output limit ended with EOS, which then counts as a token."""
        todo = [(i, j) for i, hs in enumerate(nbest) for j, h in enumerate(hs) if math.isnan(h.score)]
        scores = [[h.score for h in hs] for hs in nbest]
        if not todo:
            return scores
        log_probs = target_log_probs(
            self.search_model, self.tokenizer, [src_ids[i] for i, _ in todo], [nbest[i][j].tokens for i, j in todo],
            max_tokens=self.max_tokens,
        )
        for (i, j), lps in zip(todo, log_probs):
            tokens = nbest[i][j].tokens
            limit = max_output_length(self.model, len(src_ids[i]) + 1, config)
            n = len(tokens) + (len(tokens) < limit)  # with EOS, unless the search stopped at the limit
            scores[i][j] = math.fsum(lps[:n]) / length_penalty(n, config.length_penalty)
        return scores

    def _attention_json(self, text: str, ids: list[int], hyp: list[int]) -> str:
        """The JSON of one sentence's attention object: source (``text``, the sentence as the model read
        it), translation (as it wrote it), tokens, cross weights (L, H, T, S) and ALTI+ contributions
        (L, T, S), from one teacher-forced pass (qkv.inspect.contributions)."""
        if not ids:  # as Translator: an empty input translates to ''; one key gets all the weight
            c = self.model.config
            ones = [[[[1.0]] for _ in range(c.n_heads)] for _ in range(c.n_decoder_layers)]
            head = {"source": text, "translation": "", "src_tokens": ["</s>"], "tgt_tokens": ["</s>"]}
            return _compact({**head, "cross": ones, "contributions": [[[1.0]]] * c.n_decoder_layers})
        tok = self.tokenizer
        src = collate_sources([ids], pad_id=tok.pad_id, eos_id=tok.eos_id).to(self.model.device)  # (1, S)
        tgt = torch.tensor([[tok.bos_id, *hyp]], device=self.model.device)  # (1, T): BOS + hypothesis
        found = contributions(self.model, src, tgt)
        head = {
            "source": text,
            "translation": tok.decode(hyp),
            "src_tokens": tok.pieces([*ids, tok.eos_id]),
            "tgt_tokens": tok.pieces([*hyp, tok.eos_id]),
        }
        S = src.size(1)
        cross = torch.stack([w[0] for w in found.weights])  # L x (1, H, T, S) -> (L, H, T, S)
        alti = torch.stack([a[0, :, :S] for a in found.alti])  # L x (1, T, S + T) -> (L, T, S): the source columns
        cross_json = _weights_json(cross.double().round(decimals=4))
        alti_json = _weights_json(alti.double().round(decimals=4))
        return _compact(head)[:-1] + f',"cross":{cross_json},"contributions":{alti_json}}}'


def _compact(value: Any) -> str:
    # allow_nan=False: a NaN score would be invalid JSON; better a failed request and a traceback in the log.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _weights_json(weights: Tensor) -> str:
    """A JSON array of weights, (L, H, T, S) or (L, T, S), written one row at a time: each call is short,
    so this thread gives the GIL back to the event loop often (one json.dumps of a large list would hold it)."""
    if weights.dim() == 2:
        return "[" + ",".join(_compact(row) for row in weights.tolist()) + "]"
    return "[" + ",".join(_weights_json(part) for part in weights) + "]"
