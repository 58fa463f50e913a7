"""docs/own-data.md's steps, end to end, on a corpus of another size than Multi30k's: 3,000 pairs of
Multi30k's En-Fr training captions, split by ``qkv split`` (dev and test held out, sharing no sentence
with training), a few updates of ``--preset tiny``, evaluation on the held-out test set, calibration on
dev, ``--confidence`` and a glossary."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_multi30k

from qkv.data.split import split_corpus
from qkv.errors import DataError


def qkv(*args, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], cwd=cwd, input=stdin, capture_output=True,
                          text=True)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_split_holds_out_dev_and_test_sharing_no_sentence_with_training_and_never_overwrites(tmp_path):
    corpus = [(f"s{i % 40}", f"t{i % 40}") for i in range(200)]  # every sentence five times
    (tmp_path / "c.de").write_text("".join(s + "\n" for s, _ in corpus) + " \n")
    (tmp_path / "c.en").write_text("".join(t + "\n" for _, t in corpus) + "x\n")
    counts = split_corpus(tmp_path / "c.de", tmp_path / "c.en", tmp_path / "out", dev=3, test=0.02, seed=2)
    train, dev, test = ({*zip(_lines(tmp_path / "out" / f"{n}.de"), _lines(tmp_path / "out" / f"{n}.en"))} for n in ("train", "dev", "test"))
    assert (counts.read, counts.empty, counts.dev, counts.test, len(dev), len(test)) == (201, 1, 3, 4, 3, 4)
    sentences = lambda pairs: {x for pair in pairs for x in pair}  # noqa: E731
    assert not sentences(train) & sentences(dev) and not sentences(train) & sentences(test) and not sentences(dev) & sentences(test)
    assert counts.train + counts.dev + counts.test + counts.overlapping == 200 and counts.train == 165  # 7 of 40 held out
    with pytest.raises(DataError, match="not an empty directory"):  # what is there stays
        split_corpus(tmp_path / "c.de", tmp_path / "c.en", tmp_path / "out")
    (tmp_path / "c.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in corpus))  # one TSV: .src and .tgt, not .tsv
    tsv = split_corpus(tmp_path / "c.tsv", None, tmp_path / "tsv", dev=3, test=3, seed=2)
    assert sorted(p.name for p in tsv.files.values()) == sorted(f"{n}.{side}" for n in ("train", "dev", "test") for side in ("src", "tgt"))
    assert all("\t" not in line for line in _lines(tmp_path / "tsv" / "train.src"))


def test_the_own_data_guide_runs_end_to_end_on_3000_pairs(tmp_path):
    data = require_multi30k()
    for lang in ("en", "fr"):
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            (tmp_path / f"corpus.{lang}").write_text("".join(next(f) for _ in range(3000)), encoding="utf-8")
    out = qkv("split", "--src", "corpus.en", "--tgt", "corpus.fr", "--out", "split", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("split 3,000 pairs: train ")
    s = tmp_path / "split"
    train, dev, test = ({*_lines(s / f"{n}.en")} for n in ("train", "dev", "test"))
    assert len(_lines(s / "dev.en")) == len(_lines(s / "dev.fr")) == 150 == len(_lines(s / "test.fr"))
    assert not train & dev and not train & test and not dev & test
    out = qkv("train", "--preset", "tiny", "--train-src", "split/train.en", "--train-tgt", "split/train.fr",
              "--valid-src", "split/dev.en", "--valid-tgt", "split/dev.fr", "--src", "en", "--tgt", "fr",
              "--out", "runs/en-fr", "--max-steps", "30", "--train", "calibrate=true", "alignment=0.5", "--no-progress",
              cwd=tmp_path)  # as docs/own-data.md trains: with the alignment head
    assert out.returncode == 0, out.stderr
    assert "training" in out.stderr and "note: this run reads only the first 500 training pairs" in out.stderr
    out = qkv("evaluate", "--checkpoint", "runs/en-fr", "--src-file", "split/test.en", "--ref-file", "split/test.fr", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "test.en|test.fr: 150 sentences" in out.stdout and "BLEU" in out.stdout
    assert (tmp_path / "runs" / "en-fr" / "final" / "confidence.json").is_file()  # qkv train calibrated it
    out = qkv("calibrate", "--checkpoint", "runs/en-fr", "--valid-src", "split/dev.en", "--valid-tgt", "split/dev.fr",
              "--force", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "runs" / "en-fr" / "final" / "confidence.json").is_file()
    out = qkv("translate", "--checkpoint", "runs/en-fr", "--confidence", cwd=tmp_path, stdin="A man rides a bike on the beach.\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1 and 0 <= float(out.stdout.split("\t")[1]) <= 1
    assert (tmp_path / "runs" / "en-fr" / "alignment-links.npz").is_file()
    out = qkv("translate", "--checkpoint", "runs/en-fr", "--confidence", "json", cwd=tmp_path, stdin="A man rides a bike on the beach.\n")
    assert out.returncode == 0, out.stderr
    assert 0 <= json.loads(out.stdout)["omission"] <= 1  # read from the head the run trained
    (tmp_path / "terms.tsv").write_text("bike\tvélo\n", encoding="utf-8")
    out = qkv("translate", "--checkpoint", "runs/en-fr", "--glossary", "terms.tsv", cwd=tmp_path, stdin="A man rides a bike on the beach.\n")
    assert out.returncode == 0, out.stderr
    assert "vélo" in out.stdout
