"""Guided alignment: one cross-attention head trained to align (Garg et al., 2019, "Jointly Learning to
Align and Translate with Transformer Models"; fairseq's ``transformer_align``, OpenNMT's guided alignment).

A statistical aligner, eflomal (Östling and Tiedemann, 2016; maintained on PyPI), aligns the training
pairs once, piece by piece (the subword ids the model reads, so no word-to-piece mapping is needed), in
both directions; the two directions are symmetrized with grow-diag-final-and (Koehn et al., 2005).
During training the first head of the decoder layer ``ModelConfig.alignment_layer`` is pulled towards
those links: at the decoder position that predicts target piece j, the head's weights over the source
pieces should be the uniform distribution over the pieces linked to j (pieces with no link add nothing).
The loss is that cross-entropy, summed over the linked target pieces and weighted by ``TrainConfig.alignment``
(fairseq's ``alignment_lambda``), added to the translation loss before both are divided by the batch's
target tokens.

Text corpora and prepared ones (``qkv prepare``, memory-mapped) take the same path: the pairs' ids are
eflomal's tokens, whichever way they were encoded. eflomal holds its whole input in memory, so a corpus
of more than ``SHARD`` pairs is aligned in shards of equal size (at most ``SHARD`` pairs each, in order):
the aligner's memory is that of one shard, whatever the corpus's size; what grows with the corpus is the
links kept (``Links``: 4 bytes a link and 8 a pair, twice that for a moment while the shards are joined).
A corpus of at most ``SHARD`` pairs is aligned in one pass, as before shards existed.

Shapes: B sentences, T target positions (pieces + EOS), S source positions (pieces + EOS).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.errors import MissingPackage, QkvError
from qkv.model.config import ConfigError
from qkv.io.outputs import replace_whole
from qkv.io.runs import ALIGNMENT_LINKS

LINKS_FILE = ALIGNMENT_LINKS  # a run's links, with the digest of the pieces they align
SHARD = 100_000  # the most pairs eflomal aligns at once: under 1 GB for it and this process (benchmarks/results/alignment_links)
EPS = 1e-6  # inside the log: a head that gives a linked source piece weight 0 costs -log(1e-6), not inf


def import_eflomal():
    try:
        import eflomal
    except ImportError:
        raise MissingPackage("guided alignment needs eflomal (pip install eflomal; qkv's requirements name it)") from None
    return eflomal


def grow_diag_final_and(forward: set[tuple[int, int]], reverse: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Symmetrize two directional alignments of one pair, (source, target) links each: start from their
    intersection, add union links next to a link (diagonals included) that align a word not yet aligned,
    then (final-and) union links between two words neither of which is aligned yet."""
    union = forward | reverse
    links = set(forward & reverse)
    neighbours = [(-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    src_done = {s for s, _ in links}
    tgt_done = {t for _, t in links}
    grown = True
    while grown:
        grown = False
        for s, t in sorted(links):
            for ds, dt in neighbours:
                link = (s + ds, t + dt)
                if link in union and link not in links and (link[0] not in src_done or link[1] not in tgt_done):
                    links.add(link)
                    src_done.add(link[0])
                    tgt_done.add(link[1])
                    grown = True
    for direction in (forward, reverse):  # final-and
        for s, t in sorted(direction):
            if s not in src_done and t not in tgt_done:
                links.add((s, t))
                src_done.add(s)
                tgt_done.add(t)
    return links


def _read_links(path: Path) -> list[set[tuple[int, int]]]:
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        found.append({tuple(int(x) for x in link.split("-")) for link in line.split()})  # type: ignore[misc]
    return found


class Links(Sequence):
    """Every pair's links, flat: ``links[i]`` is pair i's (n, 2) array of (source position, target
    position), a view of one (M, 2) array (int16 while every position fits, int32 otherwise) cut by
    (N + 1,) offsets. A corpus of millions of pairs holds two arrays, not an array object per pair."""

    def __init__(self, counts: np.ndarray, flat: np.ndarray) -> None:
        self.offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        small = not len(flat) or int(flat.max()) < np.iinfo(np.int16).max
        self.flat = np.asarray(flat, dtype=np.int16 if small else np.int32).reshape(-1, 2)
        if int(self.offsets[-1]) != len(self.flat):
            raise QkvError(f"{len(self.flat)} links but counts that add up to {int(self.offsets[-1])}")

    @classmethod
    def of(cls, pairs: Sequence[np.ndarray]) -> Links:
        counts = np.fromiter((len(x) for x in pairs), dtype=np.int64, count=len(pairs))
        return cls(counts, np.concatenate(pairs) if len(pairs) else np.zeros((0, 2), dtype=np.int32))

    @classmethod
    def joined(cls, parts: Sequence[Links]) -> Links:
        if len(parts) == 1:
            return parts[0]
        return cls(np.concatenate([p.counts for p in parts]), np.concatenate([p.flat for p in parts]))

    @property
    def counts(self) -> np.ndarray:
        """(N,) each pair's number of links."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:  # type: ignore[override]
        n = len(self)
        if isinstance(i, slice):
            return [self[j] for j in range(n)[i]]
        if not -n <= i < n:
            raise IndexError(f"pair {i} of {n}")
        i %= n
        return self.flat[self.offsets[i] : self.offsets[i + 1]]


def shards(n: int, most: int = SHARD) -> list[range]:
    """The pairs 0..n-1 cut into the fewest consecutive shards of at most ``most`` pairs, of sizes that
    differ by at most one (no small remainder that eflomal would align with too little evidence)."""
    if n <= 0:
        return []
    k = -(-n // most)
    bounds = [n * j // k for j in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def align_pieces(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], *, seed: int = 1,
                 shard: int = SHARD, log=None) -> Links:
    """eflomal's symmetrized links of each pair of id sequences: ``links[i]`` is pair i's (n, 2) array
    of (source position, target position); a pair with an empty side has none. The pairs are read and
    aligned one shard at a time (``shards``; shard k seeded ``seed + k``), so that at most ``shard``
    pairs are in eflomal's memory and in lists here; ``src_ids`` may be a prepared corpus's mapped side.
    ``log``, when given, is told of each shard aligned when there are several."""
    if len(src_ids) != len(tgt_ids):
        raise QkvError(f"{len(src_ids)} sources but {len(tgt_ids)} targets to align")
    parts = []
    cut = shards(len(src_ids), shard)
    for k, part in enumerate(cut):
        src, tgt = [src_ids[i] for i in part], [tgt_ids[i] for i in part]
        parts.append(Links.of(_align_shard(src, tgt, seed=seed + k)))
        if log is not None and len(cut) > 1:
            log(f"guided alignment: shard {k + 1} of {len(cut)} aligned (pairs {part.start:,} to {part.stop - 1:,})")
    return Links.joined(parts) if parts else Links.of([])


def _align_shard(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], *, seed: int) -> list[np.ndarray]:
    """``align_pieces`` in one pass of eflomal: every pair's (n, 2) int32 links."""
    eflomal = import_eflomal()
    # eflomal reads whitespace-separated tokens; an id is one. An empty side stands in as one dummy token.
    as_text = lambda rows: [" ".join(map(str, ids)) if len(ids) else "<empty>" for ids in rows]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="qkv-align-") as where:
        fwd, rev = Path(where) / "fwd", Path(where) / "rev"
        state = np.random.get_state()  # eflomal's sampler draws its seed from NumPy's global generator
        np.random.seed(seed)
        try:
            eflomal.Aligner().align(as_text(src_ids), as_text(tgt_ids), links_filename_fwd=str(fwd), links_filename_rev=str(rev))
        finally:
            np.random.set_state(state)
        forward, reverse = _read_links(fwd), _read_links(rev)
    if len(forward) != len(src_ids) or len(reverse) != len(src_ids):
        raise QkvError(f"eflomal aligned {len(forward)} of {len(src_ids)} pairs")
    result = []
    for s, t, f, r in zip(src_ids, tgt_ids, forward, reverse):
        if not len(s) or not len(t):
            result.append(np.zeros((0, 2), dtype=np.int32))
            continue
        links = sorted(link for link in grow_diag_final_and(f, r) if link[0] < len(s) and link[1] < len(t))
        result.append(np.asarray(links, dtype=np.int32).reshape(-1, 2))
    return result


def align_words_eflomal(sources: Sequence[str], targets: Sequence[str]) -> list[list[tuple[int, int]]]:
    """eflomal's symmetrized links between the whitespace words of each pair (lowercased, as eflomal
    reads words), as (source word, target word) pairs: ``qkv align --method eflomal``."""
    vocab: dict[str, int] = {}
    ids = lambda line: [vocab.setdefault(w.lower(), len(vocab)) for w in line.split()]  # noqa: E731
    links = align_pieces([ids(s) for s in sources], [ids(t) for t in targets])
    return [[(int(s), int(t)) for s, t in pairs] for pairs in links]


def pieces_digest(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the pairs' ids: what a run's saved links were computed from."""
    h = hashlib.sha256()
    for s, t in zip(src_ids, tgt_ids):
        h.update(np.asarray(s, dtype=np.int64).tobytes() + b"|" + np.asarray(t, dtype=np.int64).tobytes() + b"\n")
    return h.hexdigest()


def save_links(path: Path, links: Links | Sequence[np.ndarray], digest: str) -> None:
    """Write the links whole (a new file renamed into place) with the digest of the pieces they align:
    each pair's count of links and every link, (source, target) as int32, pair after pair."""
    links = links if isinstance(links, Links) else Links.of(links)
    with tempfile.TemporaryFile() as buffer:
        np.savez_compressed(buffer, counts=links.counts, links=links.flat.astype(np.int32), digest=np.asarray(digest))
        buffer.seek(0)
        replace_whole(path, buffer.read())


def load_links(path: Path, digest: str) -> Links | None:
    """A run's saved links, or None when there are none, they are unreadable, or they align other pieces."""
    try:
        with np.load(path) as data:
            if str(data["digest"]) != digest:
                return None
            counts, flat = data["counts"], data["links"]
    except (OSError, ValueError, KeyError):
        return None
    if counts.ndim != 1 or (len(counts) and int(counts.min()) < 0) or int(counts.sum()) != len(flat) or flat.shape[1:] != (2,):
        return None
    return Links(counts, flat)


def run_links(run_dir: Path, src_ids, tgt_ids, *, seed: int, log=print) -> tuple[Links, str, bool]:
    """The training pairs' links: the run's saved ones when they align exactly these pieces, else
    eflomal's (slow: tens of seconds on Multi30k; shards of ``SHARD`` pairs beyond). Returns the links,
    their digest and whether they are new (to be saved once the run directory is ready)."""
    digest = pieces_digest(src_ids, tgt_ids)
    saved = load_links(run_dir / LINKS_FILE, digest) if (run_dir / LINKS_FILE).is_file() else None
    if saved is not None and len(saved) == len(src_ids):
        return saved, digest, False
    n = len(shards(len(src_ids)))
    log(f"guided alignment: eflomal aligns the {len(src_ids):,} training pairs (once per run"
        + (f"; in {n} shards of at most {SHARD:,})" if n > 1 else ")"))
    return align_pieces(src_ids, tgt_ids, seed=seed, log=log), digest, True


def link_targets(links: Sequence[np.ndarray], T: int, S: int, device: torch.device | None = None) -> Tensor:
    """(B, T, S) target distributions of the alignment head: row j of pair b spreads 1 evenly over the
    source pieces linked to target piece j; rows of unlinked pieces (and EOS, and padding) are 0."""
    B = len(links)
    target = np.zeros((B, T, S), dtype=np.float32)
    for b, pairs in enumerate(links):
        if len(pairs):
            s, t = pairs[:, 0], pairs[:, 1]
            keep = (s < S) & (t < T)
            np.add.at(target[b], (t[keep], s[keep]), 1.0)
    rows = target.sum(axis=2, keepdims=True)
    target = np.divide(target, rows, out=np.zeros_like(target), where=rows > 0)
    return torch.from_numpy(target).to(device)


def alignment_loss(head: Tensor, target: Tensor) -> Tensor:
    """Sum over linked target pieces of the cross-entropy between ``target`` (B, T, S) and the head's
    weights ``head`` (B, T, S): -sum target * log(head + EPS)."""
    return -(target * (head.float() + EPS).log()).sum()


def check_alignment_settings(alignment: float, data, n_decoder_layers: int) -> None:
    """Refuse what guided alignment cannot follow: links are computed once on the pieces of the
    training pairs, so each epoch must see those pieces (no subword dropout, recasing or inline terms)."""
    if not alignment:
        return
    if n_decoder_layers < 1:
        raise ConfigError("guided alignment (--train alignment) needs a decoder layer")
    for key in ("subword_dropout", "case_augment", "term_share"):
        if getattr(data, key):
            raise ConfigError(f"guided alignment aligns the training pieces once: not with --data {key} (which changes them each epoch)")


HEAD_KEYS = ("alignment_layer", "alignment_context")  # the model keys of the head guided alignment trains


def check_alignment_head(given: dict, alignment: float) -> None:
    """Refuse a new model whose head keys are given (``given``: the --model keys, a config file's
    included) without guided alignment (``alignment``, --train alignment's weight) to train that head:
    the run would record an untrained head as the alignment head, and ``qkv align``, ``qkv attend`` and
    the glossary's placement check would read it as a trained one. (A head of a checkpoint fine-tuned
    with --init-from was trained there: its keys come from the checkpoint, not from here.)"""
    named = [key for key in HEAD_KEYS if given.get(key) is not None]
    if named and not alignment:
        raise ConfigError(f"--model {named[0]}={given[named[0]]} names the head that guided alignment trains, and no "
                          f"--train alignment=W trains one: give both, or neither")


def default_alignment_layer(n_decoder_layers: int) -> int:
    """The supervised layer when none is given: the penultimate (fairseq's default), the only one of one."""
    return max(0, n_decoder_layers - 2)


def default_context(fine_tune: bool) -> str:
    """The pass a new head is trained and read in when neither its layer nor its context is given
    (``ModelConfig.alignment_context``; ``qkv train`` places the head itself),
    each chosen on the Multi30k val gold set (docs/training.md#guided-alignment): ``full`` for a model
    trained from its first update (AER 10.0 against 14.5 causal, 2,221 updates, val BLEU 35.96 against
    35.43), ``causal`` for a head added by fine-tuning (22.9 against 27.4 full after 300 updates)."""
    return "causal" if fine_tune else "full"
