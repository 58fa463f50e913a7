"""Dynamic batching for ``qkv serve``: a queue bounded by work, one worker, one model thread.

Requests wait in a queue; a single worker takes what has arrived (up to ``max_batch_sentences``
sentences, ``max_batch_tokens`` source tokens and ``max_batch_work`` units of work, waiting at most
``max_wait_ms`` for more), groups it by decoding settings and translates each group as one batch in a
worker thread. The answer is serialized to JSON in that thread too, never on the event loop.

Work is what the server computes for a request, in units of one decoder step of one output token
(``Work``): for each non-empty text, its source tokens once for each pass of the encoder over them
(the search, and the teacher-forced pass that scores a greedy or sampled output or captures the
attention), plus the most output tokens the search may produce for it (``qkv.infer.search.max_output_length``)
times the units each costs (``Settings.work_per_token``: the beam size, or the price of a sampled
token, plus one when a greedy or sampled output is scored); with attention, also the attention
pass's output tokens and every attention weight it computes (the encoder's, the decoder's and the
cross weights, ``ATTENTION_WEIGHTS_PER_UNIT`` to a unit). An empty text counts 1. The queue counts
work, admitted and not yet answered, so a full queue means a bounded wait, not a long list.

Requests share a batch only when they ask for the same search (``Settings.search``); what changes
only the answer (how many of the n best, attention) is applied to each request's share of the results.

A request whose client went away (or timed out) is dropped from the queue, and a batch nobody waits
for any more stops at its next decoding step (a hook on the model's output layer checks between steps).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from qkv.data.sentences import Line
from qkv.infer.glossary import Glossary
from qkv.infer.terms import CONSTRAINED_BEAM, constraint_forms, translate_with_glossary
from qkv.inspect.terms import place
from qkv.infer.search import DecodeConfig, Hypothesis, length_penalty, max_output_length
from qkv.model.transformer import Transformer
from qkv.infer.score import target_log_probs
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import Translator, collate_sources
from qkv.inspect.contributions import contributions
from qkv.inspect.trust import assess

log = logging.getLogger("qkv.serve.app")

# Units of work per output token of sampling (a token of beam search costs the beam size). Each step
# draws from the whole vocabulary: top_k selects from it, top_p sorts it. benchmarks/sampling_cost.py
# timed each, per unit, against greedy search on one CPU thread: plain sampling 1.00-1.45x, top_k
# 1.06-2.40x, top_p 1.37-12.56x (the most: small models with large vocabularies); beam 16 0.90-1.17x.
SAMPLED_TOKEN_WORK = 1
TOP_K_TOKEN_WORK = 2
TOP_P_TOKEN_WORK = 12
# Units of work per source token, for each pass of the encoder over it. Timed on one thread against
# greedy steps in batches of 32, a source token took 0.3 to 0.6 of a step (d_model 32 to 128, sources
# of 100 to 1,000 tokens); counted in matrix-product FLOPs, 0.8 (the tiny preset): the encoder has
# no cross-attention and no output layer.
SOURCE_TOKEN_WORK = 1
# Attention weights computed per unit of work, with "attention": the pass that captures them
# materializes every weight of the encoder's self-attention (layers x heads x S x S), the decoder's
# (x T x T) and the cross-attention (x T x S). Timed as above (d_model 32 to 128, sources of 100 to
# 1,000 tokens), that pass took 56 to 2,300 units; charged S + T units and one per 1,000 weights, it
# pays 2.5 to 14 times that: on the dear side, which errs towards refusing.
ATTENTION_WEIGHTS_PER_UNIT = 1000
# Decomposed vector elements per unit, with "attention" or "confidence": that pass writes each
# attention block's output as one vector per input (qkv.inspect.contributions), layers x queries x
# keys x d_model elements, and each text costs CONTRIBUTION_TEXT_WORK more for its bookkeeping.
# Timed on one thread on the Multi30k preset's model (d_model 128) against greedy steps in batches of
# 32, the confidence of one text of 19, 73 and 217 tokens (translated into as many) took 86, 192 and
# 772 units; its decomposition alone is charged as below 91, 1,048 and 9,075 (the search's output
# limit, not the translation's length, makes the charge larger still): on the dear side, and in step
# with the pass's matrix-product FLOPs (tests/e2e/test_server_decoding.py).
CONTRIBUTION_ELEMENTS_PER_UNIT = 8_000
CONTRIBUTION_TEXT_WORK = 20


@dataclass(frozen=True)
class Settings:
    """What a request asks of the decoder, as validated by the server."""

    beam_size: int = 5
    max_length: int | None = None
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    n_best: int | None = None  # None: the answer has no n-best lists (and no scores)
    attention: bool = False
    confidence: bool = False
    glossary: Glossary | None = None  # compared by identity: a request with a glossary shares its batch with no other

    def search(self) -> Settings:
        """Without what changes only the answer: requests with equal searches share a batch."""
        return replace(self, n_best=None, attention=False, confidence=False)

    def decode_config(self, n_best: int = 1) -> DecodeConfig:
        length = {} if self.max_length is None else {"max_len_a": 0.0, "max_len_b": self.max_length}
        return DecodeConfig(
            beam_size=self.beam_size, n_best=n_best, sampling=self.sampling, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, seed=self.seed, **length,
        )

    @property
    def scored_apart(self) -> bool:
        """Greedy search and sampling give no scores: asked for, they take one teacher-forced pass more."""
        return self.n_best is not None and self.beam_size == 1

    def work_per_token(self) -> int:
        if not self.sampling:
            per_token = self.beam_size
        elif self.top_p < 1:
            per_token = TOP_P_TOKEN_WORK
        else:
            per_token = TOP_K_TOKEN_WORK if self.top_k else SAMPLED_TOKEN_WORK
        return per_token + (1 if self.scored_apart else 0)


@dataclass(frozen=True)
class Work:
    """What a request costs, in units of one decoder step of one output token (module docstring)."""

    source: int  # source tokens x the encoder's passes over them
    output: int  # output tokens x their price, with the attention pass's tokens; 1 per empty text
    attention: int  # the attention weights the attention pass computes / ATTENTION_WEIGHTS_PER_UNIT
    contributions: int = 0  # the decomposed elements / CONTRIBUTION_ELEMENTS_PER_UNIT, and each text's share

    @property
    def total(self) -> int:
        return self.source + self.output + self.attention + self.contributions


class Busy(Exception):
    """The queue is full, or the server is shutting down: answer 503 with Retry-After."""


class BatchAbandoned(Exception):
    """Raised inside the model between decoding steps: nobody waits for this batch any more."""


@dataclass
class Job:
    """One request: its texts, their token ids, its settings, its cost and the future its handler awaits.
    The future's result is the response body, JSON bytes; a cancelled future means nobody waits."""

    texts: list[str]
    src_ids: list[list[int]]  # of each text, or with ``lines`` of each sentence of the texts
    settings: Settings
    work: int
    future: asyncio.Future
    lines: list[Line] | None = None  # the texts cut into the sentences that ``src_ids`` encode (qkv.data.sentences)
    n_tokens: int = 0  # source tokens, each sentence's EOS included

    def __post_init__(self) -> None:
        self.n_tokens = sum(len(ids) + 1 for ids in self.src_ids)

    @property
    def abandoned(self) -> bool:
        # Read from the model thread too: a future's state is a plain attribute, safe to read there.
        return self.future.done()


@dataclass
class Stats:
    requests: int = 0  # accepted into the queue
    rejected: int = 0  # answered 503
    cancelled: int = 0  # the client went away before its answer
    timed_out: int = 0  # answered 504 after --request-timeout
    failed: int = 0  # answered 500 (the error is in the server log)
    aborted_batches: int = 0  # stopped before the end because nobody waited for them
    batches: int = 0
    sentences: int = 0
    batch_requests: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # sentences per batch -> how many batches

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "failed": self.failed,
            "aborted_batches": self.aborted_batches,
            "batches": self.batches,
            "sentences": self.sentences,
            "mean_batch_size": self.sentences / self.batches if self.batches else 0.0,
            "mean_batch_requests": self.batch_requests / self.batches if self.batches else 0.0,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }


class Batcher:
    """The queue, the worker that forms batches from it, and the thread that runs the model."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: TextTokenizer,
        *,
        max_batch_sentences: int,
        max_batch_tokens: int,
        max_batch_work: int,
        max_wait_ms: float,
        max_queue: int,
        max_queue_work: int,
        length_penalty: float = DecodeConfig.length_penalty,
        calibration: dict | None = None,
        loop_guard: int = 0,
        search_model: Transformer | None = None,
        make_translator: Callable[..., Translator] | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer  # the float32 model: confidence and attention read it
        self.search_model = search_model or model  # what searches and scores (a bfloat16 copy with --bf16)
        # (config, max_tokens=, max_sentences=) -> the Translator of one batch: qkv's over search_model, or
        # with --engine ctranslate2 one that searches in CTranslate2 (qkv.interop.ct2_engine)
        self.make_translator = make_translator or (lambda config, **kw: Translator(self.search_model, self.tokenizer, config, **kw))
        self.loop_guard = loop_guard  # every search's DecodeConfig.loop_guard (qkv serve --loop-guard; 0: the exact search)
        self.calibration = calibration  # the checkpoint's confidence.json (None: qkv.inspect.trust's default)
        self.length_penalty = length_penalty  # the checkpoint's choice (qkv.io.checkpoint.decode_defaults)
        self.max_batch_sentences, self.max_batch_tokens = max_batch_sentences, max_batch_tokens
        self.max_batch_work = max_batch_work
        self.max_wait = max_wait_ms / 1000
        self.max_queue, self.max_queue_work = max_queue, max_queue_work
        self.stats = Stats()
        self.closing = False
        self.pending_requests = 0  # admitted and not yet answered (queued or being translated)
        self.pending_work = 0
        self._queue: asyncio.Queue[Job | None] | None = None
        self._held: Job | None = None  # taken from the queue but did not fit the last batch
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="qkv-translate")
        self._decoding: list[Job] = []  # the jobs the model thread works on now
        self._stop_all = False  # set at shutdown, once nobody can be waiting any more
        # The output layer runs once per decoding step: the place to notice that nobody waits.
        self._hook = self.search_model.generator.register_forward_pre_hook(self._stop_if_abandoned)  # removed by close()

    def _stop_if_abandoned(self, module: Any, args: Any) -> None:
        jobs = self._decoding
        if self._stop_all or (jobs and all(job.abandoned for job in jobs)):
            raise BatchAbandoned

    # --- what a request costs -------------------------------------------------------------------

    def output_limits(self, src_ids: list[list[int]], settings: Settings) -> list[int]:
        """The most tokens the search may produce for each source (0 for an empty one: not searched)."""
        config = settings.decode_config()
        return [max_output_length(self.model, len(ids) + 1, config) if ids else 0 for ids in src_ids]

    def work(self, src_ids: list[list[int]], settings: Settings) -> int:
        """The units of work of a request (``work_parts``), in all."""
        return self.work_parts(src_ids, settings).total

    def work_parts(self, src_ids: list[list[int]], settings: Settings, texts: list[str] | None = None) -> Work:
        """What the server computes for these sources (module docstring), summed over texts: S source
        tokens (EOS included) and at most T output tokens each. With a glossary (``texts`` then given,
        one per source), a text that holds terms may be searched again with constraints (at the
        constrained beam, over its limit lengthened by its terms' longest forms) and is read once more
        for the alignment check."""
        per_token = settings.work_per_token()
        c = self.model.config
        source = output = weights = elements = n_texts = 0
        for i, (ids, n) in enumerate(zip(src_ids, self.output_limits(src_ids, settings))):
            if not ids:  # not searched (and its attention is made up, not computed)
                output += 1
                continue
            extra = settings.attention + settings.confidence  # teacher-forced passes with contributions
            passes = 1 + settings.scored_apart + extra  # of the encoder over each source
            if settings.glossary is not None and texts is not None and (matches := settings.glossary.matches(texts[i])):
                beam = max(CONSTRAINED_BEAM, settings.beam_size, len(matches) + 1)
                longest = sum(max(len(self.tokenizer.encode_target(f)) for f in constraint_forms(m.term)) for m in matches)
                output += beam * (n + longest)
                n += longest  # the translation may be that much longer: its other passes read as much more
                passes += 2  # the constrained search's encoder, and the alignment check's pass
                extra += 1
            S = len(ids) + 1
            source += SOURCE_TOKEN_WORK * S * passes
            output += per_token * n
            T = n + 1  # a teacher-forced pass reads BOS and the output
            if settings.attention:
                weights += c.n_heads * (c.n_encoder_layers * S * S + c.n_decoder_layers * (T * T + T * S))
            output += T * extra
            elements += extra * c.d_model * (c.n_encoder_layers * S * S + c.n_decoder_layers * (T * T + T * (S + 1)))
            n_texts += extra
        return Work(source, output, -(-weights // ATTENTION_WEIGHTS_PER_UNIT),
                    CONTRIBUTION_TEXT_WORK * n_texts + -(-elements // CONTRIBUTION_ELEMENTS_PER_UNIT))

    def attention_weights(self, src_ids: list[list[int]], settings: Settings) -> int:
        """The most cross-attention weights the answer can hold: layers x heads x T x S, summed over texts."""
        c = self.model.config
        sizes = [(n + 1) * (len(ids) + 1) for n, ids in zip(self.output_limits(src_ids, settings), src_ids)]
        return c.n_decoder_layers * c.n_heads * sum(sizes)

    # --- the queue ------------------------------------------------------------------------------

    def start(self) -> None:
        # The queue is made here, inside the server's event loop.
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="qkv-batcher")

    async def close(self) -> None:
        """Stop the worker. The server calls this after its graceful period: every request has been
        answered or given up, so what is left in the queue or in the model has nobody waiting for it."""
        self.closing = True
        self._stop_all = True
        if self._task is not None:
            await self._queue.put(None)
            await self._task
        self._executor.shutdown(wait=True)
        self._hook.remove()  # the model is the caller's again, as it was

    def queue_depth(self) -> int:
        return self.pending_requests

    def submit(self, texts: list[str], src_ids: list[list[int]], settings: Settings, work: int,
               lines: list[Line] | None = None) -> Job:
        if self.closing or self._queue is None:
            self.stats.rejected += 1
            raise Busy("the server is shutting down")
        if self.pending_requests >= self.max_queue or self.pending_work + work > self.max_queue_work:
            self.stats.rejected += 1
            raise Busy(
                f"the translation queue is full ({self.pending_requests} requests, {self.pending_work} units of "
                f"work waiting; limits {self.max_queue} and {self.max_queue_work})"
            )
        job = Job(texts, src_ids, settings, work, asyncio.get_running_loop().create_future(), lines=lines)
        self.pending_requests += 1
        self.pending_work += work
        job.future.add_done_callback(lambda _: self._release(job))
        self._queue.put_nowait(job)
        self.stats.requests += 1
        return job

    def _release(self, job: Job) -> None:
        self.pending_requests -= 1
        self.pending_work -= job.work

    async def _next(self, timeout: float | None) -> Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return self._queue.get_nowait()  # raises QueueEmpty
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def _collect(self) -> tuple[list[Job], bool]:
        """The next batch: whatever arrives within max_wait of the first request, within the budgets.
        A request is never split; one larger than the budgets makes a batch on its own."""
        first = await self._next(None)
        if first is None:
            return [], True
        batch, sentences, tokens, work = [first], len(first.src_ids), first.n_tokens, first.work
        deadline = time.monotonic() + self.max_wait
        while sentences < self.max_batch_sentences and tokens < self.max_batch_tokens and work < self.max_batch_work:
            try:
                job = await self._next(max(deadline - time.monotonic(), 0.0))
            except (asyncio.TimeoutError, asyncio.QueueEmpty):  # the two differ on Python 3.10
                break
            if job is None:
                return batch, True
            if job.abandoned:  # its client went away while it waited: drop it, it takes no room
                continue
            if (
                sentences + len(job.src_ids) > self.max_batch_sentences
                or tokens + job.n_tokens > self.max_batch_tokens
                or work + job.work > self.max_batch_work
            ):
                self._held = job
                break
            batch.append(job)
            sentences, tokens, work = sentences + len(job.src_ids), tokens + job.n_tokens, work + job.work
        return batch, False

    async def _run(self) -> None:
        stopping = False
        while not stopping or self._held is not None:
            if stopping:  # the sentinel came while a request was held back: finish that one too
                batch = [self._held]
                self._held = None
            else:
                batch, stopping = await self._collect()
            groups: dict[Settings, list[Job]] = {}
            for job in batch:
                if not job.abandoned:  # a dropped request was counted by its handler
                    groups.setdefault(job.settings.search(), []).append(job)
            for settings, jobs in groups.items():
                await self._translate(settings, jobs)

    async def _translate(self, settings: Settings, jobs: list[Job]) -> None:
        """One group in the model thread. If it fails, each request is retried alone, so that only the
        request that causes the failure fails; clients see a generic message, the log the traceback."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self.translate_group, settings, jobs)
        except BatchAbandoned:
            self.stats.aborted_batches += 1
            for job in jobs:  # only at shutdown can someone still be waiting
                if not job.abandoned:
                    job.future.set_exception(Busy("the server is shutting down"))
            return
        except Exception:  # one failed batch must not stop the server
            if len(jobs) > 1:
                log.warning("a batch of %d requests failed; retrying them one at a time", len(jobs), exc_info=True)
                for job in jobs:
                    if not job.abandoned:
                        await self._translate(settings, [job])
                return
            log.exception("translation failed for a request of %d texts", len(jobs[0].texts))
            self.stats.failed += 1
            if not jobs[0].abandoned:
                jobs[0].future.set_exception(RuntimeError("translation failed"))
            return
        n = sum(len(job.texts) for job in jobs)
        self.stats.batches += 1
        self.stats.sentences += n
        self.stats.batch_requests += len(jobs)
        self.stats.batch_sizes[n] += 1
        for job, result in zip(jobs, results):
            if not job.abandoned:
                job.future.set_result(result)

    # --- the model thread -----------------------------------------------------------------------

    def translate_group(self, settings: Settings, jobs: list[Job]) -> list[bytes]:
        """Runs in the worker thread: one batch of requests with equal searches -> one JSON body each."""
        self._decoding = jobs
        try:
            return self._translate_group(settings, jobs)
        finally:
            self._decoding = []

    def _translate_group(self, search: Settings, jobs: list[Job]) -> list[bytes]:
        # One search for the whole group, with as many of the n best as any request asks for.
        config = replace(search.decode_config(n_best=max(job.settings.n_best or 1 for job in jobs)), length_penalty=self.length_penalty,
                         loop_guard=self.loop_guard)
        translator = self.make_translator(config, max_tokens=self.max_batch_tokens, max_sentences=self.max_batch_sentences)
        if search.glossary is not None:  # its own group: the glossary's translation, then where each term went
            out = []
            for job in jobs:
                results = translate_with_glossary(translator, job.texts, search.glossary)
                place(self.model, self.tokenizer, results)
                hyps = [[Hypothesis(r.sentences[0].tokens, math.nan, math.nan)] for r in results]
                out.append(self._answer(job, hyps, config, terms=[r.terms() for r in results]))
            return out
        hyps = translator.translate_ids([ids for job in jobs for ids in job.src_ids])
        out, start = [], 0
        for job in jobs:
            mine, start = hyps[start : start + len(job.src_ids)], start + len(job.src_ids)
            out.append(self._answer(job, mine, config) if not job.abandoned else b"")
        return out

    def _answer(self, job: Job, hyps: list[list[Hypothesis]], config: DecodeConfig, terms: list | None = None) -> bytes:
        """One request's JSON body from its texts' hypotheses, best first (and with a glossary, ``terms``:
        each text's terms, ``GlossaryTranslation.terms``)."""
        translations = [self.tokenizer.decode(h[0].tokens) for h in hyps]
        if job.lines is not None:  # each text's sentences joined back (never with n_best, attention, confidence or max_length)
            at = iter(translations)
            translations = [line.join([next(at) for _ in line.sentences]) for line in job.lines]
        answer: dict[str, Any] = {"translations": translations}
        if job.settings.n_best is not None:
            nbest = [h[: job.settings.n_best] for h in hyps]
            scores = self._scores(job.src_ids, nbest, config)
            answer["n_best"] = [
                [{"translation": self.tokenizer.decode(h.tokens), "score": round(score, 4)} for h, score in zip(hs, ss)]
                for hs, ss in zip(nbest, scores)
            ]
        if job.settings.confidence:
            trusts = assess(self.model, self.tokenizer, job.texts, translations, calibration=self.calibration,
                            max_tokens=self.max_batch_tokens)
            answer["confidence"] = [t.to_json() for t in trusts]
        if terms is not None:
            answer["terms"] = terms
        body = _compact(answer)
        if job.settings.attention:  # the weights of each returned translation, one sentence at a time
            captures = []
            for text, ids, h in zip(job.texts, job.src_ids, hyps):
                if job.abandoned:  # nobody waits: skip its remaining sentences
                    break
                captures.append(self._attention_json(text, ids, h[0].tokens))
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
            max_tokens=self.max_batch_tokens,
        )
        for (i, j), lps in zip(todo, log_probs):
            tokens = nbest[i][j].tokens
            limit = max_output_length(self.model, len(src_ids[i]) + 1, config)
            n = len(tokens) + (len(tokens) < limit)  # with EOS, unless the search stopped at the limit
            scores[i][j] = math.fsum(lps[:n]) / length_penalty(n, config.length_penalty)
        return scores

    def _attention_json(self, text: str, ids: list[int], hyp: list[int]) -> str:
        """The JSON of one attention object: source, translation, tokens, cross weights (L, H, T, S) and
        ALTI+ contributions (L, T, S), from one teacher-forced pass (qkv.inspect.contributions)."""
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
