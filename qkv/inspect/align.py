"""Word alignments for whole files, in the Pharaoh format ("0-0 1-2 ..."), and their error rate.

For each line pair the target (a given reference, or the model's own translation) is read by the
decoder in one teacher-forced pass, and a reading of the chosen decoder layer aligns each target word
with the source word that scores highest (``align_words``: subword pieces merged into words). The
readings (``METHODS``; ``qkv.inspect.contributions``):

- ``attention``: the cross-attention weights (one head, or the mean of the heads);
- ``norm``: the norms of what each source token adds, ||sum_h alpha_ij f(x_j)|| (Kobayashi et al., 2020);
- ``alti``: ALTI+'s share of each source token, rolled out through the encoder and decoder.

``link`` says which side chooses: ``target``, each target word linked with the source word it scores
highest (``align_words``), or ``source``, each source word linked with the target word that scores it
highest (``align_source_words``), the same weights read the other way. A model trained with guided
alignment is read at its head from the source side by default: on the En-De gold set of Multi30k val
(benchmarks/gold/multi30k-val.en-de), AER 14.5 against 20.7 from the target side for a causal head,
10.0 against 14.5 for a full-context one (docs/translation.md); any other model from the target side,
as it was chosen.

``row`` says where a target word is read: ``predict``, the decoder position that predicts it (what the
pictures show), or ``input``, the position where it is the decoder's input (Shift-Att, Chen et al.,
2020), which the literature found better on 6-layer models of large corpora; on qkv's Multi30k models it
is far worse (docs/translation.md). Pharaoh pairs are
"source-target" word indices, 0-based, in whitespace-separated words of the detokenized text; with
``pieces=True`` they are indices of the SentencePiece pieces instead (EOS left out).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from qkv.errors import QkvError
from qkv.data.corpus import collate
from qkv.data.lines import lines
from qkv.infer.search import DecodeConfig
from qkv.model.transformer import Transformer
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import Translator, length_batches
from qkv.inspect.contributions import contributions, reading
from qkv.inspect.visualize import align_source_words, align_words, word_weights

METHODS = ("attention", "norm", "alti")
ROWS = ("input", "predict")
LINKS = ("target", "source")
# The default reading: value norms where the word is predicted, at the middle decoder layer (layer
# n // 2, 1-based, of n), chosen on the En-De gold set of Multi30k val (benchmarks/gold/multi30k-val.en-de:
# AER 25.5 against 39.9 for the last layer's weights; docs/translation.md gives every method, reading and layer).
DEFAULT_METHOD, DEFAULT_ROW = "norm", "predict"


def default_layer(n_layers: int) -> int:
    """The default decoder layer, a 0-based index: the middle one (layer n // 2 of n, 1-based)."""
    return max(0, n_layers // 2 - 1)


def default_link(config) -> str:
    """The side that chooses the links when none is asked for (module docstring): ``source`` for a model
    trained with guided alignment, ``target`` for any other."""
    return "source" if config.alignment_layer is not None else "target"


def default_reading(config) -> tuple[str, int, int | None]:
    """(method, layer, head) read when none is asked for: a model trained with guided alignment
    (``ModelConfig.alignment_layer``; qkv.train.alignment) is read at its alignment head, the first head's
    weights of that layer; any other model by value norms at ``default_layer``, the mean of the heads."""
    if config.alignment_layer is not None:
        return "attention", config.alignment_layer, 0
    return DEFAULT_METHOD, default_layer(config.n_decoder_layers), None


@torch.inference_mode()
def align(
    model: Transformer, tokenizer: TextTokenizer, sources: list[str], targets: list[str] | None = None, *,
    layer: int | None = None, head: int | None = None, config: DecodeConfig | None = None, max_tokens: int = 4096,
    pieces: bool = False, method: str | None = None, row: str = DEFAULT_ROW, link: str | None = None, encode=None,
) -> list[list[tuple[int, int]]]:
    """Pharaoh pairs (source word, target word) for each line, in input order.

    ``targets`` None: align each source with the model's own translation (searched with ``config``).
    ``method``: one of ``METHODS``, or None for the model's default reading (``default_reading``: its
    alignment head when it was trained with one; then ``layer`` and ``head`` default to that head's);
    ``row``: ``input`` or ``predict``; ``link``: ``target`` or ``source``, None for ``default_link`` (module docstring).
    ``layer``: a Python index over the decoder layers (None: ``default_layer``); ``head``: one head, 0-based, or None for the mean over heads (``attention``
    and ``norm`` only). ``pieces``: pairs of piece indices (``tokenizer.pieces`` of the encoded
    source and target, EOS left out) instead of words. An empty source or target gives no pairs.
    ``encode``: in place of ``model.encode`` (``qkv.infer.encodings.Encodings.encode``: the encoder
    outputs of the search that made the targets).
    """
    if method is None:
        method, default_at, default_head = default_reading(model.config)
        if method == "attention" and layer is None and head is None:  # the alignment head itself
            layer, head = default_at, default_head
    if method not in METHODS:
        raise QkvError(f"unknown alignment method {method!r}: one of {', '.join(METHODS)}")
    if row not in ROWS:
        raise QkvError(f"unknown reading {row!r}: input or predict")
    link = default_link(model.config) if link is None else link
    if link not in LINKS:
        raise QkvError(f"unknown link side {link!r}: target or source")
    if head is not None and method == "alti":
        raise QkvError("ALTI+ rolls out every head together: --head goes with --method attention or norm")
    n_layers = len(model.decoder_layers)
    layer = default_layer(n_layers) if layer is None else layer
    if not -n_layers <= layer < n_layers:
        raise QkvError(f"layer {layer} is outside the decoder's {n_layers} layers")
    model.eval()
    translator = Translator(model, tokenizer, config or DecodeConfig())
    src_ids = [translator.encode(s) for s in sources]  # cut to the model's positions, with a warning
    if targets is None:
        tgt_ids = [h[0].tokens for h in translator.translate_ids(src_ids)]
    else:
        if len(targets) != len(sources):
            raise QkvError(f"{len(sources)} sources but {len(targets)} targets: align needs one target per source")
        limit = model.config.max_len - 1  # room for the EOS
        tgt_ids = [tokenizer.encode_target(t) for t in targets]  # a Marian tokenizer has a target model of its own
        if any(len(ids) > limit for ids in tgt_ids):
            warnings.warn(f"a target longer than the model's {limit} positions was cut to fit; its words past them are not aligned", stacklevel=2)
        tgt_ids = [ids[:limit] for ids in tgt_ids]
    results: list[list[tuple[int, int]]] = [[] for _ in sources]
    for i, w, src_pieces, tgt_pieces in _piece_weights(model, tokenizer, src_ids, tgt_ids, method, layer, head, row, max_tokens,
                                                       encode):
        if pieces and link == "target":  # each target piece with the source piece it attends to most, EOS on neither side
            best = w[:-1, :-1].argmax(dim=1).tolist()  # (T-1,)
            results[i] = [(s, t) for t, s in enumerate(best)]
        elif pieces:  # each source piece with the target piece that attends to it most
            best = w[:-1, :-1].argmax(dim=0).tolist()  # (S-1,)
            results[i] = list(enumerate(best))  # (source, target), in source order
        elif link == "target":
            results[i] = [(s, t) for s, t, _ in align_words(w, src_pieces, tgt_pieces)]
        else:
            results[i] = [(s, t) for s, t, _ in align_source_words(w, src_pieces, tgt_pieces)]  # in source order
    return results


def _piece_weights(model: Transformer, tokenizer: TextTokenizer, src_ids: list[list[int]], tgt_ids: list[list[int]],
                   method: str, layer: int, head: int | None, row: str, max_tokens: int, encode=None):
    """(index, (T, S) weights of the pair's pieces with EOS, source pieces, target pieces) for each pair
    with both sides non-empty, read in batches of similar length."""
    todo = [i for i in range(len(src_ids)) if src_ids[i] and tgt_ids[i]]
    device = next(model.parameters()).device
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) for i in todo]
    for batch in length_batches(lengths, max_tokens=max_tokens, max_sentences=256):
        indices = [todo[j] for j in batch]
        src, tgt_in, _ = (t.to(device) for t in collate(
            [src_ids[i] for i in indices], [tgt_ids[i] for i in indices],
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        ))  # (B, S), (B, T)
        cross = _scores(model, src, tgt_in, method, layer, head, encode or model.encode)  # (B, T, S)
        if row == "input":  # target piece t is the input at position t + 1; EOS's row (unused) zero
            cross = torch.cat([cross[:, 1:], torch.zeros_like(cross[:, :1])], dim=1)
        for b, i in enumerate(indices):
            src_pieces = tokenizer.pieces([*src_ids[i], tokenizer.eos_id])
            tgt_pieces = tokenizer.pieces([*tgt_ids[i], tokenizer.eos_id])
            yield i, cross[b, : len(tgt_pieces), : len(src_pieces)], src_pieces, tgt_pieces  # without padding


@torch.inference_mode()
def word_weight_matrices(model: Transformer, tokenizer: TextTokenizer, sources: list[str], targets: list[str], *,
                         max_tokens: int = 4096, encode=None) -> list[torch.Tensor]:
    """(target words, source words) weights of each pair, read as ``align`` reads the model by default
    (its alignment head where it was trained with one; ``default_reading``) and merged into the words
    of the detokenized text as ``word_weights`` merges them. An empty side gives an empty matrix.
    What a document's markup is placed by (``qkv.document.placement``). ``encode``: in place of
    ``model.encode`` (the document layer passes the encoder outputs its search already computed)."""
    if len(targets) != len(sources):
        raise QkvError(f"{len(sources)} sources but {len(targets)} targets: one target per source")
    method, layer, head = default_reading(model.config)
    model.eval()
    limit = model.config.max_len - 1
    src_ids = [tokenizer.encode(s)[:limit] for s in sources]
    tgt_ids = [tokenizer.encode_target(t)[:limit] for t in targets]
    out = [torch.zeros(len(t.split()), len(s.split())) for s, t in zip(sources, targets)]
    for i, w, src_pieces, tgt_pieces in _piece_weights(model, tokenizer, src_ids, tgt_ids, method, layer, head, DEFAULT_ROW,
                                                       max_tokens, encode):
        out[i] = word_weights(w, src_pieces, tgt_pieces).cpu()
    return out


def _scores(model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor, method: str, layer: int, head: int | None,
            encode) -> torch.Tensor:
    """(B, T, S) source scores of each target position: src (B, S), tgt_in (B, T); ``encode``: the
    model's encoder (or outputs it already computed for these sentences)."""
    if method == "attention" and head == 0 and model.config.alignment_context == "full" and \
            layer % len(model.decoder_layers) == model.config.alignment_layer:  # a full-context head: its own pass
        memory, src_mask, _ = encode(src)
        return model.alignment_head(tgt_in, memory, src_mask).float()
    if method == "attention":  # the plain pass: no decomposition needed
        memory, src_mask, _ = encode(src)
        _, weights = model.decode_hidden(tgt_in, memory, src_mask, need_weights=True)  # no logits needed
        cross = weights.cross[layer].float()  # (B, H, T, S)
        return cross.mean(dim=1) if head is None else cross[:, head]
    found = contributions(model, src, tgt_in, alti=method == "alti")  # value norms need no rollout
    if head is not None:  # method "norm": one head's alpha ||f(x)||
        return found.head_norms[layer][:, head].float()
    return reading(found, method, layer).float()


def read_gold(path: str | Path) -> list[tuple[set[tuple[int, int]], set[tuple[int, int]]]]:
    """A gold alignment file: one line a pair, ``i-j`` sure and ``ipj`` possible links, 1-based, source
    index first (the Hansards format). Returns (sure, possible) sets of 0-based pairs, possible including sure.
    Read as every corpus is (``qkv.data.lines``): UTF-8, split on ``\n`` only, a blank line a pair without links."""
    gold = []
    for n, line in enumerate(lines(path), 1):
        sure, possible = set(), set()
        for link in line.split():
            kind = "p" if "p" in link else "-"
            shown = repr(link) if len(link) <= 40 else repr(link[:40]) + "..."
            parts = link.split(kind)
            if len(parts) != 2 or not all(x.isascii() and x.isdigit() and len(x) <= 9 for x in parts):
                raise QkvError(f"{path}, line {n}: {shown} is not a link i-j or ipj (1-based word indices)")
            i, j = int(parts[0]), int(parts[1])
            if i < 1 or j < 1:
                raise QkvError(f"{path}, line {n}: {shown}: indices are 1-based")
            possible.add((i - 1, j - 1))
            if kind == "-":
                sure.add((i - 1, j - 1))
        gold.append((sure, possible))
    return gold


def check_gold(gold: list[tuple[set, set]], sources: list[str], targets: list[str], name: str) -> None:
    """Refuse a gold link outside its pair's words: it could never be found, and would only raise the AER."""
    for n, ((_, possible), source, target) in enumerate(zip(gold, sources, targets), 1):
        n_src, n_tgt = len(source.split()), len(target.split())
        for i, j in sorted(possible):
            if i >= n_src or j >= n_tgt:
                raise QkvError(f"{name}, line {n}: link {i + 1}-{j + 1} is outside the pair's {n_src} source and "
                               f"{n_tgt} target words")


def alignment_error_rate(predicted: list[list[tuple[int, int]]], gold: list[tuple[set, set]]) -> dict[str, float]:
    """AER = 1 - (|A & S| + |A & P|) / (|A| + |S|) over a corpus (Och and Ney, 2003), with precision
    against P and recall against S; ``predicted`` and ``gold`` line by line, 0-based (source, target)."""
    if len(predicted) != len(gold):
        raise QkvError(f"{len(predicted)} alignments but {len(gold)} gold lines")
    a = s = a_s = a_p = 0
    for pairs, (sure, possible) in zip(predicted, gold):
        found = set(pairs)
        a, s = a + len(found), s + len(sure)
        a_s, a_p = a_s + len(found & sure), a_p + len(found & possible)
    return {
        "aer": 1 - (a_s + a_p) / (a + s) if a + s else 0.0,
        "precision": a_p / a if a else 0.0,
        "recall": a_s / s if s else 0.0,
    }


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    return " ".join(f"{s}-{t}" for s, t in pairs)
