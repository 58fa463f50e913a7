"""What makes a directory a qkv run, and what --overwrite may delete in one (qkv.io.runs)."""

import json
from pathlib import Path

import pytest
from conftest import snapshot

from qkv.io import checkpoint, runs



def checkpoint_dir(path: Path, *, marked: bool) -> Path:
    """A directory holding only checkpoint-named files; ``marked``: with qkv's save marker."""
    path.mkdir()
    (path / checkpoint.CONFIG).write_text('{"model": {}}\n')
    (path / "model.safetensors").write_bytes(b"\x00" * 16)
    if marked:
        (path / checkpoint.MARKER).write_text("")
    return path


def test_a_marker_or_a_log_opening_with_qkvs_start_event_makes_a_run_and_file_names_never_do(tmp_path):
    look_alike = tmp_path / "look-alike"  # every name qkv writes, none of it qkv's
    look_alike.mkdir()
    checkpoint_dir(look_alike / "last", marked=False)
    (look_alike / "tokenizer.model").write_bytes(b"their own SentencePiece model")
    (look_alike / "log.jsonl").write_text("the user's own log\n")
    assert not runs.is_run(look_alike)

    old_run = tmp_path / "old-run"  # made before the marker existed: its log's first line decides
    old_run.mkdir()
    (old_run / "log.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    assert runs.is_run(old_run)
    (old_run / "log.jsonl").write_text(json.dumps({"event": "train", "step": 50}) + "\n")
    assert not runs.is_run(old_run)

    marked = tmp_path / "marked"
    runs.mark_run(marked)
    assert runs.is_run(marked)
    for text in ('{"qkv_run": 2}', "[1]", "not json"):  # a marker qkv did not write
        (marked / runs.MARKER).write_text(text)
        assert not runs.is_run(marked)
    linked = tmp_path / "linked"  # a marker that is a link to a real one counts for nothing
    linked.mkdir()
    runs.mark_run(tmp_path / "real")
    (linked / runs.MARKER).symlink_to(tmp_path / "real" / runs.MARKER)
    assert not runs.is_run(linked)


@pytest.mark.parametrize("twin", ["last.old", "final.tmp", "step-000100.old"])
def test_overwrite_keeps_a_users_backup_named_like_a_save_twin_and_deletes_nothing(tmp_path, twin):
    run = tmp_path / "run"
    runs.mark_run(run)
    checkpoint_dir(run / "last", marked=False)
    (run / "log.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    checkpoint_dir(run / twin, marked=False)  # the user's copy, made by hand: no qkv save marker
    before = snapshot(run)
    message = runs.check_new_run(run, overwrite=True)
    assert message == (f"{run / twin} was not left by a qkv save (no {checkpoint.MARKER} marker in it): move it "
                       "away, or choose another --out")
    with pytest.raises(ValueError, match="was not left by a qkv save"):
        runs.clear_run(run)
    assert snapshot(run) == before

    (run / twin / checkpoint.MARKER).write_text("")  # the same twin, as a qkv save leaves it
    assert runs.check_new_run(run, overwrite=True) is None
    assert twin in runs.clear_run(run)


def test_overwrite_of_a_run_from_before_the_marker_deletes_only_qkvs_entries(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    (run / "tokenizer.model").write_bytes(b"the run's tokenizer")
    checkpoint_dir(run / "last", marked=False)
    checkpoint_dir(run / "step-000500", marked=False)
    (run / "notes.txt").write_text("my notes\n")
    (run / "best.txt").write_text("not a checkpoint\n")
    (run / "data").mkdir()
    (run / "data" / "log.jsonl").write_text("the user's own log\n")
    mine = {name: data for name, data in snapshot(run).items() if name in ("notes.txt", "best.txt", "data/log.jsonl")}
    assert runs.check_new_run(run, overwrite=False).startswith(f"--out {run} already holds a run")
    assert runs.check_new_run(run, overwrite=True) is None
    assert sorted(runs.clear_run(run)) == ["last", "log.jsonl", "step-000500", "tokenizer.model"]
    assert snapshot(run) == mine
