"""Parallel corpora: reading, Multi30k, encoding, batching by tokens, and collating into tensors.

Dimension legend used in shape comments: B batch (sentences), S source length, T target length.

Text files are read by ``qkv.data.lines``, the one reader of every command: plain or compressed,
split on ``\\n`` only, every line bounded and checked.
"""

from __future__ import annotations

import difflib
import gzip
import os
import urllib.error
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from qkv.data.lines import lines, pairs, tsv_pairs
from qkv.errors import DataError

if TYPE_CHECKING:
    from qkv.data.tokenizer import Tokenizer

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGUAGES = ("en", "de", "fr", "cs")
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{split}.{lang}.gz"
DATA_ENV_VAR = "QKV_DATA"


@dataclass
class ParallelCorpus:
    """Aligned sentence pairs: ``src[i]`` translates to ``tgt[i]``.

    ``skipped_empty`` counts pairs dropped because one side was empty; ``name`` labels logs and reports.
    """

    src: list[str]
    tgt: list[str]
    skipped_empty: int
    name: str

    def __post_init__(self) -> None:
        if len(self.src) != len(self.tgt):
            raise DataError(f"{self.name}: {len(self.src)} source sentences but {len(self.tgt)} target sentences")

    def __len__(self) -> int:
        return len(self.src)


# ---- reading files ---------------------------------------------------------------------------


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (plain or compressed, ``qkv.data.lines``), without line ends."""
    return list(lines(path))


def _pairs_to_corpus(pairs: list[tuple[str, str]], name: str, where: str) -> ParallelCorpus:
    """Strip both sides, drop (and count) pairs with an empty side, and refuse an empty result."""
    src, tgt, skipped = [], [], 0
    for s, t in pairs:
        s, t = s.strip(), t.strip()
        if not s or not t:
            skipped += 1
            continue
        src.append(s)
        tgt.append(t)
    if not src:
        raise DataError(f"no usable sentence pairs in {where} ({skipped} pairs with an empty side skipped)")
    return ParallelCorpus(src=src, tgt=tgt, skipped_empty=skipped, name=name)


MAX_HELD_OUT = 1000  # validation pairs held out of a corpus given without validation files, at most


def held_out(total: int) -> int:
    """The pairs held out for validation at the end of a corpus given without validation files: the
    last 5%, at most ``MAX_HELD_OUT`` (``qkv train`` on text files and ``qkv prepare`` alike)."""
    return max(1, min(MAX_HELD_OUT, total // 20))


def read_parallel(
    src_path: str | Path, tgt_path: str | Path, *, name: str | None = None, keep_empty: bool = False
) -> ParallelCorpus:
    """Read two line-aligned files (plain or ``.gz``), one sentence per line.

    For training, pairs where either side is empty are skipped and counted in ``skipped_empty``;
    with ``keep_empty`` (a test set: line N in must stay line N out) every line is kept as it is.
    """
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    both = list(pairs(src_path, tgt_path))
    src_lines, tgt_lines = [s for s, _ in both], [t for _, t in both]
    name = name or f"{src_path.name}|{tgt_path.name}"
    if keep_empty:
        if not src_lines:
            raise DataError(f"{src_path} and {tgt_path} are empty")
        return ParallelCorpus(src=src_lines, tgt=tgt_lines, skipped_empty=0, name=name)
    return _pairs_to_corpus(list(zip(src_lines, tgt_lines)), name, f"{src_path} and {tgt_path}")


def read_tsv(path: str | Path, *, name: str | None = None) -> ParallelCorpus:
    """Read ``source<TAB>target`` lines (plain or ``.gz``).

    A blank line counts as an empty pair and is skipped; any other line needs exactly one tab.
    """
    path = Path(path)
    return _pairs_to_corpus(list(tsv_pairs(path)), name or path.name, str(path))


# ---- Multi30k --------------------------------------------------------------------------------


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    # Also hint for a prefix ("test") and a wrong case ("EN"); cutoff 0.5 lets "dt" suggest "de".
    close = [c for c in choices if name and c.startswith(name)]
    close = close or difflib.get_close_matches(name.lower(), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv" / "multi30k"


def multi30k_dir(data_dir: str | Path | None = None) -> Path:
    """Where the Multi30k files ``{split}.{lang}.gz`` live.

    ``data_dir`` if given, else the ``QKV_DATA`` environment variable, else a cache directory
    (``~/.cache/qkv/multi30k``, or under ``$XDG_CACHE_HOME``) that ``load_multi30k`` fills on first use.
    """
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_ENV_VAR):
        return Path(os.environ[DATA_ENV_VAR]).expanduser()
    return _default_cache()


def download_multi30k(
    cache: str | Path, *, splits: Sequence[str] = MULTI30K_SPLITS, languages: Sequence[str] = MULTI30K_LANGUAGES
) -> None:
    """Download the missing ``{split}.{lang}.gz`` files from the dataset's GitHub repository into ``cache``.

    Each file goes to a temporary name first and is renamed once complete and readable, so an
    interrupted download never leaves a truncated file that later looks valid.
    """
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    for split in splits:
        for lang in languages:
            target = cache / f"{split}.{lang}.gz"
            if target.exists():
                continue
            url = MULTI30K_URL.format(split=split, lang=lang)
            tmp_name = cache / f".{target.name}.{os.urandom(6).hex()}.part"
            fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
            try:
                with os.fdopen(fd, "wb") as tmp, urllib.request.urlopen(url, timeout=60) as response:
                    tmp.write(response.read())
                gzip.decompress(tmp_name.read_bytes())  # check that it is whole before keeping it
                os.replace(tmp_name, target)
            except (urllib.error.URLError, OSError, EOFError, zlib.error) as e:
                raise DataError(
                    f"could not download {url} to {target}: {e}. Without network access, get the Multi30k "
                    f"files ({{split}}.{{lang}}.gz) elsewhere and pass --data-dir DIR or set {DATA_ENV_VAR}=DIR"
                ) from e
            finally:
                tmp_name.unlink(missing_ok=True)


def language_of(path: str | Path | None) -> str | None:
    """The language a file's name gives, as in Multi30k's and WMT's ``test.en`` or ``train.de.gz``: a
    two-letter last suffix (after .gz, .xz or .bz2); None when the name gives none."""
    if not path:
        return None
    suffixes = [s.lstrip(".").lower() for s in Path(path).suffixes]
    while suffixes and suffixes[-1] in ("gz", "xz", "bz2"):
        suffixes.pop()
    return suffixes[-1] if suffixes and len(suffixes[-1]) == 2 and suffixes[-1].isalpha() else None


def load_multi30k(split: str, src_lang: str, tgt_lang: str, data_dir: str | Path | None = None) -> ParallelCorpus:
    """One split of Multi30k task 1 (train 29,000 pairs, val 1,014, test_2016_flickr 1,000).

    Reads from ``multi30k_dir(data_dir)``. Only the default cache is downloaded into; a directory the
    user named (argument or ``QKV_DATA``) must already hold the files, so a typo fails here.
    """
    if split not in MULTI30K_SPLITS:
        raise DataError(
            f"unknown Multi30k split {split!r}{did_you_mean(split, MULTI30K_SPLITS)}; "
            f"choose from {', '.join(MULTI30K_SPLITS)}"
        )
    for lang in (src_lang, tgt_lang):
        if lang not in MULTI30K_LANGUAGES:
            raise DataError(
                f"unknown Multi30k language {lang!r}{did_you_mean(lang, MULTI30K_LANGUAGES)}; "
                f"choose from {', '.join(MULTI30K_LANGUAGES)}"
            )
    if src_lang == tgt_lang:
        raise DataError(f"source and target language are both {src_lang!r}")
    directory = multi30k_dir(data_dir)
    if data_dir is None and not os.environ.get(DATA_ENV_VAR):
        download_multi30k(directory, splits=[split], languages=[src_lang, tgt_lang])
    return read_parallel(
        directory / f"{split}.{src_lang}.gz",
        directory / f"{split}.{tgt_lang}.gz",
        name=f"multi30k-{split}-{src_lang}-{tgt_lang}",
    )


# ---- encoding --------------------------------------------------------------------------------


class EncodedCorpus(NamedTuple):
    """Token ids of a corpus, without BOS/EOS; ``n_truncated`` pairs had a side cut to ``max_len``."""

    src_ids: list[list[int]]
    tgt_ids: list[list[int]]
    n_truncated: int


def encode_corpus(
    tokenizer: Tokenizer, corpus: ParallelCorpus, max_len: int | None = None, *, dropout: float = 0.0, seed: int = 0
) -> EncodedCorpus:
    """Encode both sides and cut each token list to at most ``max_len`` ids (None: no limit).

    ``collate`` adds one token per side (EOS to the source, BOS/EOS to the target), so to fit a model
    with ``ModelConfig.max_len`` positions pass ``max_len = config.max_len - 1``. ``dropout`` > 0
    draws each side's segmentation at random (``Tokenizer.sample_batch``, seeded by ``seed``).
    """
    if max_len is not None and max_len <= 0:
        raise DataError(f"max_len must be positive, got {max_len}")
    if dropout:
        if not hasattr(tokenizer, "sample_batch"):
            raise DataError("subword sampling needs a qkv tokenizer (one joint SentencePiece model), not a Marian one")
        src_ids = tokenizer.sample_batch(corpus.src, dropout=dropout, seed=2 * seed)
        tgt_ids = tokenizer.sample_batch(corpus.tgt, dropout=dropout, seed=2 * seed + 1)
    else:
        src_ids = tokenizer.encode_batch(corpus.src)
        tgt_ids = tokenizer.encode_target_batch(corpus.tgt)  # a Marian tokenizer segments targets with their own model
    n_truncated = 0
    if max_len is not None:
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
            if len(s) > max_len or len(t) > max_len:
                n_truncated += 1
                src_ids[i], tgt_ids[i] = s[:max_len], t[:max_len]
    return EncodedCorpus(src_ids, tgt_ids, n_truncated)


# ---- batching --------------------------------------------------------------------------------


class Batches(Sequence):
    """An epoch's batches, compact: batch j is ``order[starts[j]:ends[j]]`` (example indices).

    Lists of Python ints would cost about 36 bytes per example (a gigabyte at 29 million pairs); these
    are three integer arrays. ``batches[j]`` is a list of ints, a slice a list of them, as before.
    """

    def __init__(self, order: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.order, self.starts, self.ends = order, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        return self.order[self.starts[j] : self.ends[j]].tolist()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __add__(self, other: Sequence[list[int]]) -> list[list[int]]:  # epochs joined, as lists were
        return list(self) + list(other)

    def __radd__(self, other: Sequence[list[int]]) -> list[list[int]]:
        return list(other) + list(self)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {len(self.order)} examples)"


def _cut(widths: np.ndarray, max_tokens: int) -> np.ndarray:
    """(number of batches + 1,) where greedy cutting of ``widths`` (in order) starts each batch.

    A batch starting at s takes examples while ``running max of widths * count <= max_tokens``; that
    cost only grows, so the batch ends at the first example over it (or holds one example, alone over
    budget). Every example is at least ``widths[s]`` wide, so a batch holds at most
    ``max_tokens // widths[s]`` of them: each cut looks at no more than that many, in numpy.
    """
    n, s, bounds = len(widths), 0, [0]
    while s < n:
        end = min(n, s + max(1, max_tokens // int(widths[s])))
        cost = np.maximum.accumulate(widths[s:end]) * np.arange(1, end - s + 1)
        over = int(np.argmax(cost > max_tokens)) if cost[-1] > max_tokens else end - s
        s += max(1, over)
        bounds.append(s)
    return np.asarray(bounds, dtype=np.int64)


def token_batches(
    src_lengths: Sequence[int] | np.ndarray,
    tgt_lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> Batches:
    """Group example indices into batches of similar length, each within a padded-token budget.

    Lengths are token counts without BOS/EOS. A batch's cost is its padded size,
    ``n_sentences * max(longest source + 1, longest target + 1)`` (the +1 is the EOS or BOS that
    ``collate`` adds), and stays <= ``max_tokens``; an example over budget on its own forms a batch
    alone. Examples are sorted by (target length, source length), so neighbours pad little, with ties
    broken at random; then the order of the batches is shuffled. Both draws come from (seed, epoch):
    the same pair gives the same batches, and every index appears exactly once.

    ``shuffle=False`` breaks ties by index and keeps the batches in length order (for evaluation).
    Vectorised: a few seconds for 29 million pairs, in the memory of a few arrays of that length.
    """
    if len(src_lengths) != len(tgt_lengths):
        raise DataError(f"{len(src_lengths)} source lengths but {len(tgt_lengths)} target lengths")
    if max_tokens <= 0:
        raise DataError(f"max_tokens must be positive, got {max_tokens}")
    if seed < 0 or epoch < 0:
        raise DataError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    src = np.asarray(src_lengths, dtype=np.int64)
    tgt = np.asarray(tgt_lengths, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if len(src) == 0:
        return Batches(empty, empty, empty)
    if (src < 0).any() or (tgt < 0).any():
        raise DataError("lengths must be >= 0")

    # A generator of our own, seeded from (seed, epoch): no global RNG (torch's or numpy's) is touched.
    rng = np.random.default_rng([seed, epoch])
    # Sorted by (target, source, tie): a stable sort of one integer key over the examples taken in tie
    # order (the same result as np.lexsort((tie, src, tgt)), 4x faster; a radix sort when the key fits
    # 16 bits, as it does for lengths up to 255).
    in_tie_order = np.arange(len(src))
    if shuffle:  # example i's tie is tie[i]: taken in tie order, by the inverse permutation
        in_tie_order[rng.permutation(len(src))] = np.arange(len(src))
    key = tgt * (int(src.max()) + 1) + src
    key = key.astype(np.uint16) if int(key.max()) < 1 << 16 else key
    order = in_tie_order[np.argsort(key[in_tie_order], kind="stable")]
    del in_tie_order, key
    bounds = _cut(np.maximum(src[order], tgt[order]) + 1, max_tokens)  # widths in sorted order, +1 for EOS/BOS
    starts, ends = bounds[:-1], bounds[1:]
    if shuffle:
        # Length-sorted order would feed all short batches first; shuffle whole batches instead.
        perm = rng.permutation(len(starts))
        starts, ends = starts[perm], ends[perm]
    return Batches(order, starts, ends)


def collate(
    src_ids: list[list[int]], tgt_ids: list[list[int]], *, pad_id: int, bos_id: int, eos_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad a batch into the model's three inputs (teacher forcing, section 3 of the paper).

    Returns, all ``torch.long`` and right-padded with ``pad_id``:
        src     (B, S): source + EOS
        tgt_in  (B, T): BOS + target, what the decoder reads
        tgt_out (B, T): target + EOS, what it should predict (tgt_in shifted left by one)
    """
    if len(src_ids) != len(tgt_ids):
        raise DataError(f"{len(src_ids)} sources but {len(tgt_ids)} targets in a batch")
    if not src_ids:
        raise DataError("cannot collate an empty batch")
    B = len(src_ids)
    S = max(len(s) for s in src_ids) + 1  # + EOS
    T = max(len(t) for t in tgt_ids) + 1  # + BOS (tgt_in) or + EOS (tgt_out)
    src = torch.full((B, S), pad_id, dtype=torch.long)  # (B, S)
    tgt_in = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    tgt_out = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    for b, (s, t) in enumerate(zip(src_ids, tgt_ids)):
        src[b, : len(s) + 1] = torch.tensor([*s, eos_id], dtype=torch.long)
        tgt_in[b, : len(t) + 1] = torch.tensor([bos_id, *t], dtype=torch.long)
        tgt_out[b, : len(t) + 1] = torch.tensor([*t, eos_id], dtype=torch.long)
    return src, tgt_in, tgt_out
