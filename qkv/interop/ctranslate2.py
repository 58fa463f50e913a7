"""Export a qkv checkpoint to CTranslate2, a C++ inference engine for Transformer models.

The model is described with CTranslate2's own specification classes (``ctranslate2.specs``), so
no converter guesses at qkv's layout: every weight is placed by name below. qkv and CTranslate2
agree on most of the architecture; the details that must be set explicitly are
- pre-LN (``norm_first``) or post-LN, and the final layer norm of each pre-LN stack;
- the positional table, copied as qkv computed it (interleaved or split sines and cosines);
- the embedding scale (sqrt(d_model) or 1), the activation and the layer-norm epsilon;
- the source ends with EOS (``add_source_eos``) and the target starts with BOS.

Decoding differs in one place that cannot be configured: CTranslate2 normalises a beam hypothesis
by ``length ** alpha``, qkv by GNMT's ``((5 + length) / 6) ** alpha``. ``ct2_translate`` therefore
asks CTranslate2 for every finished hypothesis and ranks them with qkv's rule, which makes the two
searches the same algorithm; what remains are floating-point differences between the engines.
ctranslate2 is an optional dependency (the ``export`` extra); importing this module does not need it.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from qkv.errors import MissingPackage, QkvError
from qkv.io import checkpoint
from qkv.infer.search import DecodeConfig, length_penalty, max_output_length
from qkv.model.transformer import Transformer
from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.tokenizer import Tokenizer

# A length penalty this small leaves CTranslate2's scores equal to the raw log-probabilities (to
# ~1e-6 relative) but, unlike 0, turns off its early exit, so it collects beam_size finished
# hypotheses as qkv does (decoding.cc: allow_early_exit only when length_penalty == 0).
_NO_EARLY_EXIT_PENALTY = 1e-6


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise MissingPackage("CTranslate2 (--engine ctranslate2, qkv export) needs the ctranslate2 package, one of qkv's "
                             "requirements: pip install 'ctranslate2>=4.0' (in qkv's clone: pip install -e .)") from None
    return ctranslate2


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """A validated ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights and vocabulary."""
    import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.config
    if cfg.head_dim_k != cfg.head_dim_v:
        raise QkvError(f"CTranslate2 needs d_k == d_v (this model has d_k {cfg.head_dim_k}, d_v {cfg.head_dim_v})")
    if not cfg.share_embeddings and cfg.src_vocab_size != cfg.tgt_vocab_size:
        raise QkvError("qkv exports one joint vocabulary; this model has different source and target vocabularies")
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU, "silu": common_spec.Activation.SWISH}
    head_dim = None if cfg.head_dim_k * cfg.n_heads == cfg.d_model else cfg.head_dim_k
    common = dict(pre_norm=cfg.norm_first, activation=activation[cfg.activation], head_dim=head_dim)
    encoder = transformer_spec.TransformerEncoderSpec(cfg.n_encoder_layers, cfg.n_heads, **common)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.n_decoder_layers, cfg.n_heads, **common)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    w = {name: t.detach().float().cpu().numpy() for name, t in model.state_dict().items()}
    table = model.positions.table.detach().float().cpu().numpy()
    scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
    Hk = cfg.n_heads * cfg.head_dim_k

    def linear(target, prefix: str, rows: slice = slice(None)) -> None:
        target.weight = w[f"{prefix}.weight"][rows]
        if f"{prefix}.bias" in w:
            target.bias = w[f"{prefix}.bias"][rows]

    def norm(target, prefix: str) -> None:
        target.gamma, target.beta = w[f"{prefix}.weight"], w[f"{prefix}.bias"]

    encoder.embeddings[0].weight = w["src_embed.weight"]
    decoder.embeddings.weight = w["tgt_embed.weight"]
    for stack in (encoder, decoder):
        stack.scale_embeddings = scale
        stack.position_encodings.encodings = table
    linear(decoder.projection, "generator")
    if cfg.norm_first:
        norm(encoder.layer_norm, "encoder_norm")
        norm(decoder.layer_norm, "decoder_norm")
    for i, layer in enumerate(encoder.layer):
        p = f"encoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.in_proj")  # fused q, k, v rows: same order
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.attn_sublayer.norm")
        linear(layer.ffn.linear_0, f"{p}.feed_forward.linear1")
        linear(layer.ffn.linear_1, f"{p}.feed_forward.linear2")
        norm(layer.ffn.layer_norm, f"{p}.ff_sublayer.norm")
    for i, layer in enumerate(decoder.layer):
        p = f"decoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.in_proj")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.self_sublayer.norm")
        # Cross-attention: queries from the decoder (first Hk rows), keys and values from the memory.
        linear(layer.attention.linear[0], f"{p}.cross_attn.in_proj", slice(0, Hk))
        linear(layer.attention.linear[1], f"{p}.cross_attn.in_proj", slice(Hk, None))
        linear(layer.attention.linear[2], f"{p}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{p}.cross_sublayer.norm")
        linear(layer.ffn.linear_0, f"{p}.feed_forward.linear1")
        linear(layer.ffn.linear_1, f"{p}.feed_forward.linear2")
        norm(layer.ffn.layer_norm, f"{p}.ff_sublayer.norm")

    vocabulary = tokenizer.pieces(range(tokenizer.vocab_size))
    if len(vocabulary) != cfg.src_vocab_size:
        raise QkvError(f"the tokenizer has {len(vocabulary)} pieces but the model {cfg.src_vocab_size} embeddings")
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    spec.config.unk_token = vocabulary[tokenizer.unk_id]
    spec.config.bos_token = vocabulary[tokenizer.bos_id]
    spec.config.eos_token = vocabulary[tokenizer.eos_id]
    spec.config.decoder_start_token = vocabulary[tokenizer.bos_id]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = True  # qkv's sources end with EOS (qkv.infer.translator.collate_sources)
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.validate()
    return spec


# What an export directory holds (``spec.save`` writes the first ones, then qkv's tokenizer files, then the
# files of a Hugging Face Marian directory); ``--force`` replaces only such a directory.
EXPORT_FILES = frozenset({
    "model.bin", "config.json", "shared_vocabulary.json", "shared_vocabulary.txt", "source_vocabulary.json",
    "target_vocabulary.json", "source_vocabulary.txt", "target_vocabulary.txt", checkpoint.TOKENIZER, "qkv_config.json",
    "source.spm", "target.spm", "model.safetensors", "generation_config.json", "vocab.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vmap.txt",
    "qkv_cache.json",  # an entry of qkv's CTranslate2 cache (qkv.interop.ct2_engine.CACHE_MANIFEST)
})


def is_export_dir(path: Path) -> bool:
    """True for a directory written by ``write_export`` (and nothing else in it)."""
    if path.is_symlink() or not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return "qkv_config.json" in names and names <= EXPORT_FILES and not any((path / n).is_dir() for n in names)


def check_export_out(out: str | Path, *, force: bool) -> Path:
    """Refuse ``out`` unless it is new, empty, or (with ``force``) an earlier export; before any work is done."""
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        if not is_export_dir(out):
            raise QkvError(f"{out} exists and is not an earlier qkv export: refusing to write into it (even with --force)")
        if not force:
            raise QkvError(f"{out} holds an earlier export; pass --force to replace it")
    return out


def write_export(out: Path, checkpoint_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Write an export into ``OUT.tmp/`` (``fill(tmp)``, then the checkpoint's config as ``qkv_config.json``)
    and put it in place of ``out`` only once complete. Call ``check_export_out`` first."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists() or tmp.is_symlink():  # left by a killed export only if it carries qkv's marker
        ours = tmp.is_dir() and not tmp.is_symlink() and ((tmp / checkpoint.MARKER).is_file() or not any(tmp.iterdir()))
        if not ours:
            raise QkvError(f"{tmp} is in the way and qkv did not write it (no {checkpoint.MARKER} marker in it): move it and try again")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / checkpoint.MARKER).write_text("written by qkv while exporting; safe to delete with this directory\n")
        fill(tmp)
        shutil.copyfile(checkpoint_dir / checkpoint.CONFIG, tmp / "qkv_config.json")
        (tmp / checkpoint.MARKER).unlink()
        unknown = sorted(p.name for p in tmp.iterdir() if p.name not in EXPORT_FILES)
        if unknown:  # --force could not replace it later: fail now, naming the file
            raise RuntimeError(f"the export wrote files qkv does not know ({', '.join(unknown)}); please report this")
        if out.exists():  # empty, or an earlier export (checked by check_export_out)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_ctranslate2(checkpoint_dir: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint as a CTranslate2 model directory, with its SentencePiece model(s) beside it
    (``tokenizer.model``, or for an imported Marian model ``source.spm`` and ``target.spm``).

    ``out`` must be new or empty; with ``force`` it may also be an earlier export, which is replaced
    only once the new one is complete. A checkpoint, a run or any other directory is never touched.
    """
    out = check_export_out(out, force=force)
    loaded = checkpoint.load(checkpoint_dir)
    spec = ctranslate2_spec(loaded.model, loaded.tokenizer)

    if (loaded.path / checkpoint.SHORTLIST).is_file():  # CTranslate2's vocabulary map: use_vmap=True uses it
        from qkv.infer import shortlist

        table = shortlist.load(loaded.path / checkpoint.SHORTLIST, src_vocab=loaded.model.config.src_vocab_size,
                               tgt_vocab=loaded.model.config.tgt_vocab_size)
    else:
        table = None

    def fill(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="qkv-vmap-") as where:
            if table is not None:  # spec.save copies the map in as vmap.txt
                write_vmap(table, loaded.tokenizer, Path(where) / "vmap.txt")
                spec.register_vocabulary_mapping(str(Path(where) / "vmap.txt"))
            spec.save(str(tmp))
        if isinstance(loaded.tokenizer, MarianTokenizer):
            (tmp / "source.spm").write_bytes(loaded.tokenizer.source_spm)
            (tmp / "target.spm").write_bytes(loaded.tokenizer.target_spm)
        else:
            loaded.tokenizer.save(tmp / checkpoint.TOKENIZER)

    return write_export(out, loaded.path, fill)


def write_vmap(table, tokenizer: Tokenizer, path: Path) -> None:
    """A shortlist as CTranslate2's vocabulary map: a line "<source piece>\t<target pieces>" per source
    piece, and one with an empty source for the pieces always allowed. CTranslate2 decodes a batch
    over the union of its sentences' candidates (qkv: each sentence over its own)."""
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    lines = ["\t" + " ".join(pieces[i] for i in table.frequent.tolist())]
    for s, row in enumerate(table.table.tolist()):
        targets = [pieces[t] for t in row if t >= 0]
        if targets:
            lines.append(pieces[s] + "\t" + " ".join(targets))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _piece_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Each piece's id, for reading CTranslate2's output: made once per tokenizer (a server calls
    ``ct2_translate_ids`` once a batch; the vocabulary's pieces cost about a millisecond a thousand)."""
    return {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}


def ct2_translate_ids(
    translator: Any, tokenizer: Tokenizer, src_ids: list[list[int]], config: DecodeConfig,
    *, max_len: int, max_batch_size: int = 64, max_tokens: int | None = None, use_vmap: bool = False,
) -> list[list[int]]:
    """Translate with a ``ctranslate2.Translator`` under qkv's search rules with ``stop_early`` (CTranslate2
    stops a sentence at beam_size finished hypotheses); token ids without BOS/EOS.

    Sentences are grouped by their maximum output length (``max_len_a * (length + 1) + max_len_b``,
    as in qkv.infer.search), since CTranslate2 takes one limit per call. For beam search the beam_size
    finished hypotheses are re-ranked with GNMT's length penalty, exactly as qkv ranks them.
    ``max_len`` is the model's ``ModelConfig.max_len``.

    With ``max_tokens``, throughput instead: one call, CTranslate2 batching by source tokens (at most
    ``max_tokens`` a batch) under the longest limit, each output then cut to its own sentence's limit
    (the same output where a search ends before its limit, as nearly every one does).

    ``config.no_repeat_ngram_size`` is CTranslate2's own; ``use_vmap``: search over the export's vocabulary
    map (``vmap.txt``, written from a checkpoint's shortlist), as ``--shortlist`` searches qkv's.
    """
    limits_of = SimpleNamespace(config=SimpleNamespace(max_len=max_len))  # all max_output_length reads

    eos_piece = tokenizer.pieces([tokenizer.eos_id])[0]
    piece_to_id = _piece_ids(tokenizer)
    results: list[list[int]] = [[] for _ in src_ids]
    groups: dict[int, list[int]] = {}
    limit_of = {i: max_output_length(limits_of, len(ids) + 1, config) for i, ids in enumerate(src_ids) if ids}
    for i, limit in limit_of.items():
        groups.setdefault(limit, []).append(i)
    if max_tokens is not None and groups:
        groups = {max(groups): sorted(limit_of)}
    beam = config.beam_size
    batching = {"max_batch_size": max_batch_size} if max_tokens is None else {"max_batch_size": max_tokens, "batch_type": "tokens"}
    for limit, indices in sorted(groups.items()):
        outputs = translator.translate_batch(
            [tokenizer.pieces(src_ids[i]) for i in indices],
            **batching,
            beam_size=beam,
            num_hypotheses=beam if beam > 1 else 1,
            length_penalty=_NO_EARLY_EXIT_PENALTY if beam > 1 else 0.0,
            max_decoding_length=limit,
            min_decoding_length=0,
            return_end_token=True,
            return_scores=beam > 1,
            no_repeat_ngram_size=config.no_repeat_ngram_size,
            use_vmap=use_vmap,
        )
        for i, out in zip(indices, outputs):
            best, best_score = None, -math.inf
            for h, hyp in enumerate(out.hypotheses):
                if beam > 1:
                    # len(hyp) counts the EOS (return_end_token), as qkv's length does.
                    raw = out.scores[h] * len(hyp) ** _NO_EARLY_EXIT_PENALTY
                    score = raw / length_penalty(len(hyp), config.length_penalty)
                else:
                    score = 0.0
                if best is None or score > best_score:
                    best, best_score = hyp, score
            tokens = list(best)
            if tokens and tokens[-1] == eos_piece:
                tokens = tokens[:-1]
            results[i] = [piece_to_id[p] for p in tokens][: limit_of[i]]
    return results


@dataclass
class ParityReport:
    n: int
    beam_size: int
    identical: int
    qkv_seconds: float
    ct2_seconds: float
    examples: list[tuple[str, str, str]]  # (source, qkv, ctranslate2) for the first differences

    @property
    def rate(self) -> float:
        return self.identical / max(self.n, 1)


def parity_check(
    checkpoint_dir: str | Path, ct2_dir: str | Path, sources: list[str], *, beam_size: int,
    length_penalty_alpha: float = 0.6, threads: int = 0,
) -> ParityReport:
    """Translate ``sources`` with qkv and with the exported CTranslate2 model; count identical outputs."""
    ct2 = import_ctranslate2()
    from qkv.infer.translator import Translator

    loaded = checkpoint.load(checkpoint_dir)
    config = DecodeConfig(beam_size=beam_size, length_penalty=length_penalty_alpha, stop_early=True)  # CTranslate2's rule
    translator = Translator(loaded.model, loaded.tokenizer, config)
    ids = [translator.encode(s) for s in sources]
    started = time.perf_counter()
    ours = [h[0].tokens for h in translator.translate_ids(ids)]
    qkv_seconds = time.perf_counter() - started
    engine = ct2.Translator(str(ct2_dir), device="cpu", intra_threads=threads or torch.get_num_threads())
    started = time.perf_counter()
    theirs = ct2_translate_ids(engine, loaded.tokenizer, ids, config, max_len=loaded.model.config.max_len)
    ct2_seconds = time.perf_counter() - started
    tok = loaded.tokenizer
    diffs = [(s, tok.decode(a), tok.decode(b)) for s, a, b in zip(sources, ours, theirs) if a != b]
    return ParityReport(len(sources), beam_size, len(sources) - len(diffs), qkv_seconds, ct2_seconds, diffs[:3])
