"""Split one parallel corpus into training, validation (dev) and test sets that share no sentence:
what ``qkv split`` writes, so that a corpus of any size can be held out from without counting lines.

The held-out pairs are drawn at random (seeded) from the corpus; every pair whose source or target
sentence occurs in dev or test is kept out of training (a repeated sentence would otherwise score the
model on pairs it trained on), and test shares no sentence with dev. Pairs with an empty side are
dropped. Training keeps the corpus's order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from qkv.data.lines import COMPRESSED, pairs, tsv_pairs
from qkv.errors import DataError

DEFAULT_SHARE = 0.05  # of the pairs, for each of dev and test
DEFAULT_MAX = 1000  # pairs, for each of dev and test, when sized by the default share


@dataclass(frozen=True)
class SplitCounts:
    read: int  # pairs in the corpus
    empty: int  # pairs with an empty side, dropped
    train: int
    dev: int
    test: int
    overlapping: int  # pairs in none of the three: dev or test holds one of their sentences
    files: dict[str, Path]  # "train.src", "dev.tgt", ... -> the file written


def check_held_out_size(size: float | None, name: str = "a held-out size") -> None:
    """Refuse a ``size`` that is neither a share below 1 nor a whole count (``held_out_size``): zero or
    less, NaN, infinity, or a count with a fraction (2.5 pairs)."""
    if size is None:
        return
    if not math.isfinite(size) or size <= 0:
        raise DataError(f"{name} must be positive and finite (a share below 1 or a count), got {size:g}")
    if size >= 1 and size != int(size):
        raise DataError(f"{name} of 1 or more is a count of pairs and must be whole, got {size:g} (a share is below 1)")


def held_out_size(size: float | None, n: int) -> int:
    """Pairs for dev or test out of ``n``: ``size`` below 1 is a share, 1 or more a whole count
    (``check_held_out_size``); None: 5%, at least 1 and at most 1,000."""
    if size is None:
        return max(1, min(DEFAULT_MAX, round(DEFAULT_SHARE * n)))
    check_held_out_size(size)
    return max(1, round(size * n)) if size < 1 else int(size)


def language_suffix(path: str | Path, fallback: str) -> str:
    """``corpus.en`` and ``corpus.en.gz`` -> ``en``; a name without a short alphabetic suffix -> ``fallback``."""
    path = Path(path)
    if path.suffix in COMPRESSED:
        path = path.with_suffix("")
    suffix = path.suffix[1:]
    return suffix if 2 <= len(suffix) <= 3 and suffix.isalpha() else fallback


def split_corpus(src: str | Path, tgt: str | Path | None, out: str | Path, *, dev: float | None = None,
                 test: float | None = None, seed: int = 1) -> SplitCounts:
    """Write ``out``/train, dev and test files (``train.en`` ... named by the input's language suffix,
    else ``.src``/``.tgt``) from ``src`` and ``tgt`` (or one TSV ``src``); ``out`` must be new or empty."""
    check_held_out_size(dev, "--dev")  # before the corpus is read
    check_held_out_size(test, "--test")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty directory: qkv split writes into a new one")
    read = list(pairs(src, tgt) if tgt else tsv_pairs(src))
    kept = [(s.strip(), t.strip()) for s, t in read if s.strip() and t.strip()]
    n_dev, n_test = held_out_size(dev, len(kept)), held_out_size(test, len(kept))
    if n_dev + n_test >= len(kept):
        raise DataError(f"{len(kept):,} usable pairs cannot give {n_dev:,} dev and {n_test:,} test pairs and keep some for training")
    order = list(range(len(kept)))
    random.Random(seed).shuffle(order)
    dev_ids, test_ids, held = [], [], set()  # held: the sentences of dev and test
    for i in order:  # dev, then test: the next pairs that share no sentence with those drawn before
        ids = dev_ids if len(dev_ids) < n_dev else test_ids
        if len(test_ids) == n_test:
            break
        if kept[i][0] not in held and kept[i][1] not in held:
            ids.append(i)
            held.update(kept[i])
    chosen = set(dev_ids) | set(test_ids)
    train_ids, overlapping = [], 0
    for i in range(len(kept)):
        if i in chosen:
            continue
        if kept[i][0] in held or kept[i][1] in held:
            overlapping += 1
            continue
        train_ids.append(i)
    if not train_ids:
        raise DataError("no training pair is left once dev and test are held out")
    a, b = (language_suffix(src, "src"), language_suffix(tgt, "tgt")) if tgt else ("src", "tgt")  # one TSV: no language in its name
    if a == b:
        a, b = "src", "tgt"
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, ids in (("train", train_ids), ("dev", sorted(dev_ids)), ("test", sorted(test_ids))):
        for side, suffix in ((0, a), (1, b)):
            path = files[f"{name}.{'src' if side == 0 else 'tgt'}"] = out / f"{name}.{suffix}"
            path.write_text("".join(kept[i][side] + "\n" for i in ids), encoding="utf-8")
    return SplitCounts(read=len(read), empty=len(read) - len(kept), train=len(train_ids), dev=len(dev_ids),
                       test=len(test_ids), overlapping=overlapping, files=files)
