"""Translating text with a trained model: tokenize, batch by length, search, detokenize, restore order."""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.errors import QkvError
from qkv.io import checkpoint
from qkv.infer.encodings import kept_encodings
from qkv.infer.loop_guard import number_pieces
from qkv.infer.search import DecodeConfig, Hypothesis, SearchModel, length_penalty, search
from qkv.data.sentences import Line, TextOptions, prepare_line
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.shortlist import Shortlist
from qkv.infer.workers import DecodingWorkers
from qkv.model import incremental


@dataclass
class Translation:
    text: str
    tokens: list[int]
    score: float


@dataclass
class TranslatedLine:
    """One input line's 1-best translation (``text``, as written out) and what the search saw: the
    ``sentences`` the model read (split, recased) and its ``outputs`` for them, before they were recased
    and joined (what the trust pass judges)."""

    text: str
    sentences: list[str]
    outputs: list[str]


def collate_sources(src_ids: list[list[int]], *, pad_id: int, eos_id: int) -> torch.Tensor:
    """(B, S) source batch: each sentence + EOS, right-padded, as in training."""
    S = max(len(s) for s in src_ids) + 1
    src = torch.full((len(src_ids), S), pad_id, dtype=torch.long)
    for b, ids in enumerate(src_ids):
        src[b, : len(ids) + 1] = torch.tensor([*ids, eos_id], dtype=torch.long)
    return src


def length_batches(lengths: list[int], *, max_tokens: int, max_sentences: int) -> list[list[int]]:
    """Indices grouped by similar length, so a batch pads little; at most max_tokens padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, batch, width = [], [], 0
    for i in order:
        new_width = max(width, lengths[i] + 1)
        if batch and (new_width * (len(batch) + 1) > max_tokens or len(batch) >= max_sentences):
            batches.append(batch)
            batch, new_width = [], lengths[i] + 1
        batch.append(i)
        width = new_width
    if batch:
        batches.append(batch)
    return batches


def suppressed_tokens(tokenizer: TextTokenizer) -> tuple[int, ...]:
    """Tokens a search must never output: a decoder that starts from the pad token (Marian's, whose
    OPUS-MT configs forbid generating it through ``bad_words_ids``) never produces pad."""
    return (tokenizer.pad_id,) if tokenizer.bos_id == tokenizer.pad_id else ()


def sentence_seed(seed: int, src_ids: list[int]) -> int:
    """A sampling seed for one sentence from the user's seed and the sentence itself: the same sentence
    gets the same sample under a seed wherever it stands in the input and however it is batched."""
    digest = hashlib.blake2b(f"{seed}:{','.join(map(str, src_ids))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def joined_nbest(line: Line, hyps: list[list[Hypothesis]], decode, alpha: float) -> list[Translation]:
    """A line's n best from its sentences' (``Line.join``): the k-th joins each sentence's k-th (or its
    last), and scores as one hypothesis would, its log-probability over the length penalty (``alpha``) of
    all its tokens and the sentences' EOS (NaN where the search gives no scores); one sentence keeps its
    own score. ``decode``: token ids -> text. (``qkv translate --n-best`` and the server's ``n_best``.)"""
    nbest = []
    for k in range(max(len(hs) for hs in hyps)):
        picked = [hs[min(k, len(hs) - 1)] for hs in hyps]
        text = line.join([decode(h.tokens) for h in picked])
        tokens = [t for h in picked for t in h.tokens]
        score = picked[0].score if len(picked) == 1 else sum(h.log_prob for h in picked) / length_penalty(
            len(tokens) + len(picked), alpha)
        nbest.append(Translation(text, tokens, score))
    return nbest


class Translator:
    """A model, its tokenizer and a search configuration, ready to translate raw sentences.

    Sentences are searched in batches of similar length, each at most ``max_tokens`` padded source
    tokens and ``max_sentences`` sentences, whatever the beam (a batch decodes beam_size rows per
    sentence, over one copy of its source).

    ``workers`` > 1 (CPU only): batches are searched side by side in that many forked processes of
    one thread each (``qkv.infer.workers``), which gives the same translations faster when the model is
    small; the processes start at the first translation and end with ``close()`` (or ``with``).

    ``config``: how to search; None (the default) takes ``DecodeConfig``'s defaults with the decoding
    settings of the checkpoint the model was loaded from (``qkv.load_checkpoint``, ``from_checkpoint``):
    the length penalty its run chose on validation, as ``qkv translate`` does. A config you pass is used
    as given (``dataclasses.replace(translator.config, beam_size=1)`` keeps the checkpoint's penalty).

    ``shortlist``: each sentence is searched over the target pieces its source makes likely
    (``qkv.infer.shortlist``): faster, an approximation of the exact search.

    ``text``: how ``translate`` treats a line (``qkv.data.sentences.TextOptions``): cut into sentences
    that are searched in one batch and joined back into one line, and sentences in capitals translated
    in sentence case and written back in capitals. None (the default): each text is one sentence, as written.

    Defaults that differ from ``qkv translate``'s: the command line cuts lines into sentences and
    recases them (``text=TextOptions(split=<source language>, recase=True)``) and runs the loop guard
    (``config=dataclasses.replace(translator.config, loop_guard=2)``, which keeps the checkpoint's length
    penalty: a ``DecodeConfig(loop_guard=2)`` of your own has the default 0.6); a Translator does neither
    unless given them, so that a sentence is searched exactly as written. ``qkv.translate_with_confidence(translator, texts)`` gives what ``qkv
    translate --confidence`` gives, with the checkpoint's own calibration.

    Making a Translator changes nothing process-wide. On the CPU, call ``qkv.model.cpu.tune_allocator()``
    once where the program starts (the command line and the server do): every decoding step
    allocates and frees its vocabulary-sized scores, which glibc would otherwise hand back to the
    kernel and fault in again (1.1x beam 5 on the benchmark's batches, docs/benchmarks.md (c)).
    """

    def __init__(
        self,
        model: SearchModel,
        tokenizer: TextTokenizer,
        config: DecodeConfig | None = None,
        *,
        max_tokens: int = 2048,
        max_sentences: int = 128,
        workers: int = 1,
        shortlist: Shortlist | None = None,
        text: TextOptions | None = None,
    ) -> None:
        if workers < 1:
            raise QkvError(f"workers must be >= 1, got {workers}")
        if workers > 1 and model.device.type != "cpu":
            raise QkvError(f"decoding workers are for the CPU; the model is on {model.device} (use one worker)")
        if workers > 1 and incremental.compiled():
            # Forked after the parent compiled, a worker that meets a new shape waits on the parent's
            # compile workers forever (seen: a benchmark cell hung at no CPU).
            raise QkvError("compiled decoder steps run in one process: not with decoding workers (use one worker)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        # None: the settings a loaded checkpoint recommends (the length penalty its run chose on validation), as qkv translate uses
        self.config = config or DecodeConfig(**getattr(model, "decode_defaults", {}))
        self.max_tokens = max_tokens
        self.max_sentences = max_sentences
        self.workers = workers
        self.shortlist = shortlist
        self.text = text
        self._pool: DecodingWorkers | None = None

    def __enter__(self) -> Translator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the decoding workers (if any were started); a later translation starts them again."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, config: DecodeConfig | None = None, *, device: str | torch.device = "cpu", **kwargs
    ) -> Translator:
        """The checkpoint (or a run's ``final/``) at ``path``, searched with ``config`` (None: its own settings)."""
        loaded = checkpoint.load(path, device=device)
        return cls(loaded.model, loaded.tokenizer, config, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text``, cut to what the model's positions allow (with a warning).

        Longer inputs (say a 100,000-character line) are truncated, not rejected, so that a file
        still gives one output line per input line; the warning names how many tokens were kept.
        """
        ids = self.tokenizer.encode(text)
        limit = self.model.config.max_len - 1  # room for the EOS that collate_sources appends
        if len(ids) > limit:
            warnings.warn(
                f"an input of {len(ids)} subword tokens ({len(text)} characters) was truncated to the "
                f"model's limit of {limit} tokens; its translation covers only the beginning",
                stacklevel=2,
            )
        return ids[:limit]

    def translate_ids(self, src_ids: list[list[int]]) -> list[list[Hypothesis]]:
        """Search for each source; empty sources give one empty hypothesis. Keeps the input order."""
        results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] for _ in src_ids]
        todo = [i for i, ids in enumerate(src_ids) if ids]
        batches = length_batches([len(src_ids[i]) for i in todo], max_tokens=self.max_tokens, max_sentences=self.max_sentences)
        batches = [[todo[j] for j in batch] for batch in batches]
        if self.workers > 1 and len(batches) > 1:
            if self._pool is None:
                self._pool = DecodingWorkers(self._search_batch, self.workers)
            # The costliest batches first, so that no worker is left with a long one at the end.
            batches.sort(key=lambda batch: -len(batch) * max(len(src_ids[i]) for i in batch))
            found = self._pool.map([src_ids[i] for i in batch] for batch in batches)
        else:
            found = (self._search_batch([src_ids[i] for i in batch]) for batch in batches)
        for batch, hyps in zip(batches, found):
            for i, h in zip(batch, hyps):
                results[i] = h
        return results

    def _search_batch(self, src_ids: list[list[int]]) -> list[list[Hypothesis]]:
        """Search one batch of (non-empty) sources: the n best hypotheses of each."""
        tok = self.tokenizer
        src = collate_sources(src_ids, pad_id=tok.pad_id, eos_id=tok.eos_id)
        src = src.to(self.model.device)  # the model's device (a GPU while training, or with --device)
        seeds = [sentence_seed(self.config.seed, ids) for ids in src_ids] if self.config.sampling else None
        vocab = None if self.shortlist is None else self.shortlist.vocab(src_ids)
        numbers = number_pieces(tok) if self.config.loop_guard else None
        return search(self.model, src, bos_id=tok.bos_id, eos_id=tok.eos_id, config=self.config, seeds=seeds,
                      suppress=suppressed_tokens(tok), vocab=vocab, numbers=numbers)

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]:
        if self.text is None:
            hyps = self.translate_ids([self.encode(t) for t in texts])
            return [[Translation(self.tokenizer.decode(h.tokens), h.tokens, h.score) for h in hs] for hs in hyps]
        lines = [prepare_line(t, self.text) for t in texts]
        hyps = self.translate_ids([self.encode(s) for line in lines for s in line.sentences])  # one batch for all
        out, start = [], 0
        for line in lines:
            out.append(joined_nbest(line, hyps[start : start + len(line.sentences)], self.tokenizer.decode, self.config.length_penalty))
            start += len(line.sentences)
        return out

    def translate(self, texts: list[str]) -> list[str]:
        """One translation per input text, in order; an empty (or blank) input gives ''."""
        return [nbest[0].text for nbest in self.translate_nbest(texts)]

    def translate_lines(self, texts: list[str]) -> list[TranslatedLine]:
        """``translate``'s translations with the sentences the model read and its outputs for them."""
        lines = [prepare_line(t, self.text) if self.text is not None else None for t in texts]
        sentences = [line.sentences if line is not None else [t] for line, t in zip(lines, texts)]
        hyps = self.translate_ids([self.encode(s) for group in sentences for s in group])  # one batch for all
        out, start = [], 0
        for line, group in zip(lines, sentences):
            outputs = [self.tokenizer.decode(hs[0].tokens) for hs in hyps[start : start + len(group)]]
            out.append(TranslatedLine(outputs[0] if line is None else line.join(outputs), group, outputs))
            start += len(group)
        return out


# Lines of a file or pipe that ``translate_stream`` reads, sorts by length and batches at once. With
# 256, ``qkv translate`` (two decoding workers) made 0.77x the sentences/s of 1,024 on val, greedy,
# and 0.80x at beam 5 (docs/benchmarks.md (c)); the first output line waits for this many input lines.
STREAM_LINES = 1024


def translate_stream(translator: Translator, source, sink, *, name: str, n_best: int = 1, lines: int | None = None,
                     annotate: Callable[[list[str], list[str]], list[str]] | None = None,
                     write: Callable[[list[str]], list[str]] | None = None,
                     progress: Callable[[int], None] | None = None) -> None:
    """``qkv translate``: lines of ``source`` (bytes) to translations on ``sink``, one line each, in order.

    Interactive input is answered line by line; files and pipes are translated ``lines`` (default
    ``STREAM_LINES``, 1,024) lines at a time. With ``n_best`` > 1 each line holds the N best,
    tab-separated with their scores. ``annotate``: given each line's sentences as the model read them, its
    translations of them and the line's translation as written, the output lines to write instead of
    the translations (``qkv translate --confidence``; with ``n_best`` 1).
    ``write``: given the input lines, the output lines, one each, in place of the translator's own
    (``qkv translate --glossary``).
    ``progress``: called with the number of lines just written, after each batch (``qkv translate``'s
    progress line, ``qkv.cli.common.line_progress``).
    """
    chunk = 1 if getattr(source, "isatty", lambda: False)() else lines or STREAM_LINES
    buffer: list[str] = []

    def flush() -> None:
        _write_translations(translator, buffer, sink, n_best, annotate, write)
        if progress is not None:
            progress(len(buffer))

    for line in input_lines(source, name):
        buffer.append(line)
        if len(buffer) >= chunk:
            flush()
            buffer = []
    if buffer:
        flush()


def input_lines(source, name: str) -> Iterator[str]:
    """Lines of ``source`` without their ending. Only "\n" ends a line (a stray "\r" or U+2028 inside
    a line must not make two), so line N in is line N out; invalid UTF-8 is an error naming the line."""
    for number, raw in enumerate(source, 1):
        if isinstance(raw, str):  # a text stream (tests pass a StringIO)
            line = raw
        else:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise QkvError(f"{name} line {number} is not valid UTF-8 (byte {error.start + 1}: {raw[error.start:error.start + 1]!r})") from None
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte order mark
        yield line.removesuffix("\n").removesuffix("\r")


def _write_translations(translator: Translator, lines: list[str], sink, n_best: int, annotate=None, write=None) -> None:
    if write is not None:
        sink.writelines(line + "\n" for line in write(lines))
        sink.flush()
        return
    if annotate is not None:  # the trust pass judges what the model read and wrote, sentence by sentence
        encodings = kept_encodings(translator, getattr(annotate, "model", None))
        with encodings or contextlib.nullcontext():
            done = translator.translate_lines(lines)
        texts = [" ".join(line.text.splitlines()) for line in done]
        encode = encodings.encode if encodings is not None else None
        sink.writelines(line + "\n" for line in annotate([d.sentences for d in done], [d.outputs for d in done], texts, encode))
        sink.flush()
        return
    results = translator.translate_nbest(lines)
    for nbest in results:
        texts = [" ".join(t.text.splitlines()) for t in nbest]  # never more than one output line per input line
        if n_best == 1:
            sink.write(texts[0] + "\n")
        else:  # a tab the line had between its sentences would make a column of its own
            sink.write("\t".join(f"{text.replace(chr(9), ' ')}\t{t.score:.4f}" for text, t in zip(texts, nbest)) + "\n")
    sink.flush()
