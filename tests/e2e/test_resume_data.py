"""``--resume`` continues on the data the run started on: a run records its files by resolved path and
by size and SHA-256 (a prepared directory by its manifest's), and refuses in one line data that changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qkv.data.corpus import DataError
from qkv.data.tasks import date_pairs
from qkv.io.prepared import Filters, prepare
from qkv.train.recipes import build_configs
from qkv.train.trainer import Trainer

TRAIN = {"threads": 1, "eval_every": 1000, "tune_length_penalty": False, "max_steps": 1, "average_last": 1, "keep_last": 1}


def _tsv(path: Path, n: int, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(n, seed=seed)), encoding="utf-8")
    return path


def _start_pairs(run: Path) -> list[int]:
    return [r["train_pairs"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["event"] == "start"]


def test_a_run_given_relative_paths_resumes_on_its_own_files_from_any_directory(tmp_path, monkeypatch):
    """Resumed from another directory, a run used to read that directory's data/train.tsv (another corpus) and exit 0."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    _tsv(here / "data" / "train.tsv", 200, seed=1)
    _tsv(elsewhere / "data" / "train.tsv", 100, seed=2)
    monkeypatch.chdir(here)
    model, train, data = build_configs("tiny", model={}, train=TRAIN, data={"corpus": "files", "train_src": "data/train.tsv",
                                                                             "vocab_size": 120, "src_lang": "fr", "tgt_lang": "en"})
    Trainer("run", model, train, data).run(progress=False)
    saved = json.loads((here / "run" / "last" / "config.json").read_text())
    assert saved["data"]["train_src"] == str(here / "data" / "train.tsv")
    monkeypatch.chdir(elsewhere)
    Trainer.resume(here / "run", max_steps=2).run(progress=False)
    assert _start_pairs(here / "run") == [190, 190]  # 200 less the 10 held out, both times

    _tsv(here / "data" / "train.tsv", 200, seed=3)  # the same name, other pairs: refused before a step
    with pytest.raises(DataError, match=rf"--resume {here / 'run'}: the data is not what the run started on: "
                                         rf"train_src {here / 'data' / 'train.tsv'} changed since"):
        Trainer.resume(here / "run", max_steps=3)


def test_a_prepared_directory_rebuilt_with_other_settings_is_refused_on_resume(tmp_path):
    """Prepared again with the same tokenizer but another --max-len, it used to be continued on silently
    (other pairs): only the tokenizer was compared."""
    tsv = _tsv(tmp_path / "train.tsv", 300, seed=4)
    data_dir = tmp_path / "prep"
    prepare(tsv, None, data_dir, vocab_size=120, max_len=40, workers=1, filters=Filters(ratio=9), progress=False)
    configs = build_configs("tiny", model={}, train=TRAIN, data={"corpus": "prepared", "data_dir": str(data_dir), "train_limit": 0})
    Trainer(tmp_path / "run", *configs).run(progress=False)
    tokenizer = (data_dir / "tokenizer.model").read_bytes()
    shutil.rmtree(data_dir)
    prepare(tsv, None, data_dir, vocab_size=120, max_len=12, workers=1, filters=Filters(ratio=9), progress=False)
    assert (data_dir / "tokenizer.model").read_bytes() == tokenizer  # only the pairs kept differ
    with pytest.raises(DataError, match=rf"the data is not what the run started on: prepared {data_dir / 'prepared.json'} changed since"):
        Trainer.resume(tmp_path / "run", max_steps=2)
