"""Reading parallel corpora, Multi30k, encoding, token batching and collating."""

from __future__ import annotations

import gzip
import io
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MULTI30K, needs_multi30k

from qkv.data import corpus as data
from qkv.errors import QkvError
from qkv.data.corpus import (
    DataError,
    ParallelCorpus,
    collate,
    encode_corpus,
    load_multi30k,
    multi30k_dir,
    read_parallel,
    read_tsv,
    token_batches,
)
from qkv.io.outputs import current_umask


def write(path: Path, content: str | bytes) -> Path:
    raw = content.encode("utf-8") if isinstance(content, str) else content
    if path.suffix == ".gz":
        raw = gzip.compress(raw)
    path.write_bytes(raw)
    return path


# ---- reading files ---------------------------------------------------------------------------


def test_read_parallel_strips_and_keeps_order(tmp_path):
    src = write(tmp_path / "a.en", "A dog runs.\n  Two cats.  \r\nA bird.")  # CRLF and no final newline
    tgt = write(tmp_path / "a.de", "Ein Hund rennt.\nZwei Katzen.\r\nEin Vogel.\n")
    corpus = read_parallel(src, tgt)
    assert corpus.src == ["A dog runs.", "Two cats.", "A bird."]
    assert corpus.tgt == ["Ein Hund rennt.", "Zwei Katzen.", "Ein Vogel."]
    assert corpus.skipped_empty == 0 and len(corpus) == 3 and corpus.name == "a.en|a.de"


def test_only_newline_ends_a_line(tmp_path):
    # Text-mode splitting would break these lines at \r, U+0085 and U+2028 and misalign the corpus.
    src = write(tmp_path / "s", "one\rstill one\u2028and one\x85end\ntwo\n")
    tgt = write(tmp_path / "t", "eins\nzwei\n")
    corpus = read_parallel(src, tgt)
    assert corpus.src == ["one\rstill one\u2028and one\x85end", "two"]


def test_byte_order_mark_is_dropped(tmp_path):
    corpus = read_parallel(write(tmp_path / "s", "\ufeffHello.\n"), write(tmp_path / "t", "Hallo.\n"))
    assert corpus.src == ["Hello."]


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
    src = write(tmp_path / "train.en", "a\nb\nc\n")
    tgt = write(tmp_path / "train.de", "a\nb\n")
    with pytest.raises(DataError) as info:
        read_parallel(src, tgt)
    message = str(info.value)
    assert f"{src} has 3 lines" in message and f"{tgt} has 2" in message


def test_invalid_utf8_names_file_and_line(tmp_path):
    src = write(tmp_path / "bad.en", b"fine\nalso fine\nbro\xffken\n")
    tgt = write(tmp_path / "ok.de", "gut\nauch gut\nkaputt\n")
    with pytest.raises(DataError, match=r"bad\.en: line 3 is not valid UTF-8"):
        read_parallel(src, tgt)


def test_invalid_utf8_in_gzip_names_file_and_line(tmp_path):
    src = write(tmp_path / "bad.en.gz", b"fine\n\xc3\x28\n")
    with pytest.raises(DataError, match=r"bad\.en\.gz: line 2 is not valid UTF-8"):
        read_parallel(src, write(tmp_path / "ok.de", "a\nb\n"))


def test_pairs_with_an_empty_side_are_skipped_and_counted(tmp_path):
    src = write(tmp_path / "s", "one\n\nthree\nfour\n   \n")
    tgt = write(tmp_path / "t", "eins\nzwei\n\nvier\n\n")
    corpus = read_parallel(src, tgt)
    assert corpus.src == ["one", "four"] and corpus.tgt == ["eins", "vier"]
    assert corpus.skipped_empty == 3


def test_gzip_and_plain_files_mix(tmp_path):
    corpus = read_parallel(write(tmp_path / "s.gz", "Grüße.\nZwei.\n"), write(tmp_path / "t", "Greetings.\nTwo.\n"))
    assert corpus.src == ["Grüße.", "Zwei."] and corpus.tgt == ["Greetings.", "Two."]


def test_corrupt_gzip_names_the_file(tmp_path):
    src = tmp_path / "broken.gz"
    src.write_bytes(gzip.compress(b"a\nb\nc\n" * 100)[:30])
    with pytest.raises(DataError, match=r"broken\.gz: corrupt or truncated gzip"):
        read_parallel(src, write(tmp_path / "t", "x\n"))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"missing\.de does not exist"):
        read_parallel(write(tmp_path / "s", "a\n"), tmp_path / "missing.de")


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no usable sentence pairs"):
        read_parallel(write(tmp_path / "s", ""), write(tmp_path / "t", ""))
    with pytest.raises(DataError, match=r"no usable sentence pairs.*2 pairs with an empty side"):
        read_parallel(write(tmp_path / "s2", "a\n\n"), write(tmp_path / "t2", "\nb\n"))


def test_read_tsv(tmp_path):
    path = write(tmp_path / "pairs.tsv.gz", "A dog.\tEin Hund.\n\n  Two. \t Zwei.\nempty target\t\n")
    corpus = read_tsv(path)
    assert corpus.src == ["A dog.", "Two."] and corpus.tgt == ["Ein Hund.", "Zwei."]
    assert corpus.skipped_empty == 2 and corpus.name == "pairs.tsv.gz"


@pytest.mark.parametrize("line, tabs", [("no tab here", 0), ("a\tb\tc", 2)])
def test_tsv_line_without_exactly_one_tab_names_the_line(tmp_path, line, tabs):
    path = write(tmp_path / "pairs.tsv", f"a\tb\n{line}\n")
    with pytest.raises(DataError, match=rf"pairs\.tsv: line 2 has {tabs} tabs; expected exactly one"):
        read_tsv(path)


def test_tsv_invalid_utf8_and_missing(tmp_path):
    with pytest.raises(DataError, match=r"x\.tsv: line 1 is not valid UTF-8"):
        read_tsv(write(tmp_path / "x.tsv", b"\xff\tb\n"))
    with pytest.raises(DataError, match=r"none\.tsv does not exist"):
        read_tsv(tmp_path / "none.tsv")


# ---- Multi30k --------------------------------------------------------------------------------


@needs_multi30k
@pytest.mark.parametrize("split, size", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)])
def test_multi30k_split_sizes(split, size):
    corpus = load_multi30k(split, "en", "de", data_dir=MULTI30K)
    assert len(corpus.src) == len(corpus.tgt) == size
    assert corpus.skipped_empty == 0 and corpus.name == f"multi30k-{split}-en-de"


@needs_multi30k
def test_multi30k_direction_follows_the_arguments():
    en_de = load_multi30k("val", "en", "de", data_dir=MULTI30K)
    de_en = load_multi30k("val", "de", "en", data_dir=MULTI30K)
    assert en_de.src == de_en.tgt and en_de.tgt == de_en.src
    assert en_de.src[0] != en_de.tgt[0]


@needs_multi30k
def test_qkv_data_env_var_is_honoured(monkeypatch):
    monkeypatch.setenv("QKV_DATA", str(MULTI30K))
    monkeypatch.setattr(data, "download_multi30k", lambda *a, **k: pytest.fail("must not download"))
    assert multi30k_dir() == MULTI30K
    assert len(load_multi30k("test_2016_flickr", "fr", "cs")) == 1000


def test_multi30k_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("QKV_DATA", raising=False)
    assert multi30k_dir() == tmp_path / "cache" / "qkv" / "multi30k"
    monkeypatch.setenv("QKV_DATA", str(tmp_path / "env"))
    assert multi30k_dir() == tmp_path / "env"
    assert multi30k_dir(tmp_path / "arg") == tmp_path / "arg"


def test_explicit_data_dir_without_the_files_names_the_file(tmp_path):
    with pytest.raises(DataError, match=r"val\.en\.gz does not exist"):
        load_multi30k("val", "en", "de", data_dir=tmp_path)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (("valid", "en", "de"), r"unknown Multi30k split 'valid' \(did you mean 'val'\?\)"),
        (("test", "en", "de"), r"split 'test' \(did you mean 'test_2016_flickr'\?\); choose from train, val, test_2"),
        (("train", "en", "deu"), r"unknown Multi30k language 'deu' \(did you mean 'de'\?\)"),
        (("train", "EN", "de"), r"unknown Multi30k language 'EN' \(did you mean 'en'\?\)"),
        (("train", "en", "en"), r"both 'en'"),
        (("train", "xx", "de"), r"unknown Multi30k language 'xx'; choose from en, de, fr, cs"),
    ],
)
def test_multi30k_rejects_unknown_names(args, pattern):
    with pytest.raises(DataError, match=pattern):
        load_multi30k(*args, data_dir="unused")


class _FakeResponse(io.BytesIO):
    def __enter__(self):
        return self


def _use_empty_cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("QKV_DATA", raising=False)
    return tmp_path / "qkv" / "multi30k"


def test_failed_download_says_how_to_point_at_local_files(monkeypatch, tmp_path):
    cache = _use_empty_cache(monkeypatch, tmp_path)

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match=r"could not download .*val\.en\.gz.*--data-dir.*QKV_DATA"):
        load_multi30k("val", "en", "de")
    assert list(cache.iterdir()) == []  # no partial file left behind


def test_download_fetches_only_missing_files_atomically(monkeypatch, tmp_path):
    cache = _use_empty_cache(monkeypatch, tmp_path)
    requested = []

    def fake_urlopen(url, timeout):
        requested.append(url.rsplit("/", 1)[1])
        lang = url.rsplit(".", 2)[1]
        return _FakeResponse(gzip.compress(f"sentence in {lang}\n".encode()))

    monkeypatch.setattr(data.urllib.request, "urlopen", fake_urlopen)
    corpus = load_multi30k("val", "en", "de")
    assert corpus.src == ["sentence in en"] and corpus.tgt == ["sentence in de"]
    assert sorted(requested) == ["val.de.gz", "val.en.gz"]
    assert sorted(p.name for p in cache.iterdir()) == ["val.de.gz", "val.en.gz"]
    assert {p.stat().st_mode & 0o777 for p in cache.iterdir()} == {0o666 & ~current_umask()}  # not mkstemp's 0600
    load_multi30k("val", "de", "en")  # cached: no new requests
    assert len(requested) == 2


def test_truncated_download_is_not_kept(monkeypatch, tmp_path):
    cache = _use_empty_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(
        data.urllib.request, "urlopen", lambda url, timeout: _FakeResponse(gzip.compress(b"x\n" * 1000)[:20])
    )
    with pytest.raises(DataError, match="could not download"):
        load_multi30k("val", "en", "de")
    assert list(cache.iterdir()) == []


# ---- encoding --------------------------------------------------------------------------------


class _WordTokenizer:
    """Stands in for qkv.data.tokenizer.Tokenizer: one id per whitespace-separated word."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[len(word) for word in text.split()] for text in texts]

    encode_target_batch = encode_batch  # one vocabulary for both sides, as qkv's own tokenizer


def test_encode_corpus_truncates_and_counts():
    corpus = ParallelCorpus(src=["a bb ccc", "a", "a b"], tgt=["a", "a b c d", "a b"], skipped_empty=0, name="x")
    encoded = encode_corpus(_WordTokenizer(), corpus, max_len=2)
    assert encoded.src_ids == [[1, 2], [1], [1, 1]]
    assert encoded.tgt_ids == [[1], [1, 1], [1, 1]]
    assert encoded.n_truncated == 2
    untouched = encode_corpus(_WordTokenizer(), corpus)
    assert untouched.src_ids[0] == [1, 2, 3] and untouched.n_truncated == 0
    with pytest.raises(DataError, match="max_len must be positive"):
        encode_corpus(_WordTokenizer(), corpus, max_len=0)


# ---- batching --------------------------------------------------------------------------------


def multi30k_like_lengths(n: int = 5000, seed: int = 0) -> tuple[list[int], list[int]]:
    """Subword lengths shaped like Multi30k en-de: mostly 8-25 tokens, a long tail, correlated sides."""
    rng = np.random.default_rng(seed)
    src = np.clip(rng.gamma(6.0, 2.5, n).astype(int) + 2, 1, 80)
    tgt = np.clip((src * 1.1 + rng.normal(0.0, 2.5, n)).astype(int), 1, 90)
    return src.tolist(), tgt.tolist()


def padded_size(batch, src, tgt) -> int:
    return len(batch) * max(max(src[i] for i in batch) + 1, max(tgt[i] for i in batch) + 1)


def test_batches_respect_the_budget_and_cover_every_index_once():
    src, tgt = multi30k_like_lengths()
    batches = token_batches(src, tgt, 1000, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    assert all(padded_size(b, src, tgt) <= 1000 for b in batches)
    # Greedy cutting: each batch is full, adding the next example in length order would overflow.
    assert np.mean([padded_size(b, src, tgt) for b in batches]) > 900


def test_batches_pad_little():
    src, tgt = multi30k_like_lengths(29000)  # the size of Multi30k's training set
    batches = token_batches(src, tgt, 4096, seed=0, epoch=0)
    real = sum(src[i] + 1 + tgt[i] + 1 for b in batches for i in b)
    slots = sum(len(b) * (max(src[i] for i in b) + 1 + max(tgt[i] for i in b) + 1) for b in batches)
    assert 1 - real / slots < 0.10
    # Random batches of the same sizes would pad several times more: the sort is doing the work.
    perm = np.random.default_rng(0).permutation(len(src)).tolist()
    shuffled, k = [], 0
    for b in batches:
        shuffled.append(perm[k : k + len(b)])
        k += len(b)
    slots_random = sum(len(b) * (max(src[i] for i in b) + 1 + max(tgt[i] for i in b) + 1) for b in shuffled)
    assert slots_random > 2 * slots


def test_batches_are_deterministic_per_seed_and_epoch():
    src, tgt = multi30k_like_lengths(2000)
    first = token_batches(src, tgt, 800, seed=3, epoch=1)
    assert token_batches(src, tgt, 800, seed=3, epoch=1) == first
    assert token_batches(src, tgt, 800, seed=3, epoch=2) != first
    assert token_batches(src, tgt, 800, seed=4, epoch=1) != first


def test_batching_leaves_global_rngs_alone():
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    token_batches(*multi30k_like_lengths(500), 500, seed=0, epoch=0)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state))


def test_an_example_over_budget_forms_its_own_batch():
    src, tgt = [3, 50, 4, 2], [3, 2, 60, 2]
    batches = token_batches(src, tgt, 20, seed=0, epoch=0)
    assert [1] in batches and [2] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]


def test_unshuffled_batches_are_in_length_order():
    src, tgt = multi30k_like_lengths(1000)
    batches = token_batches(src, tgt, 600, seed=0, epoch=0, shuffle=False)
    flat = [i for b in batches for i in b]
    assert flat == sorted(range(len(src)), key=lambda i: (tgt[i], src[i], i))
    assert token_batches(src, tgt, 600, seed=9, epoch=9, shuffle=False) == batches


def greedy_reference(src, tgt, max_tokens, *, seed, epoch, shuffle=True):
    """The batching rule written as the plain loop it is (the library cuts in numpy): sort by
    (target, source, random tie), add examples while the padded size fits, shuffle the batches."""
    rng = np.random.default_rng([seed, epoch])
    tie = rng.permutation(len(src)) if shuffle else np.arange(len(src))
    batches, batch, width = [], [], 0
    for i in sorted(range(len(src)), key=lambda i: (tgt[i], src[i], tie[i])):
        new_width = max(width, src[i] + 1, tgt[i] + 1)
        if batch and new_width * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, new_width = [], max(src[i] + 1, tgt[i] + 1)
        batch.append(i)
        width = new_width
    batches.append(batch)
    return [batches[j] for j in rng.permutation(len(batches))] if shuffle else batches


@pytest.mark.parametrize("longest", [80, 400])  # keys of 16 bits (radix sort) and wider
def test_batches_are_exactly_the_greedy_rule(longest):
    rng = np.random.default_rng(longest)
    for trial in range(12):
        n = int(rng.integers(1, 1500))
        src, tgt = rng.integers(0, longest, n).tolist(), rng.integers(0, longest, n).tolist()
        max_tokens = int(rng.integers(1, 2500))
        for shuffle in (True, False):
            expected = greedy_reference(src, tgt, max_tokens, seed=trial, epoch=3, shuffle=shuffle)
            assert list(token_batches(src, tgt, max_tokens, seed=trial, epoch=3, shuffle=shuffle)) == expected


def test_batches_are_compact_and_read_as_lists():
    src, tgt = multi30k_like_lengths(3000)
    batches = token_batches(np.asarray(src), np.asarray(tgt), 700, seed=1, epoch=0)
    assert all(type(i) is int for i in batches[0])
    assert batches[1:4] == [batches[1], batches[2], batches[3]]
    assert batches.order.nbytes == 8 * 3000  # one int64 per example, not a Python list of ints
    other = token_batches(np.asarray(src), np.asarray(tgt), 700, seed=1, epoch=1)
    assert batches + other == list(batches) + list(other) and [[0]] + batches == [[0], *batches]  # joined as lists were


def test_batching_edge_cases():
    assert token_batches([], [], 100, seed=0, epoch=0) == []
    with pytest.raises(DataError, match="3 source lengths but 2 target lengths"):
        token_batches([1, 2, 3], [1, 2], 100, seed=0, epoch=0)
    with pytest.raises(DataError, match="max_tokens must be positive"):
        token_batches([1], [1], 0, seed=0, epoch=0)


# ---- collate ---------------------------------------------------------------------------------

PAD, BOS, EOS = 0, 2, 3


def test_collate_shapes_and_special_token_placement():
    src_ids = [[10, 11, 12], [20]]
    tgt_ids = [[30], [40, 41, 42, 43]]
    src, tgt_in, tgt_out = collate(src_ids, tgt_ids, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert src.shape == (2, 4) and tgt_in.shape == tgt_out.shape == (2, 5)
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long
    assert src.tolist() == [[10, 11, 12, EOS], [20, EOS, PAD, PAD]]
    assert tgt_in.tolist() == [[BOS, 30, PAD, PAD, PAD], [BOS, 40, 41, 42, 43]]
    assert tgt_out.tolist() == [[30, EOS, PAD, PAD, PAD], [40, 41, 42, 43, EOS]]
    # Teacher forcing: the decoder input is the expected output shifted right by one.
    assert torch.equal(tgt_in[:, 1:][tgt_in[:, 1:] != PAD], tgt_out[:, :-1][tgt_in[:, 1:] != PAD])


def test_collate_uses_the_ids_it_is_given():
    src, tgt_in, tgt_out = collate([[5]], [[6]], pad_id=9, bos_id=7, eos_id=8)
    assert src.tolist() == [[5, 8]] and tgt_in.tolist() == [[7, 6]] and tgt_out.tolist() == [[6, 8]]


def test_collate_rejects_bad_batches():
    with pytest.raises(DataError, match="empty batch"):
        collate([], [], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    with pytest.raises(DataError, match="2 sources but 1 targets"):
        collate([[1], [2]], [[1]], pad_id=PAD, bos_id=BOS, eos_id=EOS)


@pytest.mark.parametrize("size", ["inf", "nan", "-inf", "2.5", "0", "-1"])
@pytest.mark.parametrize("flag", ["--dev", "--test"])
def test_qkv_split_refuses_a_size_that_is_neither_a_share_nor_a_whole_count_in_one_line(tmp_path, capsys, flag, size):
    """Issue 84: --dev inf or nan ended in a traceback (int(size)), and --dev 2.5 meant 2."""
    from qkv.cli.main import main

    (tmp_path / "c.tsv").write_text("".join(f"s{i}\tt{i}\n" for i in range(50)), encoding="utf-8")
    code = main(["split", "--src", str(tmp_path / "c.tsv"), "--out", str(tmp_path / "out"), f"{flag}={size}"])
    err = capsys.readouterr().err
    assert code != 0 and flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_held_out_size_is_a_share_below_1_or_a_whole_count():
    from qkv.data.split import held_out_size

    assert (held_out_size(0.1, 50), held_out_size(3, 50), held_out_size(3.0, 50), held_out_size(None, 50)) == (5, 3, 3, 2)
    for size in (2.5, float("inf"), float("nan"), 0.0):
        with pytest.raises(QkvError):
            held_out_size(size, 50)
