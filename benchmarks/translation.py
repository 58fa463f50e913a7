"""(c) Translation throughput on Multi30k test_2016_flickr: qkv, Hugging Face generate and CTranslate2
running the same weights, greedy and beam 5, and how often their outputs are identical to qkv's.

- qkv: ``Translator`` with its defaults (length-sorted batches of <= 2048 source tokens, KV cache,
  finished sentences dropped from the batch), GNMT length penalty 0.6.
- Hugging Face: ``qkv.convert.to_huggingface`` (``MarianMTModel`` for a post-LN model, Pegasus, its
  pre-LN sibling, for a pre-LN one), ``generate`` with ``num_beams``, ``early_stopping=True`` (stop at
  beam-size finished hypotheses, as qkv) and ``length_penalty=0.6``; note Hugging Face divides by
  ``length ** 0.6`` where qkv uses GNMT's ``((5 + length) / 6) ** 0.6``.
- CTranslate2: the ``qkv export`` model through ``qkv.export.ct2_translate_ids`` (qkv's rules), and
  once more left to itself ("native": one call, its own batching, ``length ** 0.6`` normalisation).
Hugging Face and CTranslate2 take one length limit per call, so both get sentences grouped by
qkv's per-sentence limit (``1.5 * source length + 10``), in batches of at most 64.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from qkv import checkpoint
from qkv.convert import to_huggingface
from qkv.data import load_multi30k
from qkv.decode import DecodeConfig, max_output_length
from qkv.evaluate import score
from qkv.export import ct2_translate_ids, ctranslate2_spec
from qkv.translate import Translator


def _hf_translate(hf, tok, model, src_ids: list[list[int]], config: DecodeConfig, batch: int = 64) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(src_ids):
        groups.setdefault(max_output_length(model, len(ids) + 1, config), []).append(i)
    out: list[list[int]] = [[] for _ in src_ids]
    for limit, indices in groups.items():
        for start in range(0, len(indices), batch):
            chunk = indices[start : start + batch]
            S = max(len(src_ids[i]) for i in chunk) + 1
            src = torch.full((len(chunk), S), tok.pad_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                src[row, : len(src_ids[i]) + 1] = torch.tensor([*src_ids[i], tok.eos_id])
            with torch.inference_mode():
                beam = {"early_stopping": True, "length_penalty": config.length_penalty} if config.beam_size > 1 else {}
                generated = hf.generate(
                    input_ids=src, attention_mask=(src != tok.pad_id).long(), max_new_tokens=limit,
                    num_beams=config.beam_size, do_sample=False, min_new_tokens=0, **beam,
                )
            for row, i in enumerate(chunk):
                tokens = generated[row, 1:].tolist()  # drop the decoder start (BOS)
                if tok.eos_id in tokens:
                    tokens = tokens[: tokens.index(tok.eos_id)]
                out[i] = [t for t in tokens if t != tok.pad_id]
    return out


def _ct2_native(engine, tok, model, src_ids: list[list[int]], config: DecodeConfig) -> list[list[int]]:
    """CTranslate2 left to itself: one call, its own length-sorted batches of 64, its own length
    normalisation (``length ** 0.6``) and early exit, and the longest limit of the set for all."""
    limit = max(max_output_length(model, len(ids) + 1, config) for ids in src_ids)
    piece_to_id = {p: i for i, p in enumerate(tok.pieces(range(tok.vocab_size)))}
    outputs = engine.translate_batch(
        [tok.pieces(ids) for ids in src_ids], max_batch_size=64, beam_size=config.beam_size,
        length_penalty=config.length_penalty, max_decoding_length=limit, min_decoding_length=0,
    )
    return [[piece_to_id[p] for p in out.hypotheses[0]] for out in outputs]


def run(*, checkpoint_dir: str, data_dir: str, smoke: bool, threads: int, log) -> dict:
    loaded = checkpoint.load(checkpoint_dir)
    model, tok = loaded.model, loaded.tokenizer
    data = loaded.config.get("data", {})
    corpus = load_multi30k("test_2016_flickr", data.get("src_lang", "en"), data.get("tgt_lang", "de"), data_dir)
    n = 40 if smoke else len(corpus.src)
    sources, references = corpus.src[:n], corpus.tgt[:n]
    missing = {}
    try:
        hf = to_huggingface(model, bos_id=tok.bos_id, eos_id=tok.eos_id)
    except RuntimeError as error:  # transformers is not installed
        hf, missing["huggingface"] = None, str(error)
    try:
        import ctranslate2

        ct2_dir = Path(tempfile.mkdtemp(prefix="qkv-bench-ct2-"))
        ctranslate2_spec(model, tok).save(str(ct2_dir))
        engine = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=threads)
    except ImportError as error:
        engine, missing["ctranslate2"] = None, str(error)
    for name, reason in missing.items():
        log(f"translation: {name} skipped ({reason})")
    rows = []
    for beam in (1, 5):
        config = DecodeConfig(beam_size=beam)
        translator = Translator(model, tok, config)
        ids = [translator.encode(s) for s in sources]
        runners = {
            "qkv": lambda x: [h[0].tokens for h in translator.translate_ids(x)],
            "huggingface": lambda x: _hf_translate(hf, tok, model, x, config),
            "ctranslate2": lambda x: ct2_translate_ids(engine, tok, x, config, max_len=model.config.max_len),
            "ctranslate2_native": lambda x: _ct2_native(engine, tok, model, x, config),
        }
        runners = {name: fn for name, fn in runners.items() if name.split("_")[0] not in missing}
        for fn in runners.values():
            fn(ids[:8])  # warm-up
        outputs = {}
        for name, fn in runners.items():
            start = time.perf_counter()
            outputs[name] = fn(ids)
            seconds = time.perf_counter() - start
            hyps = [tok.decode(t) for t in outputs[name]]
            same = sum(a == b for a, b in zip(outputs[name], outputs["qkv"]))
            row = {"engine": name, "beam": beam, "sentences": n, "seconds": round(seconds, 3),
                   "sentences_per_s": round(n / seconds, 2), "ms_per_sentence": round(1e3 * seconds / n, 2),
                   "identical_to_qkv": round(same / n, 4), "bleu": score(hyps, references)["bleu"]}
            rows.append(row)
            log(f"translation {name} beam {beam}: {row}")
    if engine is not None:
        del engine
        shutil.rmtree(ct2_dir, ignore_errors=True)
    hf_family = type(hf).__name__ if hf is not None else None
    return {"checkpoint": str(loaded.path), "hf_model": hf_family, "sentences": n, "rows": rows, "missing": missing,
            "model": {k: getattr(model.config, k) for k in ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "norm_first")}}


def markdown(section: dict) -> str:
    m = section["model"]
    lines = [
        f"### (c) Translation, Multi30k test_2016_flickr ({section['sentences']} sentences), checkpoint `{section['checkpoint']}`",
        "",
        f"Model: d_model {m['d_model']}, {m['n_heads']} heads, {m['n_encoder_layers']}+{m['n_decoder_layers']} layers, "
        f"{'pre-LN' if m['norm_first'] else 'post-LN'}; Hugging Face runs it as `{section['hf_model']}`. "
        "\"identical\" = same output tokens as qkv. `ctranslate2` runs qkv's search rules "
        "(`qkv.export.ct2_translate_ids`: per-sentence length limits, GNMT length penalty); `ctranslate2_native` is "
        "CTranslate2's own `translate_batch` (its batching, `length ** 0.6` normalisation, one length limit). "
        "Hugging Face's beam search normalises by `length ** 0.6` too.",
        "",
        "| engine | beam | sentences/s | ms/sentence | identical to qkv | BLEU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in section["rows"]:
        lines.append(f"| {r['engine']} | {r['beam']} | {r['sentences_per_s']:.1f} | {r['ms_per_sentence']:.1f} | "
                     f"{100 * r['identical_to_qkv']:.1f}% | {r['bleu']:.2f} |")
    return "\n".join(lines)
