"""(c) Translation throughput on Multi30k test_2016_flickr: qkv, Hugging Face ``generate`` and
CTranslate2 on the same weights, greedy and beam 5, fp32 (qkv also bfloat16 and int8, CTranslate2 also
int8), in two tables.

**Same batches.** The sentences are sorted by source length (ties by position) and cut into batches
of ``SAME_BATCH`` sentences; every engine translates exactly these batches, one call per batch,
under one length limit per batch: the largest of qkv's per-sentence limits (``1.5 * (length + 1) +
10``) in it, since Hugging Face and CTranslate2 take one limit per call (qkv gets it as
``max_len_a=0, max_len_b=limit``). Every beam search stops at beam-size finished hypotheses
(qkv with ``stop_early``).
CTranslate2 runs qkv's rules (``qkv.interop.ctranslate2.ct2_translate_ids``: GNMT length penalty, so the same
algorithm as qkv); Hugging Face normalises by ``length ** 0.6``, its only choice. All engines use
the same number of threads (torch's; CTranslate2 ``intra_threads``), one batch at a time.

**Own settings.** Each engine as a user would run it for throughput:
- qkv: ``Translator`` (its own length-sorted batches, per-sentence limits, and a sentence searched
  until no live beam can beat its best finished hypothesis), with whichever ``max_tokens`` in
  ``BUDGETS`` and layout (one process x the threads, or one decoding worker per thread:
  ``workers``, ``qkv translate --workers``) was fastest on every 4th sentence, chosen per cell in
  this run, as CTranslate2's are.
- Hugging Face: batches of 64 sentences sharing a length limit (``generate`` takes one).
- CTranslate2: one ``translate_batch`` call over all sentences with ``batch_type="tokens"`` (batches
  by source tokens, so long sentences do not make large batches), its own length normalisation and
  the longest limit, and whichever ``max_batch_size`` in ``BUDGETS`` and thread layout (1 worker
  x the threads, or one worker per thread: ``inter_threads``, CTranslate2's throughput setting, runs
  several batches at once) was fastest on every 4th sentence, chosen per cell in this run. The
  threads in all never exceed qkv's.
- Both also with a vocabulary shortlist, built once for the run with ``qkv shortlist``'s defaults
  from the Multi30k training pairs: qkv ``--shortlist`` (fp32 and int8) and CTranslate2 with the same
  table as its vocabulary map (``use_vmap=True``; fp32 and int8). qkv searches each sentence over its
  own pieces, CTranslate2 a batch over the union of its sentences'.

Every cell: the load average checked (a warning printed when another job runs), a warm-up pass over
every 8th batch (own settings: every 8th sentence), then ``repeats`` timed passes over all sentences,
reported as the median sentences/s and the min-max. BLEU and the share of outputs identical to qkv's
(in the same table and beam) come from the last pass.
"""

from __future__ import annotations

import copy
import inspect
import multiprocessing
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.probe import busy, check_load, repeat_timed, spread
from qkv.io import checkpoint
from qkv.interop.convert import to_huggingface
from qkv.data.corpus import load_multi30k
from qkv.infer.search import DecodeConfig, max_output_length
from qkv.infer.bleu import score
from qkv.infer.shortlist import DEFAULT_FREQUENT, DEFAULT_K, build as build_shortlist, load as load_shortlist, save as save_shortlist
from qkv.interop.ctranslate2 import ct2_translate_ids, ctranslate2_spec, write_vmap
from qkv.model.bf16 import bf16_native
from qkv.model import incremental
from qkv.model.quantize import int8_model, int8_supported
from qkv.infer.translator import Translator

SAME_BATCH = 64  # sentences per batch in the same-batches table (CTranslate2's and Hugging Face's usual 64)
HF_BATCH = 64
BUDGETS = (512, 1024, 2048, 4096)  # source tokens per batch tried for qkv's and CTranslate2's own settings
UNLIMITED = 10**9  # a Translator budget that keeps a given batch whole
ENGINES = (("qkv", "float32"), ("qkv", "bfloat16"), ("qkv", "int8"), ("huggingface", "float32"), ("ctranslate2", "float32"), ("ctranslate2", "int8"),
           ("qkv", "float32+shortlist"), ("qkv", "int8+shortlist"), ("ctranslate2", "float32+vmap"), ("ctranslate2", "int8+vmap"),
           ("qkv+ct2", "float32"), ("qkv+ct2", "int8"), ("qkv", "float32+compiled"))
# "qkv+ct2" is `qkv translate --engine ctranslate2` (qkv.interop.ct2_engine.CTranslate2Translator over this
# run's export), in the own-settings table: what qkv adds around CTranslate2 used directly.
# A "+shortlist" cell decodes with a shortlist built for this run (qkv.infer.shortlist, the default k and
# frequent pieces, from the checkpoint's Multi30k training pairs); "+vmap" the same table as CTranslate2's
# vocabulary map (use_vmap=True). Both run in the own-settings table only: they are each engine's options.
# A "+compiled" cell is `qkv translate --compile` (qkv.model.incremental.compile_steps): its warm-up
# compiles the shapes it meets, so its times leave out most of a run's compiling (a timed pass that
# meets a new shape compiles it, which the min-max shows). It compiles for a minute or more in each
# of its cells, so it runs only when --engines names it.
ASKED_ONLY = ("+compiled",)
OWN_ONLY = ("+shortlist", "+vmap")
TARGETS = (  # issues 21 and 36: (name, goal, numerator, denominator), each an (engine, compute, beam)
    ("beam 5: qkv fp32 / CTranslate2 fp32", 1.0, ("qkv", "float32", 5), ("ctranslate2", "float32", 5)),
    ("beam 5: qkv int8 / CTranslate2 int8", 0.8, ("qkv", "int8", 5), ("ctranslate2", "int8", 5)),
    ("beam 5: qkv fp32+shortlist / CTranslate2 int8+vmap", 1.0, ("qkv", "float32+shortlist", 5), ("ctranslate2", "int8+vmap", 5)),
    ("beam 5: qkv int8+shortlist / CTranslate2 int8+vmap", 1.0, ("qkv", "int8+shortlist", 5), ("ctranslate2", "int8+vmap", 5)),
    ("greedy: qkv fp32 / CTranslate2 fp32", 1.2, ("qkv", "float32", 1), ("ctranslate2", "float32", 1)),
    # issue 64: qkv in bfloat16 (qkv translate --bf16) against CTranslate2 at its CPU settings
    ("beam 5: qkv bf16 / CTranslate2 fp32", 1.0, ("qkv", "bfloat16", 5), ("ctranslate2", "float32", 5)),
    ("beam 5: qkv bf16 / CTranslate2 int8", 0.8, ("qkv", "bfloat16", 5), ("ctranslate2", "int8", 5)),
    ("greedy: qkv bf16 / CTranslate2 fp32", 1.0, ("qkv", "bfloat16", 1), ("ctranslate2", "float32", 1)),
    ("beam 5: qkv --engine ctranslate2 / CTranslate2 fp32", 0.95, ("qkv+ct2", "float32", 5), ("ctranslate2", "float32", 5)),
    ("beam 5: qkv --engine ctranslate2 --int8 / CTranslate2 int8", 0.95, ("qkv+ct2", "int8", 5), ("ctranslate2", "int8", 5)),
    ("greedy: qkv --engine ctranslate2 / CTranslate2 fp32", 0.95, ("qkv+ct2", "float32", 1), ("ctranslate2", "float32", 1)),
    ("beam 5: qkv fp32+compiled / CTranslate2 fp32", 1.0, ("qkv", "float32+compiled", 5), ("ctranslate2", "float32", 5)),
    ("beam 5: qkv fp32+compiled / CTranslate2 int8", 0.8, ("qkv", "float32+compiled", 5), ("ctranslate2", "int8", 5)),
    ("greedy: qkv fp32+compiled / CTranslate2 fp32", 1.0, ("qkv", "float32+compiled", 1), ("ctranslate2", "float32", 1)),
    ("beam 5: qkv fp32 / Hugging Face generate", 2.0, ("qkv", "float32", 5), ("huggingface", "float32", 5)),
)


def same_batches(src_ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices sorted by source length (ties by position), in batches of ``size`` sentences."""
    order = sorted(range(len(src_ids)), key=lambda i: (len(src_ids[i]), i))
    return [order[i : i + size] for i in range(0, len(order), size)]


def _hf_generate(hf, tok, rows: list[list[int]], config: DecodeConfig, limit: int) -> list[list[int]]:
    """One ``generate`` call on ``rows`` (source ids), at most ``limit`` new tokens; ids without BOS/EOS."""
    S = max(len(ids) for ids in rows) + 1
    src = torch.full((len(rows), S), tok.pad_id, dtype=torch.long)
    for row, ids in enumerate(rows):
        src[row, : len(ids) + 1] = torch.tensor([*ids, tok.eos_id])
    beam = {"early_stopping": True, "length_penalty": config.length_penalty} if config.beam_size > 1 else {}
    with torch.inference_mode():
        generated = hf.generate(input_ids=src, attention_mask=(src != tok.pad_id).long(), max_new_tokens=limit,
                                num_beams=config.beam_size, do_sample=False, min_new_tokens=0, **beam)
    out = []
    for row in generated.tolist():
        tokens = row[1:]  # drop the decoder start (BOS)
        if tok.eos_id in tokens:
            tokens = tokens[: tokens.index(tok.eos_id)]
        out.append([t for t in tokens if t != tok.pad_id])
    return out


def _ct2_native(engine, tok, rows: list[list[int]], config: DecodeConfig, *, limit: int, budget: int,
                use_vmap: bool = False) -> list[list[int]]:
    """CTranslate2 left to itself: one call, its own sorting and batches of ``budget`` source tokens,
    its own length normalisation (``length ** 0.6``) and one length limit for all."""
    piece_to_id = {p: i for i, p in enumerate(tok.pieces(range(tok.vocab_size)))}
    outputs = engine.translate_batch(
        [tok.pieces(ids) for ids in rows], max_batch_size=budget, batch_type="tokens", beam_size=config.beam_size,
        length_penalty=config.length_penalty, max_decoding_length=limit, min_decoding_length=0, use_vmap=use_vmap,
    )
    return [[piece_to_id[p] for p in out.hypotheses[0]] for out in outputs]


class _Engines:
    """The runners of every (table, engine, compute) at one beam size, each returning {index: output
    ids}: ``same`` ones take the batches (lists of sentence indices), ``own`` ones a list of indices
    that they batch their own way."""

    def __init__(self, model, tok, src_ids, config: DecodeConfig, *, hf, ct2_dir: Path | None, threads: int,
                 ct2_cache: dict, qkv_computes: tuple[str, ...] = ("float32",), shortlist=None) -> None:
        self.model, self.tok, self.src_ids, self.config, self.hf = model, tok, src_ids, config, hf
        self.shortlist = shortlist  # for the "+shortlist" cells
        self.ct2_dir, self.threads, self._ct2 = ct2_dir, threads, ct2_cache  # CTranslate2 translators, shared by beams
        self.translators: list[Translator] = []  # qkv's, closed by close()
        self.limits = [max_output_length(model, len(ids) + 1, config) for ids in src_ids]
        self.qkv_model = {"float32": model}
        if any(c.startswith("int8") for c in qkv_computes):
            self.qkv_model["int8"] = int8_model(model)  # qkv translate --int8
        if "bfloat16" in qkv_computes:
            self.qkv_model["bfloat16"] = copy.deepcopy(model).to(torch.bfloat16)  # qkv translate --bf16

    def ct2(self, compute: str, inter: int = 1, intra: int | None = None):
        import ctranslate2

        key = (compute, inter, intra or self.threads)
        if key not in self._ct2:
            self._ct2[key] = ctranslate2.Translator(str(self.ct2_dir), device="cpu", compute_type=compute.split("+")[0],
                                                    inter_threads=inter, intra_threads=intra or self.threads)
        return self._ct2[key]

    def uniform(self, batch: list[int]) -> tuple[int, DecodeConfig]:
        """The batch's length limit, and the config that gives it to every sentence of the batch."""
        limit = max(self.limits[i] for i in batch)
        return limit, replace(self.config, max_len_a=0.0, max_len_b=limit)

    def same(self, engine: str, compute: str):
        rows_of = lambda batch: [self.src_ids[i] for i in batch]  # noqa: E731
        if engine == "qkv":
            def one(batch):
                translator = Translator(self.qkv_model[compute.split("+")[0]], self.tok, self.uniform(batch)[1], max_tokens=UNLIMITED,
                                        max_sentences=UNLIMITED)
                return [h[0].tokens for h in translator.translate_ids(rows_of(batch))]
        elif engine == "huggingface":
            one = lambda batch: _hf_generate(self.hf, self.tok, rows_of(batch), self.config, self.uniform(batch)[0])  # noqa: E731
        else:
            ct2 = self.ct2(compute)
            one = lambda batch: ct2_translate_ids(ct2, self.tok, rows_of(batch), self.uniform(batch)[1],  # noqa: E731
                                                  max_len=self.model.config.max_len, max_batch_size=len(batch))
        return lambda batches: {i: out for batch in batches for i, out in zip(batch, one(batch))}

    def own(self, engine: str, compute: str, choice: tuple[int, int, int] | None = None):
        """``choice``: (source tokens per batch, processes, threads each) for qkv and CTranslate2."""
        if engine == "qkv":
            budget, workers, threads = choice
            torch.set_num_threads(threads if workers == 1 else self.threads)  # a worker sets its own
            translator = Translator(self.qkv_model[compute.split("+")[0]], self.tok, self.config, max_tokens=budget,
                                    workers=workers, shortlist=self.shortlist if "+shortlist" in compute else None)
            self.translators.append(translator)

            def run(indices):
                hyps = translator.translate_ids([self.src_ids[i] for i in indices])
                return {i: h[0].tokens for i, h in zip(indices, hyps)}
        elif engine == "qkv+ct2":
            from qkv.interop.ct2_engine import CTranslate2Translator

            translator = CTranslate2Translator(self.model, self.tok, self.config, ct2_dir=self.ct2_dir, compute_type=compute,
                                               threads=self.threads)

            def run(indices):
                hyps = translator.translate_ids([self.src_ids[i] for i in indices])
                return {i: h[0].tokens for i, h in zip(indices, hyps)}
        elif engine == "huggingface":
            def run(indices):
                groups: dict[int, list[int]] = {}
                for i in indices:
                    groups.setdefault(self.limits[i], []).append(i)
                out = {}
                for limit, group in sorted(groups.items()):
                    for start in range(0, len(group), HF_BATCH):
                        chunk = group[start : start + HF_BATCH]
                        out.update(zip(chunk, _hf_generate(self.hf, self.tok, [self.src_ids[i] for i in chunk], self.config, limit)))
                return out
        else:
            budget, inter, intra = choice
            ct2 = self.ct2(compute, inter, intra)

            def run(indices):
                limit = max(self.limits[i] for i in indices)
                return dict(zip(indices, _ct2_native(ct2, self.tok, [self.src_ids[i] for i in indices], self.config,
                                                     limit=limit, budget=budget, use_vmap="+vmap" in compute)))
        return run

    def choose(self, engine: str, compute: str, sample: list[int], budgets: tuple[int, ...]) -> tuple[tuple[int, int, int], list[dict]]:
        """The fastest (budget, processes, threads each) of qkv's or CTranslate2's own settings on ``sample``
        (CTranslate2's processes are its ``inter_threads``, qkv's its decoding ``workers``)."""
        several = self.threads > 1 and not compute.endswith("+compiled")  # a compiled step runs in one process
        layouts = [(1, self.threads)] + ([(self.threads, 1)] if several else [])
        trials = []
        for inter, intra in layouts:
            for budget in budgets:
                run = self.own(engine, compute, (budget, inter, intra))
                run(sample)  # warm-up
                start = time.perf_counter()
                run(sample)
                trials.append({"budget": budget, "inter_threads": inter, "intra_threads": intra,
                               "seconds": round(time.perf_counter() - start, 4)})
                self.close()
        best = min(trials, key=lambda t: t["seconds"])
        return (best["budget"], best["inter_threads"], best["intra_threads"]), trials

    def close(self) -> None:
        """End the decoding workers of every qkv Translator made so far."""
        for translator in self.translators:
            translator.close()
        self.translators.clear()


def run(*, checkpoint_dir: str, data_dir: str, smoke: bool, threads: int, log, repeats: int = 0,
        engines: list[str] | None = None, sentences: int = 0, tables: tuple[str, ...] = ("same", "own"),
        beams: tuple[int, ...] = (1, 5), shortlist_size: tuple[int, int] | None = None) -> dict:
    """``engines``: "engine:compute" names to run (default: all of ENGINES); ``sentences``: the first
    that many of test_2016_flickr (default: all); ``tables``: "same" (batches) and/or "own" (settings);
    ``beams``: the beam sizes; ``shortlist_size``: (k, frequent) of the "+shortlist" and "+vmap" cells'
    shortlist (default: ``qkv shortlist``'s)."""
    repeats = repeats or (2 if smoke else 5)
    loaded = checkpoint.load(checkpoint_dir)
    model, tok = loaded.model, loaded.tokenizer
    data = loaded.config.get("data", {})
    corpus = load_multi30k("test_2016_flickr", data.get("src_lang", "en"), data.get("tgt_lang", "de"), data_dir)
    n = 24 if smoke else min(sentences or len(corpus.src), len(corpus.src))
    sources, references = corpus.src[:n], corpus.tgt[:n]
    batch_size, budgets = (8, (1024,)) if smoke else (SAME_BATCH, BUDGETS)
    missing, ct2_dir, compute_types = {}, None, []
    try:
        hf = to_huggingface(model, bos_id=tok.bos_id, eos_id=tok.eos_id)
    except RuntimeError as error:  # transformers is not installed
        hf, missing["huggingface"] = None, str(error)
    lists = _shortlist(model, tok, data, data_dir, *(shortlist_size or ()))
    table_file = Path(tempfile.mkdtemp(prefix="qkv-bench-shortlist-")) / "shortlist.safetensors"
    save_shortlist(lists, table_file)
    try:
        import ctranslate2

        compute_types = sorted(ctranslate2.get_supported_compute_types("cpu"))
        ct2_dir = Path(tempfile.mkdtemp(prefix="qkv-bench-ct2-"))
        write_vmap(lists, tok, table_file.parent / "vmap.txt")
        spec = ctranslate2_spec(model, tok)
        spec.register_vocabulary_mapping(str(table_file.parent / "vmap.txt"))  # used only by the "+vmap" cells (use_vmap)
        spec.save(str(ct2_dir))
    except ImportError as error:
        missing["ctranslate2"] = str(error)
    if "ctranslate2" not in missing and "int8" not in compute_types:
        missing["ctranslate2 int8"] = f"this CPU's compute types are {compute_types}"
    if not int8_supported():
        missing["qkv int8"] = "torchao is not installed (qkv translate --int8 needs it)"
    if not bf16_native(torch.device("cpu")):
        missing["qkv bfloat16"] = "this CPU has no AVX-512 BF16 or AMX (qkv translate --bf16 would decode in float32)"
    if engines:
        unknown = set(engines) - {f"{e}:{c}" for e, c in ENGINES}
        if unknown:
            raise SystemExit(f"unknown engines {sorted(unknown)}: choose from {[f'{e}:{c}' for e, c in ENGINES]}")
    for name, reason in missing.items():
        log(f"translation: {name} skipped ({reason})")
    runs_on = lambda e: "ctranslate2" if e == "qkv+ct2" else e  # noqa: E731  what a cell needs installed
    engines = [(e, c) for e, c in ENGINES if runs_on(e) not in missing and f"{runs_on(e)} {c.split('+')[0]}" not in missing
               and (f"{e}:{c}" in engines if engines else not c.endswith(ASKED_ONLY))]
    src_ids = [Translator(model, tok).encode(s) for s in sources]
    batches = same_batches(src_ids, batch_size)
    rows, choices = [], []
    spawn = multiprocessing.get_context("spawn")
    # Each cell in a fresh process: an engine that ran before (CTranslate2's thread pools above all)
    # slows PyTorch down for the rest of a process's life. A smoke run, which times nothing worth
    # reading, shares one worker process among its cells: starting 28 processes is most of its time.
    shared = ProcessPoolExecutor(max_workers=1, mp_context=spawn) if smoke else None
    for beam in beams:
        for table in tables:
            qkv_out = None
            for engine, compute in engines:
                if table == "same" and (compute.endswith(OWN_ONLY) or engine == "qkv+ct2"):
                    continue
                label = f"{table} batches" if table == "same" else "own settings"
                load_1min = check_load(f"translation {engine} {compute} beam {beam}, {label}", threads, log)
                with nullcontext(shared) if shared is not None else ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                    cell = pool.submit(_cell, checkpoint_dir, data_dir, n, beam, table, engine, compute, batch_size, budgets,
                                       threads, repeats, ct2_dir, table_file).result()
                if cell["choice"] is not None:
                    choices.append({"engine": engine, "beam": beam, "compute": compute, "chosen": cell["choice"],
                                    "trials": cell["trials"]})
                outputs = cell["outputs"]
                qkv_out = outputs if (engine, compute) == ("qkv", "float32") else qkv_out
                row = _row(table, engine, compute, beam, cell["settings"], cell["seconds"], load_1min, threads, n, outputs,
                           qkv_out, [tok.decode(t) for t in outputs], references)
                rows.append(row)
                log(f"translation {label}, {engine} {compute} beam {beam}: {row['sentences_per_s']:.1f} sentences/s "
                    f"({row['sentences_per_s_min']:.1f}-{row['sentences_per_s_max']:.1f}), BLEU {row['bleu']:.2f}, "
                    f"identical to qkv {100 * row['identical_to_qkv']:.1f}%")
    if shared is not None:
        shared.shutdown()
    if ct2_dir is not None:
        shutil.rmtree(ct2_dir, ignore_errors=True)
    shutil.rmtree(table_file.parent, ignore_errors=True)
    return {"checkpoint": str(loaded.path), "hf_model": type(hf).__name__ if hf is not None else None, "sentences": n,
            "repeats": repeats, "threads": threads, "same_batch_sentences": batch_size, "same_batches": len(batches),
            "ct2_compute_types": compute_types, "own_choices": choices, "missing": missing, "rows": rows,
            "shortlist": lists.info,
            "targets": targets(rows),
            "model": {k: getattr(model.config, k) for k in ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "norm_first")}}


def _shortlist(model, tok, data: dict, data_dir: str, k: int = DEFAULT_K, frequent: int = DEFAULT_FREQUENT):
    """The shortlist of the "+shortlist" and "+vmap" cells: ``k`` and ``frequent`` (``qkv shortlist``'s
    defaults) on the Multi30k training pairs."""
    train = load_multi30k("train", data.get("src_lang", "en"), data.get("tgt_lang", "de"), data_dir)
    pairs = ((tok.encode(s), tok.encode_target(t)) for s, t in zip(train.src, train.tgt))
    return build_shortlist(pairs, src_vocab=model.config.src_vocab_size, tgt_vocab=model.config.tgt_vocab_size, always=(tok.eos_id,),
                           k=k, frequent=frequent)


def _cell(checkpoint_dir: str, data_dir: str, n: int, beam: int, table: str, engine: str, compute: str, batch_size: int,
          budgets: tuple[int, ...], threads: int, repeats: int, ct2_dir: Path | None, table_file: Path) -> dict:
    """One cell of the tables, run in a process of its own: the warm-up, then ``repeats`` timed passes."""
    torch.set_num_threads(threads)
    if compute.endswith("+compiled"):
        incremental.compile_steps(True)
    loaded = checkpoint.load(checkpoint_dir)
    model, tok = loaded.model, loaded.tokenizer
    data = loaded.config.get("data", {})
    sources = load_multi30k("test_2016_flickr", data.get("src_lang", "en"), data.get("tgt_lang", "de"), data_dir).src[:n]
    hf = to_huggingface(model, bos_id=tok.bos_id, eos_id=tok.eos_id) if engine == "huggingface" else None
    src_ids = [Translator(model, tok).encode(s) for s in sources]
    shortlist = load_shortlist(table_file, src_vocab=model.config.src_vocab_size, tgt_vocab=model.config.tgt_vocab_size)
    runners = _Engines(model, tok, src_ids, DecodeConfig(beam_size=beam, stop_early=table == "same"), hf=hf, ct2_dir=ct2_dir, threads=threads,
                       ct2_cache={}, qkv_computes=(compute,) if engine == "qkv" else (), shortlist=shortlist)
    choice = trials = None
    if table == "same":
        batches = same_batches(src_ids, batch_size)
        fn, settings = runners.same(engine, compute), f"{len(batches)} batches of <= {batch_size} sentences"
        warm, timed = batches[::8], batches
    else:
        everything = list(range(n))
        if engine in ("qkv", "ctranslate2"):
            choice, trials = runners.choose(engine, compute, everything[::4], budgets)
        fn, settings = runners.own(engine, compute, choice), _own_settings(engine, choice)
        warm, timed = everything[::8], everything
    fn(warm)
    seconds, out = repeat_timed(lambda: fn(timed), repeats)
    runners.close()
    return {"seconds": seconds, "outputs": [out[i] for i in range(n)], "settings": settings, "choice": choice, "trials": trials}


def _own_settings(engine: str, choice) -> str:
    if engine == "huggingface":
        return f"batches of <= {HF_BATCH} sentences sharing a length limit"
    if engine == "qkv+ct2":
        return "qkv translate --engine ctranslate2: CTranslate2 over qkv's lines, its default batches"
    budget, inter, intra = choice
    if engine == "qkv":
        max_sentences = inspect.signature(Translator).parameters["max_sentences"].default
        return f"Translator, {budget} tokens per batch (max_sentences {max_sentences}), {inter} x {intra} threads (workers x threads)"
    return f"translate_batch, {budget} tokens per batch, {inter} x {intra} threads (inter x intra)"


def _row(table, engine, compute, beam, settings, seconds, load_1min, threads, n, outputs, qkv_out, hyps, references) -> dict:
    s = spread(seconds)
    same = sum(a == b for a, b in zip(outputs, qkv_out)) if qkv_out is not None else 0
    return {"table": table, "engine": engine, "compute": compute, "beam": beam, "settings": settings, "sentences": n,
            "seconds": [round(x, 4) for x in seconds], "sentences_per_s": n / s["median"],
            "sentences_per_s_min": n / s["max"], "sentences_per_s_max": n / s["min"],
            "ms_per_sentence": 1e3 * s["median"] / n, "load": load_1min, "busy": busy(load_1min, threads),
            "identical_to_qkv": round(same / n, 4), "bleu": score(hyps, references)["bleu"]}


def targets(rows: list[dict]) -> list[dict]:
    """Issue 21's ratios of median sentences/s, per table, with the range over the repeats (the
    slowest of one engine against the fastest of the other, and the reverse)."""
    by = {(r["table"], r["engine"], r["compute"], r["beam"]): r for r in rows}
    result = []
    for name, goal, num, den in TARGETS:
        entry = {"target": name, "goal": goal}
        for table in ("same", "own"):
            a, b = by.get((table, *num)), by.get((table, *den))
            if table == "same" and (num[1].endswith(OWN_ONLY) or den[1].endswith(OWN_ONLY) or num[0] == "qkv+ct2"):
                entry[table] = {"available": False, "reason": "own settings only"}
                continue
            if a is None or b is None:
                entry[table] = {"available": False, "reason": "an engine is missing"}
                continue
            ratio = a["sentences_per_s"] / b["sentences_per_s"]
            entry[table] = {"available": True, "ratio": round(ratio, 3), "met": ratio >= goal,
                            "low": round(a["sentences_per_s_min"] / b["sentences_per_s_max"], 3),
                            "high": round(a["sentences_per_s_max"] / b["sentences_per_s_min"], 3)}
        result.append(entry)
    return result


def markdown(section: dict) -> str:
    m = section["model"]
    lines = [
        f"### (c) Translation, Multi30k test_2016_flickr ({section['sentences']} sentences), checkpoint `{section['checkpoint']}`",
        "",
        f"Model: d_model {m['d_model']}, {m['n_heads']} heads, {m['n_encoder_layers']}+{m['n_decoder_layers']} layers, "
        f"{'pre-LN' if m['norm_first'] else 'post-LN'}; Hugging Face runs it as `{section['hf_model']}`. "
        f"{section['threads']} thread(s) for every engine. Each cell: a warm-up pass over every 8th batch (own settings: every 8th "
        f"sentence), then {section['repeats']} timed passes over all sentences; sentences/s is the median with the "
        "min-max of the passes. Load: the 1-minute load average before the cell (\"busy\": another job was running). "
        "\"identical\" = the same output tokens as qkv in the same table and beam.",
        "",
        f"**Same batches**: sentences sorted by source length, cut into {section['same_batches']} batches of at most "
        f"{section['same_batch_sentences']}; every engine translates exactly these batches, one call each, with one length "
        "limit per batch (the largest of qkv's per-sentence limits in it). CTranslate2 runs qkv's search rules "
        "(`qkv.interop.ctranslate2.ct2_translate_ids`, GNMT length penalty); Hugging Face normalises beams by `length ** 0.6`.",
        "",
        *_table(section, "same", settings=False),
        "",
        "**Own settings**: each engine batching its own way (CTranslate2: `translate_batch` with `batch_type=\"tokens\"`, "
        "its own `length ** 0.6` normalisation and one length limit; qkv: `Translator`, `qkv translate --batch-tokens B "
        "--workers N`; for both, the budget and the layout of processes and threads fastest on every 4th sentence in this run). "
        f"`+shortlist`: qkv `--shortlist`; `+vmap`: CTranslate2 `use_vmap=True` with the same table as its vocabulary map "
        f"(k {section['shortlist']['k']}, the {section['shortlist']['frequent']} most frequent pieces, counted on "
        f"{section['shortlist']['pairs']:,} training pairs).",
        "",
        *_table(section, "own", settings=True),
        "",
        "**Targets**: median sentences/s of qkv over the other engine, range over the repeats in brackets.",
        "",
        "| target | goal | same batches | own settings |",
        "|---|---:|---:|---:|",
    ]
    for t in section["targets"]:
        cells = [f"{c['ratio']:.2f}x ({c['low']:.2f}-{c['high']:.2f}) {'met' if c['met'] else 'missed'}"
                 if c["available"] else f"**{c['reason']}**" for c in (t["same"], t["own"])]
        lines.append(f"| {t['target']} | >= {t['goal']:g}x | {cells[0]} | {cells[1]} |")
    noisy = [r for r in section["rows"] if r["busy"]]
    if noisy:
        lines += ["", f"**Warning**: {len(noisy)} of {len(section['rows'])} cells started with another job running "
                      f"(load up to {max(r['load'] for r in noisy):.2f}); their timings are not clean."]
    if section["missing"]:
        lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in section["missing"].items())]
    return "\n".join(lines)


def _table(section: dict, table: str, *, settings: bool) -> list[str]:
    head = "| engine | compute | beam |" + (" settings |" if settings else "") + \
        " sentences/s | min-max | ms/sentence | load | identical to qkv | BLEU |"
    lines = [head, "|---|---|---:|" + ("---|" if settings else "") + "---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in section["rows"] if r["table"] == table):
        lines.append(
            f"| {r['engine']} | {r['compute']} | {r['beam']} |" + (f" {r['settings']} |" if settings else "")
            + f" {r['sentences_per_s']:.1f} | {r['sentences_per_s_min']:.1f}-{r['sentences_per_s_max']:.1f} | "
            f"{r['ms_per_sentence']:.2f} | {r['load']:.2f}{' busy' if r['busy'] else ''} | "
            f"{100 * r['identical_to_qkv']:.1f}% | {r['bleu']:.2f} |")
    return lines
