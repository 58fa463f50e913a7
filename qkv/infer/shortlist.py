"""Vocabulary shortlists: decode each sentence over the target pieces its source makes likely, not all of them.

For a small model the output layer is most of a decoder step (d_model 128, 4 decoder layers, d_ff 256,
8,000 pieces: about 60% of its multiply-adds), and the log-softmax and top-k that follow it are over
the whole vocabulary too. A shortlist is a table built once from parallel text:

    frequent   the F most frequent target pieces (and EOS), allowed in every sentence
    table      for each source piece, the k target pieces that co-occur with it most strongly in the
               same sentence pairs, by the Dice coefficient 2 c(s, t) / (c(s) + c(t)), where c counts
               the sentence pairs holding a piece (Marian's and the Bergamot students' lexical
               shortlists use alignment probabilities; co-occurrence needs no aligner)

and each sentence is decoded over ``frequent`` and the table rows of the pieces in its source
(``qkv.model.transformer.OutputSubset``): the output projection, log-softmax and top-k run over those
ids only. A sentence's list depends on the sentence alone, so its translation does not depend on
the batch it is searched in. The result is an approximation of the exact search: a translation
changes when the exact one needs a piece outside the list, or when the probability left outside
the list reorders the beams. Its BLEU cost and the translations it changes are measured (docs/benchmarks.md).

``qkv shortlist`` builds one and stores it in a checkpoint as ``shortlist.safetensors``, under the
manifest; ``qkv translate/evaluate --shortlist`` decode with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from qkv.errors import QkvError

DEFAULT_K = 20
DEFAULT_FREQUENT = 200


@dataclass
class Shortlist:
    """``frequent`` (F,) int64 target ids; ``table`` (V_src, k) int32 target ids per source piece, -1 padded."""

    frequent: Tensor
    table: Tensor
    info: dict

    @property
    def k(self) -> int:
        return self.table.size(1)

    def vocab(self, src_ids: Sequence[Sequence[int]]) -> list[Tensor]:
        """For each source, the sorted target ids it may produce: ``frequent`` and its pieces' rows."""
        result = []
        for ids in src_ids:
            pieces = torch.tensor([p for p in set(ids) if 0 <= p < self.table.size(0)], dtype=torch.long)
            rows = self.table[pieces].flatten().long()  # (P * k,)
            result.append(torch.cat([self.frequent, rows[rows >= 0]]).unique())  # sorted
        return result


def _pair_keys(src: list[list[int]], tgt: list[list[int]], src_vocab: int, tgt_vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a chunk of sentence pairs: the (source piece, target piece) keys of every pair of pieces
    that share a sentence pair (each piece once per sentence), and each side's distinct pieces."""
    def distinct(sentences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        flat = np.fromiter((p for s in sentences for p in s), dtype=np.int64, count=int(lengths.sum()))
        sentence = np.repeat(np.arange(len(sentences), dtype=np.int64), lengths)
        key = np.unique(sentence * (1 << 32) + (flat & 0xFFFFFFFF))  # sorted by sentence, each piece once
        return key >> 32, key & 0xFFFFFFFF  # a negative id comes back >= 2**31: refused below

    s_sent, s_piece = distinct(src)
    t_sent, t_piece = distinct(tgt)
    for side, pieces, size in (("source", s_piece, src_vocab), ("target", t_piece, tgt_vocab)):
        if len(pieces) and (pieces.min() < 0 or pieces.max() >= size):
            raise QkvError(f"a {side} sentence holds ids outside its vocabulary of {size}")
    n = len(src)
    t_count = np.bincount(t_sent, minlength=n)  # distinct target pieces per sentence
    t_start = np.concatenate([[0], np.cumsum(t_count)[:-1]])
    repeats = t_count[s_sent]  # each source piece meets every target piece of its sentence
    total = int(repeats.sum())
    first = np.repeat(t_start[s_sent] - np.concatenate([[0], np.cumsum(repeats)[:-1]]), repeats)
    t_index = first + np.arange(total, dtype=np.int64)
    keys = np.repeat(s_piece, repeats) * tgt_vocab + t_piece[t_index]
    return keys, s_piece, t_piece


def build(
    pairs: Iterable[tuple[list[int], list[int]]], *, src_vocab: int, tgt_vocab: int, k: int = DEFAULT_K,
    frequent: int = DEFAULT_FREQUENT, always: Sequence[int] = (), chunk: int = 50_000, max_len: int | None = None,
    max_keys: int = 1 << 22,
) -> Shortlist:
    """A shortlist from sentence pairs of piece ids (without BOS/EOS). ``always``: ids added to ``frequent`` (EOS).
    ``max_len``: each side cut to this many pieces, as training cut them (None: whole). Pairs are counted
    ``chunk`` at a time, and sooner when their pairs of pieces reach ``max_keys``: a pair of sides of
    L pieces makes up to L^2 of them, so memory follows ``max_keys``, never the longest line."""
    if k < 1 or frequent < 0:
        raise QkvError(f"a shortlist needs k >= 1 and frequent >= 0 (got k={k}, frequent={frequent})")
    pair_keys: list[np.ndarray] = []  # (key, count) merged chunk by chunk
    pair_counts: list[np.ndarray] = []
    src_df = np.zeros(src_vocab, dtype=np.int64)
    tgt_df = np.zeros(tgt_vocab, dtype=np.int64)
    tgt_tokens = np.zeros(tgt_vocab, dtype=np.int64)
    n_pairs = 0

    def flush(src: list[list[int]], tgt: list[list[int]]) -> None:
        keys, s_piece, t_piece = _pair_keys(src, tgt, src_vocab, tgt_vocab)
        src_df[:] += np.bincount(s_piece, minlength=src_vocab)
        tgt_df[:] += np.bincount(t_piece, minlength=tgt_vocab)
        tgt_tokens[:] += np.bincount(np.fromiter((p for t in tgt for p in t), dtype=np.int64), minlength=tgt_vocab)
        unique, counts = np.unique(keys, return_counts=True)
        pair_keys.append(unique)
        pair_counts.append(counts)
        if len(pair_keys) > 8:  # merge, so memory follows the distinct pairs, not the corpus
            merged, inverse = np.unique(np.concatenate(pair_keys), return_inverse=True)
            pair_counts[:] = [np.bincount(inverse, weights=np.concatenate(pair_counts)).astype(np.int64)]
            pair_keys[:] = [merged]

    src_chunk: list[list[int]] = []
    tgt_chunk: list[list[int]] = []
    work = 0  # pairs of pieces in the chunk, at most
    for src, tgt in pairs:
        src_chunk.append(list(map(int, src[:max_len])))
        tgt_chunk.append(list(map(int, tgt[:max_len])))
        n_pairs += 1
        work += len(src_chunk[-1]) * len(tgt_chunk[-1])
        if len(src_chunk) >= chunk or work >= max_keys:
            flush(src_chunk, tgt_chunk)
            src_chunk, tgt_chunk, work = [], [], 0
    if src_chunk:
        flush(src_chunk, tgt_chunk)
    if not n_pairs:
        raise QkvError("a shortlist needs sentence pairs: none were given")

    keys = np.concatenate(pair_keys)
    merged, inverse = np.unique(keys, return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate(pair_counts))
    s, t = merged // tgt_vocab, merged % tgt_vocab
    dice = 2 * counts / (src_df[s] + tgt_df[t])
    order = np.lexsort((t, -dice, s))  # by source piece, the strongest first (ties: the lower id)
    s_sorted = s[order]
    group_start = np.searchsorted(s_sorted, s_sorted, side="left")
    rank = np.arange(len(order)) - group_start
    keep = order[rank < k]
    table = np.full((src_vocab, k), -1, dtype=np.int32)
    kept_s = s[keep]
    table[kept_s, rank[rank < k]] = t[keep]

    by_count = np.lexsort((np.arange(tgt_vocab), -tgt_tokens))  # the most frequent first, ties by id
    top = [int(i) for i in by_count[:frequent] if tgt_tokens[i] > 0]
    frequent_ids = torch.tensor(sorted(set(top) | set(always)), dtype=torch.long)
    info = {"k": k, "frequent": frequent, "pairs": n_pairs, "score": "dice", "src_vocab": src_vocab, "tgt_vocab": tgt_vocab}
    return Shortlist(frequent_ids, torch.from_numpy(table), info)


def save(shortlist: Shortlist, path: str | Path) -> None:
    save_file({"frequent": shortlist.frequent.contiguous(), "table": shortlist.table.contiguous()}, str(path),
              metadata={"qkv": json.dumps(shortlist.info, sort_keys=True)})


def load(path: str | Path, *, src_vocab: int, tgt_vocab: int) -> Shortlist:
    """Read a shortlist and check it against the model's vocabularies (ids out of range are refused)."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as handle:  # one read: the tensors and the metadata
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            info = json.loads((handle.metadata() or {}).get("qkv", "{}"))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise QkvError(f"{path} cannot be read as a shortlist ({error})") from None
    frequent, table = tensors.get("frequent"), tensors.get("table")
    if frequent is None or table is None or frequent.dim() != 1 or table.dim() != 2:
        raise QkvError(f"{path} is not a qkv shortlist (it needs a 1-d 'frequent' and a 2-d 'table')")
    if table.size(0) != src_vocab:
        raise QkvError(f"{path} has rows for {table.size(0)} source pieces; the model has {src_vocab}")
    for name, ids in (("frequent", frequent), ("table", table)):
        if ids.numel() and (int(ids.max()) >= tgt_vocab or int(ids.min()) < (0 if name == "frequent" else -1)):
            raise QkvError(f"{path}: its {name} holds target ids outside the model's {tgt_vocab}")
    return Shortlist(frequent.long(), table.int(), info)
