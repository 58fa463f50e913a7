"""Prepared corpora (`qkv prepare`): encoded once, filtered and counted, mapped by training, resumed bitwise."""

from __future__ import annotations

import dataclasses
import gzip
import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import require_multi30k
from test_train import RecordingTrainer, same_weights

from qkv.data.corpus import DataError
from qkv.data.tokenizer import Tokenizer
from qkv.io.prepared import Filters, MappedSide, _sample, load_prepared, prepare
from qkv.data.tasks import date_pairs
from qkv.train.recipes import build_configs
from qkv.train.trainer import Trainer
from qkv.infer import shortlist


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, list[tuple[str, str]]]:
    """600 date pairs in two gzipped files, with one empty side, one copy, one duplicate, one overlong pair
    and one whose source is many times longer than its target."""
    where = tmp_path_factory.mktemp("corpus")
    pairs = date_pairs(600, seed=5)
    pairs[10] = ("", pairs[10][1])  # an empty source
    pairs[20] = ("2017-05-09", "2017-05-09")  # the source is its target
    pairs[30] = pairs[31]  # a duplicate
    pairs[40] = (" ".join(["9 mai 2017"] * 40), pairs[40][1])  # far longer than max_len
    pairs[50] = (" ".join(["9 mai 2017"] * 6), "2017")  # many times its target's length
    src, tgt = where / "train.src.gz", where / "train.tgt.gz"
    with gzip.open(src, "wt", encoding="utf-8") as a, gzip.open(tgt, "wt", encoding="utf-8") as b:
        for s, t in pairs:
            a.write(s + "\n")
            b.write(t + "\n")
    return src, tgt, pairs


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    src, tgt, _ = corpus
    out = tmp_path_factory.mktemp("prep") / "dates"
    prepare(src, tgt, out, vocab_size=120, max_len=40, workers=2, filters=Filters(ratio=9), progress=False)
    return out


def test_every_filter_is_counted_and_the_arrays_hold_the_kept_pairs_in_order(corpus, prepared):
    _, _, pairs = corpus
    manifest = json.loads((prepared / "prepared.json").read_text())
    held = 600 // 20  # no validation files: the last 5% held out
    counts = manifest["counts"]
    assert counts["read"] == 600 - held and manifest["valid_pairs"] == held
    assert counts["dropped"] == {"empty": 1, "too_long": 1, "ratio": 1, "duplicates": 1, "copies": 1}
    assert counts["kept"] == counts["read"] - 5
    loaded = load_prepared(prepared)
    ids = loaded.train_ids(max_len=40)
    assert isinstance(ids.src_ids, MappedSide) and len(ids.src_ids) == counts["kept"]
    kept = [p for i, p in enumerate(pairs[: 600 - held]) if i not in (10, 20, 31, 40, 50)]  # 31 repeats 30, which is kept
    tok = loaded.tokenizer
    for i in (0, 7, len(kept) - 1):
        assert tok.decode(ids.src_ids[i]) == kept[i][0] and tok.decode(ids.tgt_ids[i]) == kept[i][1]
    assert list(ids.src_ids.lengths()[:5]) == [len(ids.src_ids[i]) for i in range(5)]
    assert loaded.valid.tgt == [t for _, t in pairs[600 - held :]]


def test_filters_can_be_switched_off(corpus, tmp_path):
    src, tgt, _ = corpus
    off = Filters(empty=False, too_long=False, ratio=0, duplicates=False, copies=False)
    summary = prepare(src, tgt, tmp_path / "all", vocab_size=120, max_len=40, workers=1, filters=off, progress=False)
    assert summary.counts.kept == summary.counts.read == 570 and summary.counts.truncated == 1


def test_a_killed_preparation_leaves_nothing_that_looks_prepared_and_the_next_one_starts_clean(corpus, tmp_path):
    src, tgt, _ = corpus
    big = tmp_path / "big.tsv"  # enough pairs to be killed in the middle of encoding
    big.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(200_000, seed=1)), encoding="utf-8")
    out = tmp_path / "prep"
    process = subprocess.Popen([sys.executable, "-m", "qkv", "prepare", "--train-src", str(big), "--out", str(out),
                                "--vocab-size", "120", "--no-progress", "--workers", "1"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "prep.tmp" / "train.src.ids").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read()
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists() and (tmp_path / "prep.tmp" / ".qkv-save").is_file()  # not complete, and marked as qkv's
    prepare(src, tgt, out, vocab_size=120, max_len=40, workers=1, progress=False)
    assert load_prepared(out).manifest["counts"]["kept"] > 0 and not (tmp_path / "prep.tmp").exists()


def test_a_users_directory_named_like_the_temporary_one_is_never_deleted(corpus, tmp_path):
    src, tgt, _ = corpus
    (tmp_path / "prep.tmp").mkdir()
    (tmp_path / "prep.tmp" / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match="qkv did not write it"):
        prepare(src, tgt, tmp_path / "prep", vocab_size=120, workers=1, progress=False)
    assert (tmp_path / "prep.tmp" / "notes.txt").read_text() == "mine\n"


def configs(prepared: Path, **train):
    return build_configs("tiny", model={"dropout": 0.1},
                         train={"threads": 1, "eval_every": 1000, "tune_length_penalty": False, **train},
                         data={"corpus": "prepared", "data_dir": str(prepared), "train_limit": 0})


def test_training_maps_the_arrays_and_resumes_bitwise_across_an_epoch(prepared, tmp_path):
    model, train, data = configs(prepared)
    probe = Trainer(tmp_path / "probe", model, train, data)
    assert isinstance(probe.train_ids.src_ids, MappedSide)  # mapped, not loaded into lists
    assert probe.tokenizer.model_proto == load_prepared(prepared).tokenizer.model_proto
    per_epoch = len(probe.batches(0))
    end = per_epoch + 3
    whole = RecordingTrainer(tmp_path / "whole", model, dataclasses.replace(train, max_steps=end), data)
    whole.run(progress=False)
    part = RecordingTrainer(tmp_path / "run", model, dataclasses.replace(train, max_steps=per_epoch - 2), data)
    part.run(progress=False)
    resumed = RecordingTrainer.resume(tmp_path / "run", max_steps=end)
    resumed.run(progress=False)
    assert resumed.epoch >= 1  # the resumed run crossed into the second epoch
    assert part.losses + resumed.losses == whole.losses
    assert same_weights(resumed.model, whole.model)


def test_qkv_train_takes_a_prepared_directory_as_its_data_dir(prepared, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--data-dir", str(prepared), "--out", str(tmp_path / "run"),
         "--max-steps", "4", "--train", "eval_every=2", "threads=1", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    start = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[0])
    assert start["train_pairs"] == 500  # the tiny preset's train_limit, of the prepared pairs

    # qkv shortlist counts the run's own training pairs: the prepared arrays, as the run read them
    added = subprocess.run([sys.executable, "-m", "qkv", "shortlist", "--checkpoint", str(tmp_path / "run"), "--k", "3"],
                           capture_output=True, text=True, timeout=120)
    assert added.returncode == 0, added.stderr
    ids = load_prepared(prepared).train_ids(40, 500)
    expected = shortlist.build(zip(ids.src_ids, ids.tgt_ids), src_vocab=120, tgt_vocab=120, k=3, always=(3,))
    final = tmp_path / "run" / "final"
    table = shortlist.load(final / "shortlist.safetensors", src_vocab=120, tgt_vocab=120)
    assert table.info["pairs"] == 500 and table.table.equal(expected.table) and table.frequent.equal(expected.frequent)
    refused = subprocess.run([sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--data-dir", str(prepared),
                              "--out", str(tmp_path / "run2"), "--data", "subword_dropout=0.1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "subword_dropout applies to text corpora" in refused.stderr


def test_guided_alignment_on_a_prepared_directory_trains_the_head_qkv_align_reads(prepared, tmp_path):
    """--train alignment=0.5 on a prepared directory: eflomal aligns the prepared pairs' ids (the run's
    500, read from the mapped arrays), the links are saved pair by pair as a text corpus's are, the run
    records the head, and qkv align reads that head by default."""
    pytest.importorskip("eflomal")
    from qkv.io import checkpoint
    from qkv.train.alignment import LINKS_FILE, align_pieces, default_alignment_layer, load_links, pieces_digest

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--data-dir", str(prepared), "--out", str(run),
         "--max-steps", "4", "--train", "eval_every=4", "threads=1", "alignment=0.5", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "eflomal aligns the 500 training pairs" in result.stderr
    config = checkpoint.load(run / "final").model.config
    layer = default_alignment_layer(config.n_decoder_layers)
    assert (config.alignment_layer, config.alignment_context) == (layer, "full")
    ids = load_prepared(prepared).train_ids(40, 500)
    links = load_links(run / LINKS_FILE, pieces_digest(ids.src_ids, ids.tgt_ids))  # saved for exactly these pieces
    assert links is not None and len(links) == 500
    assert (links.counts > 0).mean() > 0.9  # nearly every pair has links, each inside its own pair:
    assert all(links[i][:, 0].max(initial=0) < len(ids.src_ids[i]) and links[i][:, 1].max(initial=0) < len(ids.tgt_ids[i])
               for i in range(500))
    # eflomal again on the same ids, as lists (a text corpus's form): its samplers run in threads, so not
    # the same links, but most of each pair's (0.73 to 0.88 measured), where pair i against pair i + 1's share 0.16
    again = align_pieces([ids.src_ids[i] for i in range(500)], [ids.tgt_ids[i] for i in range(500)], seed=1)
    shared = sum(len(set(map(tuple, links[i].tolist())) & set(map(tuple, again[i].tolist()))) for i in range(500))
    assert shared > 0.5 * len(links.flat)

    valid = load_prepared(prepared).valid
    (tmp_path / "s").write_text("".join(x + "\n" for x in valid.src[:6]))
    (tmp_path / "r").write_text("".join(x + "\n" for x in valid.tgt[:6]))
    align = lambda *a: subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(run), "-i", str(tmp_path / "s"),  # noqa: E731
                                       "-r", str(tmp_path / "r"), *a], capture_output=True, text=True, timeout=120)
    default = align()
    assert default.returncode == 0, default.stderr
    assert default.stdout == align("--method", "attention", "--layer", str(layer + 1), "--head", "1", "--link", "source").stdout
    for line, sentence in zip(default.stdout.splitlines(), valid.src[:6], strict=True):  # read from the source side: each word once
        assert sorted(int(link.split("-")[0]) for link in line.split()) == list(range(len(sentence.split())))


def test_torchrun_trains_two_ranks_on_a_prepared_directory(prepared, tmp_path):
    """Both ranks map the same arrays and step on their shares; the run ends with a final/ that translates."""
    import os

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "qkv", "train",
         "--preset", "tiny", "--data-dir", str(prepared), "--out", str(run), "--max-steps", "6", "--train", "eval_every=3",
         "tune_length_penalty=false", "--no-progress"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log[0]["event"] == "start" and log[0]["world_size"] == 2 and log[0]["train_pairs"] == 500
    assert [r["step"] for r in log if r["event"] == "valid"] == [3, 6]
    translated = subprocess.run([sys.executable, "-m", "qkv", "translate", "--checkpoint", str(run), "--beam", "1"],
                                input="9 mai 2017\n", capture_output=True, text=True, timeout=120)
    assert translated.returncode == 0 and len(translated.stdout.splitlines()) == 1, translated.stderr


def test_a_damaged_tokenizer_or_array_is_refused_before_it_is_parsed(prepared, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(prepared, damaged)
    data = bytearray((damaged / "tokenizer.model").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    (damaged / "tokenizer.model").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tokenizer.model fails its SHA-256 check"):
        load_prepared(damaged)
    shutil.copy(prepared / "tokenizer.model", damaged / "tokenizer.model")
    with open(damaged / "train.src.ids", "ab") as handle:
        handle.write(b"\0\0")  # an array of another size than recorded
    with pytest.raises(ValueError, match="train.src.ids is missing or not the size"):
        load_prepared(damaged)


def test_resume_refuses_a_directory_prepared_again_with_another_tokenizer(corpus, tmp_path):
    src, tgt, _ = corpus
    data_dir = tmp_path / "data"
    prepare(src, tgt, data_dir, vocab_size=120, max_len=40, workers=1, filters=Filters(ratio=9), progress=False)
    model, train, data = configs(data_dir, max_steps=2)
    Trainer(tmp_path / "run", model, train, data).run(progress=False)
    import shutil

    shutil.rmtree(data_dir)  # prepared again, in its place, with another vocabulary
    prepare(src, tgt, data_dir, vocab_size=100, max_len=40, workers=1, filters=Filters(ratio=9), progress=False)
    with pytest.raises(ValueError, match="holds another tokenizer than the run"):
        Trainer.resume(tmp_path / "run", max_steps=4)


def test_several_corpora_are_prepared_as_one_read_in_order(corpus, tmp_path):
    _, _, pairs = corpus
    files = {}
    for name, part in (("a", pairs[:250]), ("b", pairs[250:400]), ("c", pairs[400:])):
        for side, k in (("src", 0), ("tgt", 1)):
            files[name, side] = tmp_path / f"{name}.{side}"
            files[name, side].write_text("".join(p[k] + "\n" for p in part), encoding="utf-8")
    whole_src, whole_tgt = tmp_path / "all.src", tmp_path / "all.tgt"
    whole_src.write_text("".join(files[n, "src"].read_text() for n in "abc"), encoding="utf-8")
    whole_tgt.write_text("".join(files[n, "tgt"].read_text() for n in "abc"), encoding="utf-8")
    kwargs = dict(vocab_size=120, max_len=40, workers=1, progress=False)
    prepare([files[n, "src"] for n in "abc"], [files[n, "tgt"] for n in "abc"], tmp_path / "three", **kwargs)
    prepare(whole_src, whole_tgt, tmp_path / "one", **kwargs)
    three, one = json.loads((tmp_path / "three" / "prepared.json").read_text()), json.loads((tmp_path / "one" / "prepared.json").read_text())
    assert three["counts"] == one["counts"] and three["counts"]["read"] == 570
    assert three["files"] == one["files"]  # every array and the tokenizer, byte for byte (SHA-256)
    assert three["sources"][:3] == [str(files[n, "src"]) for n in "abc"]
    refused = subprocess.run([sys.executable, "-m", "qkv", "prepare", "--train-src", str(files["a", "src"]), str(files["b", "src"]),
                              "--train-tgt", str(files["a", "tgt"]), "--out", str(tmp_path / "no")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "2 source file(s) but 1 target file(s)" in refused.stderr
    assert not (tmp_path / "no").exists()


def test_prepared_without_filters_trains_exactly_as_the_text_files_do(corpus, tmp_path):
    """The same pairs, tokenizer, batches and updates: a prepared corpus changes where the ids live, not the run."""
    pairs = date_pairs(400, seed=11)
    files = {}
    for split, part in (("train", pairs[:360]), ("valid", pairs[360:])):
        for side, k in (("src", 0), ("tgt", 1)):
            files[split, side] = tmp_path / f"{split}.{side}"
            files[split, side].write_text("".join(p[k] + "\n" for p in part), encoding="utf-8")
    off = Filters(empty=True, too_long=False, ratio=0, duplicates=False, copies=False)  # the text path skips empty pairs too
    prepare(files["train", "src"], files["train", "tgt"], tmp_path / "prep", valid_src=files["valid", "src"],
            valid_tgt=files["valid", "tgt"], vocab_size=120, max_len=40, seed=7, workers=1, filters=off, progress=False)
    train = {"threads": 1, "eval_every": 1000, "tune_length_penalty": False, "seed": 7, "max_steps": 12}
    text_data = {"corpus": "files", "train_src": str(files["train", "src"]), "train_tgt": str(files["train", "tgt"]),
                 "valid_src": str(files["valid", "src"]), "valid_tgt": str(files["valid", "tgt"]), "vocab_size": 120, "train_limit": 0}
    runs = {}
    for name, data in (("text", text_data), ("prepared", {"corpus": "prepared", "data_dir": str(tmp_path / "prep"), "train_limit": 0})):
        runs[name] = RecordingTrainer(tmp_path / name, *build_configs("tiny", model={}, train=train, data=data))
    assert runs["text"].tokenizer.model_proto == runs["prepared"].tokenizer.model_proto
    assert list(runs["text"].batches(0)) == list(runs["prepared"].batches(0))
    for run in runs.values():
        run.run(progress=False)
    assert runs["text"].losses == runs["prepared"].losses and len(runs["text"].losses) == 12
    assert same_weights(runs["text"].model, runs["prepared"].model)


def test_without_validation_files_the_held_out_pairs_stay_out_of_the_tokenizer(tmp_path):
    """As ``qkv train`` holds the last 5% of text files out, so does ``qkv prepare``, and its tokenizer
    learns from the training pairs only: the text run and the prepared run get one tokenizer and the
    same validation pairs. The held-out pairs carry letters no training pair has, so a tokenizer that
    saw them would have other pieces."""
    pairs = date_pairs(400, seed=11)
    held = 400 // 20
    pairs[-held:] = [(f"zqx {s}", f"zqx {t}") for s, t in pairs[-held:]]
    assert not any("q" in s + t for s, t in pairs[:-held])
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    tgt.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    off = Filters(empty=True, too_long=False, ratio=0, duplicates=False, copies=False)
    prepare(src, tgt, tmp_path / "prep", vocab_size=120, max_len=40, seed=7, workers=1, filters=off, progress=False)
    train = {"threads": 1, "eval_every": 1000, "tune_length_penalty": False, "seed": 7, "max_steps": 1}
    text = Trainer(tmp_path / "text", *build_configs("tiny", model={}, train=train, data={
        "corpus": "files", "train_src": str(src), "train_tgt": str(tgt), "vocab_size": 120}))
    mapped = load_prepared(tmp_path / "prep")
    assert mapped.tokenizer.model_proto == text.tokenizer.model_proto
    assert mapped.valid.src == text.valid_data.src == [s for s, _ in pairs[-held:]]
    leaky = Tokenizer.train([s for s, _ in pairs] + [t for _, t in pairs], 120, tmp_path / "leaky.model", seed=7)
    assert leaky.model_proto != mapped.tokenizer.model_proto  # what the test would see if they leaked in


def test_the_tokenizer_sample_skips_the_held_out_tail_at_any_size():
    """Past 1,000 pairs the tail is held back as it is read; a sample smaller than the corpus is
    drawn from the training pairs alone, and without holding out it may draw from every pair."""
    pairs = [(f"s{i}", f"t{i}") for i in range(3000)]  # 150 held out: held_out(3000)
    whole, n = _sample(iter(pairs), 5000, 1, hold_out=True)
    assert n == 3000 and whole == [s for s, _ in pairs[:2850]] + [t for _, t in pairs[:2850]]
    small, _ = _sample(iter(pairs), 400, 1, hold_out=True)
    drawn = {int(s[1:]) for s in small[:400]}
    assert len(drawn) == 400 and max(drawn) < 2850 and max(drawn) > 2000  # uniform over the 2,850
    free, _ = _sample(iter(pairs), 5000, 1, hold_out=False)
    assert free == [s for s, _ in pairs] + [t for _, t in pairs]


def test_a_corpus_too_small_to_hold_validation_out_asks_for_validation_files(tmp_path):
    (tmp_path / "one.tsv").write_text("9 mai 2017\t2017-05-09\n", encoding="utf-8")
    with pytest.raises(DataError, match="too few to hold some out for validation.*give --valid-src"):
        prepare(tmp_path / "one.tsv", None, tmp_path / "prep", vocab_size=120, progress=False)
    assert not (tmp_path / "prep").exists() and not (tmp_path / "prep.tmp").exists()


def test_multi30k_prepared_without_filters_gives_the_multi30k_presets_own_run(tmp_path):
    """Tokenizer, ids, validation pairs and batches all equal: with the same seed, the preset's run itself."""
    data_dir = require_multi30k()
    out = tmp_path / "m30k"
    prepare(data_dir / "train.en.gz", data_dir / "train.de.gz", out, valid_src=data_dir / "val.en.gz", valid_tgt=data_dir / "val.de.gz",
            workers=2, filters=Filters(too_long=False, ratio=0, duplicates=False, copies=False), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's held peak without --max-steps: beside the point here
        text = Trainer(tmp_path / "text", *build_configs("multi30k", model={}, train={}, data={"data_dir": str(data_dir)}))
        mapped = Trainer(tmp_path / "prepared", *build_configs("multi30k", model={}, train={}, data={"corpus": "prepared", "data_dir": str(out)}))
    assert text.tokenizer.model_proto == mapped.tokenizer.model_proto
    assert (text.valid_data.src, text.valid_data.tgt) == (mapped.valid_data.src, mapped.valid_data.tgt)
    n = len(text.train_ids.src_ids)
    assert n == len(mapped.train_ids.src_ids) == 29_000
    for i in range(0, n, 97):
        assert (text.train_ids.src_ids[i], text.train_ids.tgt_ids[i]) == (mapped.train_ids.src_ids[i], mapped.train_ids.tgt_ids[i])
    assert list(text.batches(0)) == list(mapped.batches(0)) and list(text.batches(5)) == list(mapped.batches(5))


# ---- what qkv prepare reads, and what a prepared directory must be before training uses it ----------


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if ``qkv prepare`` starts working (trains its tokenizer) before its checks end."""
    def train(*args, **kwargs):
        raise AssertionError("the tokenizer was trained before the input was checked")

    monkeypatch.setattr(Tokenizer, "train", train)


@pytest.mark.parametrize("short", ["tgt", "src"])
def test_sides_of_different_lengths_are_refused_before_any_work(tmp_path, no_work, short):
    """A target one line short used to shift every later pair by one (zip had read the source's extra line)."""
    pairs = date_pairs(200, seed=2)
    src = _write(tmp_path / "a.src", [s for s, _ in pairs][: 199 if short == "src" else 200])
    tgt = _write(tmp_path / "a.tgt", [t for _, t in pairs][: 199 if short == "tgt" else 200])
    counts = {"src": 199, "tgt": 200} if short == "src" else {"src": 200, "tgt": 199}
    with pytest.raises(DataError, match=rf"line counts differ: {src} has {counts['src']} lines but {tgt} has {counts['tgt']};"):
        prepare(src, tgt, tmp_path / "prep", vocab_size=120, workers=1, progress=False)
    assert not (tmp_path / "prep").exists() and not (tmp_path / "prep.tmp").exists()


@pytest.mark.parametrize("suffix", [".gz", ".xz", ".bz2"])
def test_a_truncated_archive_is_one_line_naming_it_before_any_work(tmp_path, no_work, suffix):
    import bz2
    import lzma

    compress = {".gz": gzip.compress, ".xz": lzma.compress, ".bz2": bz2.compress}[suffix]
    data = compress("".join(f"{s}\t{t}\n" for s, t in date_pairs(3000, seed=2)).encode())
    path = tmp_path / f"train.tsv{suffix}"
    path.write_bytes(data[: len(data) // 2])
    kind = {".gz": "gzip", ".xz": "xz", ".bz2": "bzip2"}[suffix]
    with pytest.raises(DataError, match=rf"{path}: corrupt or truncated {kind} file near line \d+"):
        prepare(path, None, tmp_path / "prep", vocab_size=120, workers=1, progress=False)
    assert not (tmp_path / "prep").exists() and not (tmp_path / "prep.tmp").exists()


def test_a_line_longer_than_a_mebibyte_is_refused_naming_it(tmp_path, no_work):
    tsv = _write(tmp_path / "train.tsv", ["9 mai 2017\t2017-05-09", "1 mai 2017\t2017-05-01", "x" * (1 << 20) + "\t2017"])
    with pytest.raises(DataError, match=rf"{tsv}: line 3 is longer than 1,048,576 bytes"):
        prepare(tsv, None, tmp_path / "prep", vocab_size=120, workers=1, progress=False)


def test_a_blank_tsv_line_is_an_empty_pair_as_qkv_train_counts_it(tmp_path):
    from qkv.data.corpus import read_tsv

    lines = [f"{s}\t{t}" for s, t in date_pairs(200, seed=2)]
    lines.insert(5, "")
    tsv = _write(tmp_path / "train.tsv", lines)
    summary = prepare(tsv, None, tmp_path / "prep", vocab_size=120, workers=1, progress=False)
    assert summary.counts.dropped["empty"] == 1 and summary.counts.read == 201 - 10  # 10 held out
    assert read_tsv(tsv).skipped_empty == 1  # qkv train's count of the same file


def test_compressed_validation_files_are_read_and_checked_before_any_work(tmp_path, monkeypatch):
    import lzma

    pairs = date_pairs(300, seed=4)
    src, tgt = _write(tmp_path / "train.src", [s for s, _ in pairs[:260]]), _write(tmp_path / "train.tgt", [t for _, t in pairs[:260]])
    valid = {}
    for side, k in (("src", 0), ("tgt", 1)):
        valid[side] = tmp_path / f"valid.{side}.xz"
        valid[side].write_bytes(lzma.compress("".join(p[k] + "\n" for p in pairs[260:]).encode()))
    prepare(src, tgt, tmp_path / "prep", valid_src=valid["src"], valid_tgt=valid["tgt"], vocab_size=120, workers=1, progress=False)
    assert load_prepared(tmp_path / "prep").valid.tgt == [t for _, t in pairs[260:]]
    bad = tmp_path / "bad.tgt.xz"
    bad.write_bytes(valid["tgt"].read_bytes()[:-20])
    monkeypatch.setattr(Tokenizer, "train", lambda *a, **k: pytest.fail("trained before the validation files were read"))
    with pytest.raises(DataError, match=rf"{bad}: corrupt or truncated xz"):
        prepare(src, tgt, tmp_path / "again", valid_src=valid["src"], valid_tgt=bad, vocab_size=120, workers=1, progress=False)


def _damaged_copy(prepared: Path, where: Path, edit=None) -> Path:
    import shutil

    shutil.copytree(prepared, where)
    if edit:
        manifest = json.loads((where / "prepared.json").read_text())
        edit(manifest)
        (where / "prepared.json").write_text(json.dumps(manifest))
    return where


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(dtype="float16"), "dtype must be uint16 for a vocabulary of 120, got 'float16'"),
    (lambda m: m.update(dtype="int32"), "dtype must be uint16"),
    (lambda m: m.pop("dtype"), "dtype must be uint16"),
    (lambda m: m["counts"].update(kept="570"), "counts.kept must be an integer >= 0, got '570'"),
    (lambda m: m.update(vocab_size=100), "records a vocabulary of 100, its tokenizer has 120"),
    (lambda m: m["counts"].update(kept=m["counts"]["kept"] - 1), "train.src's arrays are damaged .their sizes do not agree"),
    (lambda m: m["files"].pop("valid.tgt.txt"), "must list exactly the files qkv prepare writes"),
    (lambda m: m["files"].update({"../notes.txt": m["files"]["valid.tgt.txt"]}), "must list exactly the files qkv prepare writes"),
])  # fmt: skip
def test_an_edited_manifest_is_one_line_before_training_maps_anything(prepared, tmp_path, edit, message):
    """Another dtype used to train silently on misread ids; a missing or mistyped field crashed."""
    damaged = _damaged_copy(prepared, tmp_path / "damaged", edit)
    with pytest.raises(DataError, match=message):
        load_prepared(damaged)


@pytest.mark.parametrize("damage", ["ids", "offsets"])
def test_overwrite_with_damaged_arrays_fails_in_one_line_and_deletes_nothing(prepared, tmp_path, capsys, damage):
    """Arrays of the recorded sizes but with an id out of the vocabulary, or offsets out of order, used
    to be read first after --overwrite had deleted the old run (an IndexError traceback)."""
    import numpy as np
    from conftest import snapshot

    from qkv.cli.main import main

    run = tmp_path / "run"
    model, train, data = configs(prepared, max_steps=1, average_last=1, keep_last=1)
    Trainer(run, model, train, data).run(progress=False)
    before = snapshot(run)
    damaged = _damaged_copy(prepared, tmp_path / "damaged")
    name, dtype = ("train.tgt.ids", np.uint16) if damage == "ids" else ("train.src.offsets", np.int64)
    array = np.fromfile(damaged / name, dtype=dtype)
    if damage == "ids":
        array[7] = 200  # the vocabulary has 120 pieces
    else:
        array[5] = array[7]  # pair 5 ends before it starts
    array.tofile(damaged / name)
    code = main(["train", "--preset", "tiny", "--data-dir", str(damaged), "--out", str(run), "--overwrite", "--max-steps", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    what = "ids outside the vocabulary of 120" if damage == "ids" else "pair 5 ends before it starts"
    assert f"train.{'tgt' if damage == 'ids' else 'src'}'s arrays are damaged ({what})" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("listed", [False, True])
def test_a_fifo_in_a_prepared_directory_is_refused_not_read(prepared, tmp_path, listed):
    """A validation file left out of the manifest and replaced by a FIFO used to hang qkv train."""
    import os
    import threading

    damaged = _damaged_copy(prepared, tmp_path / "damaged", None if listed else lambda m: m["files"].pop("valid.src.txt"))
    fifo = damaged / "valid.src.txt"
    fifo.unlink()
    os.mkfifo(fifo)
    errors: list[str] = []

    def load() -> None:
        try:
            load_prepared(damaged)
        except DataError as error:
            errors.append(str(error))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    hung = thread.is_alive()
    if hung:  # let the reader go: a writer that opens and closes the FIFO gives it an end of file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not hung, "reading the prepared directory waited on the FIFO"
    expected = f"{fifo} is not a regular file" if listed else f"{damaged / 'prepared.json'} must list exactly the files qkv prepare writes"
    assert len(errors) == 1 and errors[0].startswith(expected), errors
