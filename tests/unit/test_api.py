"""The library keeps the commands' promises: ``qkv.__all__`` is one documented list of stable names,
a Translator of a loaded checkpoint searches with the checkpoint's chosen settings, and a Trainer
refuses a directory that holds a run (or anything else) unless told to resume or start over."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import qkv
from qkv.errors import QkvError
from qkv.io import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def documented_names() -> list[str]:
    """The names of the table under "## The Python API" in docs/model.md."""
    text = (ROOT / "docs" / "model.md").read_text(encoding="utf-8")
    section = text.split("## The Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `qkv\.(\w+)` \|", section, flags=re.M)


def test_every_stable_name_is_importable_documented_and_has_a_docstring():
    documented = documented_names()
    assert sorted(documented) == sorted(qkv.__all__) and len(set(documented)) == len(documented)
    for name in qkv.__all__:
        value = getattr(qkv, name)
        assert (value.__doc__ or "").strip(), f"qkv.{name} has no docstring"
    namespace: dict = {}
    exec(f"from qkv import {', '.join(qkv.__all__)}", namespace)  # as a user imports them
    assert all(namespace[name] is getattr(qkv, name) for name in qkv.__all__)


def test_a_translator_of_a_loaded_checkpoint_searches_with_its_chosen_length_penalty(random_checkpoint, tmp_path):
    loaded = checkpoint.load(random_checkpoint)
    tuned = checkpoint.save(tmp_path / "tuned", loaded.model, loaded.tokenizer,
                            configs={"data": loaded.config["data"], "decode": {"length_penalty": 1.7}})
    reloaded = qkv.load_checkpoint(tuned)
    assert qkv.Translator(reloaded.model, reloaded.tokenizer).config == qkv.DecodeConfig(length_penalty=1.7)  # was 0.6
    assert qkv.Translator.from_checkpoint(tuned).config == qkv.DecodeConfig(length_penalty=1.7)
    assert qkv.Translator.from_checkpoint(random_checkpoint).config == qkv.DecodeConfig()  # none chosen: 0.6
    given = qkv.DecodeConfig(beam_size=2, length_penalty=0.2)
    assert qkv.Translator.from_checkpoint(tuned, given).config == given  # a config passed is used as given


def tiny(dates_tsv):
    return qkv.build_configs("tiny", model={}, train={"threads": 1}, data={
        "corpus": "files", "train_src": str(dates_tsv), "vocab_size": 60, "train_limit": 40, "src_lang": "fr", "tgt_lang": "en"})


def test_a_trainer_refuses_a_run_unless_told_to_resume_or_start_over(dates_tsv, tmp_path):
    import torch

    threads = torch.get_num_threads()
    try:
        run = tmp_path / "run"
        first = qkv.Trainer(run, *tiny(dates_tsv))
        first.save(run / "last")
        before = sorted(p.name for p in run.iterdir())
        with pytest.raises(QkvError, match=r"already holds a run: continue it .*Trainer.resume\(run_dir\)"):
            qkv.Trainer(run, *tiny(dates_tsv))  # was: wrote into it, replacing its checkpoints
        assert sorted(p.name for p in run.iterdir()) == before
        assert qkv.Trainer.resume(run).step == 0  # told to resume
        again = qkv.Trainer(run, *tiny(dates_tsv), start_over=True)  # told to start over
        assert "last" in again.deleted and not (run / "last").exists()
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("my notes\n")
        for start_over in (False, True):  # not a run: never used, with or without start_over
            with pytest.raises(QkvError, match="not empty and holds no qkv run"):
                qkv.Trainer(mine, *tiny(dates_tsv), start_over=start_over)
        assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    finally:
        torch.set_num_threads(threads)
