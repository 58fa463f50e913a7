"""qkv's outputs bear a mark (qkv.io.outputs.MARK) that ``--force`` asks for: set on every file written,
broken by any change since, and checked again when the new file takes its name."""

from __future__ import annotations

import os

import pytest
from conftest import require_marks

import qkv.io.outputs as outputs
from qkv.errors import QkvError
from qkv.io.outputs import output_file, written_by_qkv


def write(path, text: str, *, force: bool = False) -> None:
    with output_file(path, force=force) as handle:
        handle.write(text)


def test_an_output_is_marked_and_any_change_since_unmarks_it(tmp_path):
    require_marks(tmp_path)
    out = tmp_path / "out.txt"
    write(out, "qkv's\n")
    assert written_by_qkv(out)
    write(out, "qkv's again\n", force=True)  # its own: replaced
    assert out.read_text() == "qkv's again\n" and written_by_qkv(out)
    with open(out, "a") as handle:  # edited in place: the attribute stays, the file is no longer what qkv wrote
        handle.write("a post-edit\n")
    assert not written_by_qkv(out)
    with pytest.raises(QkvError, match="was not written by qkv"):
        write(out, "again\n", force=True)
    assert out.read_text() == "qkv's again\na post-edit\n"


def test_a_file_that_appears_or_changes_while_qkv_writes_is_kept(tmp_path):
    require_marks(tmp_path)
    out = tmp_path / "out.txt"
    with pytest.raises(QkvError, match="appeared while qkv was writing it"):
        with output_file(out, force=False) as handle:
            handle.write("qkv's\n")
            out.write_text("the user's, meanwhile\n")
    assert out.read_text() == "the user's, meanwhile\n"
    out.unlink()
    write(out, "qkv's\n")
    with pytest.raises(QkvError, match="changed while qkv was writing it"):
        with output_file(out, force=True) as handle:
            handle.write("new\n")
            out.unlink()
            out.write_text("the user's, meanwhile\n")
    assert out.read_text() == "the user's, meanwhile\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temporary file left


def test_a_link_to_qkvs_own_output_is_still_refused(tmp_path):
    require_marks(tmp_path)
    out, link = tmp_path / "out.txt", tmp_path / "link.txt"
    write(out, "qkv's\n")
    link.symlink_to(out)
    with pytest.raises(QkvError, match="is a symbolic link"):
        write(link, "new\n", force=True)
    assert link.is_symlink() and out.read_text() == "qkv's\n"


def test_the_named_temporary_file_is_marked_too(tmp_path, monkeypatch):
    """Where O_TMPFILE is missing the output is a hidden named file first: it bears the mark as well."""
    require_marks(tmp_path)
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    out = tmp_path / "out.txt"
    write(out, "qkv's\n")
    assert written_by_qkv(out)
    write(out, "again\n", force=True)
    assert out.read_text() == "again\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_without_extended_attributes_nothing_is_marked_and_force_replaces_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "_XATTRS", False)  # not Linux
    out = tmp_path / "out.txt"
    write(out, "qkv's\n")
    assert not written_by_qkv(out)
    with pytest.raises(QkvError, match="was not written by qkv"):
        write(out, "again\n", force=True)
    assert out.read_text() == "qkv's\n"
