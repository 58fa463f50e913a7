"""No command destroys a user's files: each case through the real command line, then the files checked.

`average --out` over a user's directory, `translate -i F -o F`, `translate -o` over an existing file,
`export --force` into a checkpoint or a run, `attend --out` over existing pictures, and `evaluate`
keeping line N in as line N out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_marks, snapshot

from qkv.io import checkpoint, manifest



def qkv(*args: str | Path, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], input=input, capture_output=True, text=True, timeout=120)


def refused(result: subprocess.CompletedProcess, command: str, message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qkv {command}: error: ") and message in lines[0], result.stderr


@pytest.fixture(scope="module")
def ckpt(random_checkpoint) -> Path:
    return random_checkpoint



def test_average_never_replaces_a_users_directory(ckpt, tmp_path):
    mine = tmp_path / "runs" / "en-de"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    before = snapshot(mine)
    refused(qkv("average", ckpt, ckpt, "--out", mine), "average", "exists; pass --force")
    refused(qkv("average", ckpt, ckpt, "--out", mine, "--force"), "average", "is not a qkv checkpoint")
    assert snapshot(mine) == before
    assert sorted(p.name for p in mine.parent.iterdir()) == ["en-de"]  # nothing renamed aside or left over


def test_average_force_replaces_only_a_checkpoint(ckpt, tmp_path):
    out = tmp_path / "avg"
    assert qkv("average", ckpt, ckpt, "--out", out).returncode == 0
    refused(qkv("average", ckpt, ckpt, "--out", out), "average", "exists; pass --force")
    result = qkv("average", ckpt, ckpt, "--out", out, "--force")
    assert result.returncode == 0, result.stderr
    checkpoint.verify(out)


def test_translate_refuses_to_write_over_its_input(ckpt, tmp_path):
    text = tmp_path / "text.en"
    text.write_text("A dog runs.\nTwo children play.\n", encoding="utf-8")
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", text, "-o", text), "translate", "is also the input")
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", text, "-o", text, "--force"), "translate", "is also the input")
    link = tmp_path / "link.en"
    link.symlink_to(text)  # the same file under another name
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", text, "-o", link, "--force"), "translate", "is also the input")
    assert text.read_text(encoding="utf-8") == "A dog runs.\nTwo children play.\n"


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_translate_refuses_to_write_over_its_standard_input(ckpt, tmp_path, fmt):
    """``qkv translate -o F --force < F``: the input came in on standard input, and is refused all the same."""
    text = tmp_path / "page.txt"
    original = "<p>A dog runs.</p>\n" if fmt == "html" else "A dog runs.\n"
    text.write_text(original, encoding="utf-8")
    with open(text, encoding="utf-8") as stdin:
        result = subprocess.run([sys.executable, "-m", "qkv", "translate", "--checkpoint", str(ckpt), "--beam", "1",
                                 "--format", fmt, "-o", str(text), "--force"], stdin=stdin, capture_output=True, text=True, timeout=120)
    refused(result, "translate", "is also the standard input")
    assert text.read_text(encoding="utf-8") == original


def test_translate_never_replaces_a_pipe_or_a_link_to_one(ckpt, tmp_path):
    """``--force`` replaces a regular file only: never a FIFO (nor a device: ``-o /dev/null``), nor a link to one."""
    source, fifo, link = tmp_path / "in.en", tmp_path / "pipe", tmp_path / "stdout"
    source.write_text("A dog runs.\n", encoding="utf-8")
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    for target in (fifo, link):
        refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", target, "--force"), "translate",
                "is not a regular file")
    assert fifo.is_fifo() and link.is_symlink() and link.resolve() == fifo.resolve()


def test_translate_output_over_an_existing_file_needs_force_and_replaces_only_what_qkv_wrote(ckpt, tmp_path):
    source, out = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("A dog runs.\n\nTwo children play.\n", encoding="utf-8")
    out.write_text("my own translations\n", encoding="utf-8")  # the user's file
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out), "translate", "exists; pass --force")
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out, "--force"), "translate",
            "was not written by qkv")
    assert out.read_text(encoding="utf-8") == "my own translations\n"
    out.unlink()
    require_marks(tmp_path)
    first = qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out)  # qkv's own output
    assert first.returncode == 0, first.stderr
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out), "translate", "exists; pass --force")
    source.write_text("A cat sleeps.\n", encoding="utf-8")
    result = qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out, "--force")
    assert result.returncode == 0, result.stderr
    assert out.read_text(encoding="utf-8").count("\n") == 1  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.de"]  # no temporary file left
    edited = out.read_text(encoding="utf-8") + "a line of my own\n"
    out.unlink()
    out.write_text(edited, encoding="utf-8")  # an editor writes a new file: the user's now
    refused(qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out, "--force"), "translate",
            "was not written by qkv")
    assert out.read_text(encoding="utf-8") == edited


def test_a_failed_translation_leaves_the_previous_output_whole(ckpt, tmp_path):
    source, out = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("A dog runs.\n", encoding="utf-8")
    require_marks(tmp_path)
    assert qkv("translate", "--checkpoint", ckpt, "--beam", "1", "-i", source, "-o", out).returncode == 0  # yesterday's
    yesterday = out.read_bytes()
    source.write_bytes(b"A dog runs.\n\xff not utf-8\n")
    refused(qkv("translate", "--checkpoint", ckpt, "-i", source, "-o", out, "--force"), "translate", "line 2 is not valid UTF-8")
    assert out.read_bytes() == yesterday
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.de"]


def test_evaluate_keeps_line_n_in_as_line_n_out(ckpt, tmp_path):
    src, ref, hyp = tmp_path / "test.en", tmp_path / "test.de", tmp_path / "hyp.de"
    src.write_text("A dog runs.\n\nTwo children play.\nA red ball.\n", encoding="utf-8")
    ref.write_text("Ein Hund rennt.\nEin leerer Quellsatz.\n\nEin roter Ball.\n", encoding="utf-8")
    result = qkv("evaluate", "--checkpoint", ckpt, "--beam", "1", "--src-file", src, "--ref-file", ref, "--save", hyp)
    assert result.returncode == 0, result.stderr
    assert ": 4 sentences," in result.stdout  # scored on all four pairs, not on the two without an empty side
    lines = hyp.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[1] == "" and lines[4] == ""  # 4 lines; the empty source gave an empty line
    refused(qkv("evaluate", "--checkpoint", ckpt, "--src-file", src, "--ref-file", ref, "--save", src), "evaluate", "is also the input")
    refused(qkv("evaluate", "--checkpoint", ckpt, "--src-file", src, "--ref-file", ref, "--save", hyp), "evaluate", "exists; pass --force")


def test_attend_does_not_overwrite_pictures_without_force(ckpt, tmp_path):
    png = tmp_path / "attention.png"
    png.write_bytes(b"a picture the user drew")
    out = str(tmp_path / "attention")
    refused(qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A dog runs.", "--out", out), "attend", "exists; pass --force")
    assert png.read_bytes() == b"a picture the user drew" and not (tmp_path / "attention.html").exists()
    refused(qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A dog runs.", "--out", out, "--force"), "attend", "was not written by qkv")
    assert png.read_bytes() == b"a picture the user drew" and not (tmp_path / "attention.html").exists()
    png.unlink()
    require_marks(tmp_path)
    assert qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A dog runs.", "--out", out).returncode == 0
    assert qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A cat sleeps.", "--out", out, "--force").returncode == 0  # qkv's own
    assert png.read_bytes().startswith(b"\x89PNG") and "cat" in (tmp_path / "attention.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("kind", ["checkpoint", "run", "user"])
def test_export_force_never_writes_into_a_checkpoint_a_run_or_a_users_directory(ckpt, tmp_path, kind):
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (one of qkv's requirements: pip install -e .)")
    if kind == "checkpoint":
        target = checkpoint.save(tmp_path / "target", checkpoint.load(ckpt).model, checkpoint.load(ckpt).tokenizer)
    else:
        target = tmp_path / "target"
        target.mkdir()
        (target / ("log.jsonl" if kind == "run" else "config.json")).write_text(json.dumps({"mine": True}))
    before = snapshot(target)
    refused(qkv("export", "--checkpoint", ckpt, "--out", target, "--force", "--check", "0"), "export", "not an earlier qkv export")
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_export_force_replaces_an_earlier_export(ckpt, tmp_path):
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (one of qkv's requirements: pip install -e .)")
    out = tmp_path / "ct2"
    assert qkv("export", "--checkpoint", ckpt, "--out", out, "--check", "0").returncode == 0
    refused(qkv("export", "--checkpoint", ckpt, "--out", out, "--check", "0"), "export", "pass --force to replace it")
    result = qkv("export", "--checkpoint", ckpt, "--out", out, "--force", "--check", "0")
    assert result.returncode == 0, result.stderr
    assert (out / "model.bin").exists() and (out / "qkv_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]


def test_a_broken_or_crafted_checkpoint_is_a_one_line_error(ckpt, tmp_path):
    import shutil

    for name, change in [
        ("no-model", lambda d: (d / "config.json").write_text(json.dumps({"format": checkpoint.FORMAT_VERSION}))),
        ("empty-files", None),
    ]:
        broken = tmp_path / name
        shutil.copytree(ckpt, broken)
        if change is None:
            (broken / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT_VERSION, "files": []}))
        else:
            change(broken)
            manifest.write(broken)  # crafted: the checksums agree, the content is wrong
        result = qkv("translate", "--checkpoint", broken, input="A dog.\n")
        refused(result, "translate", str(broken))
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["score", "align"])
def test_score_and_align_outputs_keep_the_users_files(ckpt, tmp_path, command):
    src, ref, out = tmp_path / "src.en", tmp_path / "ref.de", tmp_path / "out.txt"
    src.write_text("A dog runs.\nTwo children play.\n", encoding="utf-8")
    ref.write_text("Ein Hund rennt.\nZwei Kinder spielen.\n", encoding="utf-8")
    out.write_text("my results\n", encoding="utf-8")
    base = [command, "--checkpoint", ckpt, "-i", src, "-r", ref]
    refused(qkv(*base, "-o", out), command, "exists; pass --force")
    refused(qkv(*base, "-o", ref, "--force"), command, "is also the input")
    assert out.read_text(encoding="utf-8") == "my results\n"
    assert ref.read_text(encoding="utf-8") == "Ein Hund rennt.\nZwei Kinder spielen.\n"
    refused(qkv(*base, "-o", out, "--force"), command, "was not written by qkv")
    assert out.read_text(encoding="utf-8") == "my results\n"
    out.unlink()
    require_marks(tmp_path)
    assert qkv(*base, "-o", out).returncode == 0
    result = qkv(*base, "-o", out, "--force")  # its own output, replaced
    assert result.returncode == 0, result.stderr
    assert out.read_text(encoding="utf-8").count("\n") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "ref.de", "src.en"]


def test_average_leaves_a_users_old_and_tmp_directories_alone(ckpt, tmp_path):
    for name in ("avg", "avg2"):  # the user's checkpoints, kept as backups under qkv's own twin names
        checkpoint.save(tmp_path / name, checkpoint.load(ckpt).model, checkpoint.load(ckpt).tokenizer)
    (tmp_path / "avg").rename(tmp_path / "avg.old")  # mv avg avg.old
    (tmp_path / "avg2").rename(tmp_path / "avg2.tmp")
    before = {name: snapshot(tmp_path / name) for name in ("avg.old", "avg2.tmp")}
    assert qkv("average", ckpt, ckpt, "--out", tmp_path / "avg").returncode == 0  # a new path, no --force
    refused(qkv("average", ckpt, ckpt, "--out", tmp_path / "avg2"), "average", "avg2.tmp is in the way and qkv did not write it")
    assert {name: snapshot(tmp_path / name) for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg", "avg.old", "avg2.tmp"]


def test_no_output_lands_inside_the_checkpoint_it_reads(ckpt, tmp_path):
    model = tmp_path / "model"
    import shutil

    shutil.copytree(ckpt, model)
    before = snapshot(model)
    text = tmp_path / "in.en"
    text.write_text("A dog runs.\n", encoding="utf-8")
    for args in (
        ("translate", "--checkpoint", model, "-i", text, "-o", model / "config.json", "--force"),
        ("translate", "--checkpoint", model, "-i", text, "-o", model / "new.txt"),
        ("translate", "--checkpoint", model, "-i", text, "--trace", model / "trace", "--force"),
        ("evaluate", "--checkpoint", model, "--src-file", text, "--ref-file", text, "--save", model / "hyp.txt"),
        ("score", "--checkpoint", model, "-i", text, "-r", text, "-o", model / "manifest.json", "--force"),
        ("align", "--checkpoint", model, "-i", text, "-r", text, "-o", model / "a.txt"),
        ("attend", "--checkpoint", model, "A dog.", "--out", model / "attention", "--force"),
    ):
        refused(qkv(*args), args[0], f"inside {model}, which this command reads")
    refused(qkv("average", model, model, "--out", model, "--force"), "average", "which this command reads")
    refused(qkv("export", "--checkpoint", model, "--out", model / "ct2", "--check", "0"), "export", "which this command reads")
    assert snapshot(model) == before
    checkpoint.verify(model)


def test_a_trace_of_piped_input_leaves_every_line_to_translate(ckpt, tmp_path):
    out, trace = tmp_path / "out.txt", tmp_path / "trace"
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "translate", "--checkpoint", str(ckpt), "--beam", "2", "-i", "/dev/stdin",
         "--trace", str(trace), "-o", str(out)],
        input="A dog runs.\nTwo children play.\nA red ball.\nA cat.\nThe end.\n", capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text(encoding="utf-8").count("\n") == 5  # the traced first line too, not 0 lines
    assert json.loads((tmp_path / "trace.json").read_text())  # and the trace of line 1


def test_pictures_written_with_force_neither_follow_nor_replace_a_users_symlink(ckpt, tmp_path):
    precious = tmp_path / "thesis.pdf"
    precious.write_bytes(b"%PDF years of work")
    (tmp_path / "attention.png").symlink_to(precious)
    (tmp_path / "attention.html").symlink_to(precious)
    result = qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A dog runs.", "--out", tmp_path / "attention", "--force")
    refused(result, "attend", "is a symbolic link")  # a link qkv never writes: the user's
    assert precious.read_bytes() == b"%PDF years of work"
    assert (tmp_path / "attention.png").is_symlink() and (tmp_path / "attention.png").resolve() == precious.resolve()


def test_a_killed_translation_leaves_no_temporary_file(ckpt, tmp_path):
    import signal
    import time

    source, out = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("A dog runs in the park with a red ball.\n" * 3000, encoding="utf-8")
    process = subprocess.Popen([sys.executable, "-m", "qkv", "translate", "--checkpoint", str(ckpt), "--beam", "4",
                                "-i", str(source), "-o", str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
        opened = []
        for fd in os.listdir(f"/proc/{process.pid}/fd"):
            try:
                opened.append(os.readlink(f"/proc/{process.pid}/fd/{fd}"))
            except FileNotFoundError:
                pass  # closed between the listing and the read (imports open and close files)
        if any(str(tmp_path) in target and "in.en" not in target for target in opened):
            break  # the output is open: the translation is under way
    assert process.poll() is None, process.stderr.read()
    time.sleep(0.5)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en"]  # no out.de, no hidden .out.de.*.tmp


def test_export_never_deletes_a_users_directory_named_like_its_temporary_one(ckpt, tmp_path):
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (one of qkv's requirements: pip install -e .)")
    assert qkv("export", "--checkpoint", ckpt, "--out", tmp_path / "ct2", "--check", "0").returncode == 0
    (tmp_path / "ct2").rename(tmp_path / "ct2.tmp")  # the user's export, kept under a name qkv once used
    before = snapshot(tmp_path / "ct2.tmp")
    refused(qkv("export", "--checkpoint", ckpt, "--out", tmp_path / "ct2", "--check", "0"), "export", "qkv did not write it")
    assert snapshot(tmp_path / "ct2.tmp") == before


def test_no_output_replaces_a_file_the_command_reads(ckpt, tmp_path, capsys):
    """Every file a command reads is an input: `translate --glossary G -o G --force` and `evaluate --glossary G
    --save G --force` used to replace the glossary with translations (exit 0); `evaluate --save` over the
    Multi30k split it scores, and `pseudo-terms --out` over the training data it reads, are refused too."""
    import gzip
    import shutil

    from conftest import MULTI30K, require_multi30k

    from qkv.cli.main import main

    def refused_here(args: list, message: str) -> None:
        assert main([*map(str, args)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err

    text, glossary, ref = tmp_path / "in.en", tmp_path / "terms.tsv", tmp_path / "ref.de"
    text.write_text("A dog runs.\n", encoding="utf-8")
    ref.write_text("Ein Hund rennt.\n", encoding="utf-8")
    glossary.write_text("dog\tHund\n", encoding="utf-8")
    link = tmp_path / "terms-link.tsv"
    link.symlink_to(glossary)
    for out in (glossary, link):  # the file itself, or through a symlink
        refused_here(["translate", "--checkpoint", ckpt, "-i", text, "--glossary", glossary, "-o", out, "--force"],
                     f"{out} is also the input")
        refused_here(["evaluate", "--checkpoint", ckpt, "--src-file", text, "--ref-file", ref, "--glossary", glossary,
                      "--save", out, "--force"], f"{out} is also the input")
    assert glossary.read_text(encoding="utf-8") == "dog\tHund\n"
    require_multi30k()
    data = tmp_path / "multi30k"
    data.mkdir()
    for name in ("val.en.gz", "val.de.gz"):
        shutil.copy(MULTI30K / name, data / name)
    before = snapshot(data)
    refused_here(["evaluate", "--checkpoint", ckpt, "--split", "val", "--data-dir", data, "--save", data / "val.de.gz",
                  "--force"], "val.de.gz is also the input")
    assert snapshot(data) == before and gzip.decompress(before["val.de.gz"]).count(b"\n") == 1014
    pairs_src, pairs_tgt = tmp_path / "train.en", tmp_path / "train.de"
    pairs_src.write_text("A dog runs.\n", encoding="utf-8")
    pairs_tgt.write_text("Ein Hund rennt.\n", encoding="utf-8")
    run = tmp_path / "run-config"  # a checkpoint whose config names its training files (pseudo-terms' default data)
    shutil.copytree(checkpoint.resolve(ckpt), run)
    config = json.loads((run / "config.json").read_text())
    config["data"] = {"corpus": "files", "train_src": str(pairs_src), "train_tgt": str(pairs_tgt), "src_lang": "en", "tgt_lang": "de"}
    (run / "config.json").write_text(json.dumps(config))
    manifest.write(run)
    refused_here(["pseudo-terms", "--checkpoint", run, "--out", pairs_tgt, "--force"], f"{pairs_tgt} is also the input")
    assert pairs_tgt.read_text(encoding="utf-8") == "Ein Hund rennt.\n"


def test_force_replaces_qkvs_own_trace_json_and_saved_translations(ckpt, tmp_path):
    """Each output a command writes is marked, so the same command again with --force replaces it all."""
    require_marks(tmp_path)
    src, ref = tmp_path / "test.en", tmp_path / "test.de"
    src.write_text("A dog runs.\n", encoding="utf-8")
    ref.write_text("Ein Hund rennt.\n", encoding="utf-8")
    for force in ((), ("--force",)):
        trace = qkv("translate", "--checkpoint", ckpt, "--beam", "2", "-i", src, "--trace", tmp_path / "trace", *force)
        assert trace.returncode == 0, trace.stderr
        saved = qkv("evaluate", "--checkpoint", ckpt, "--beam", "1", "--src-file", src, "--ref-file", ref, "--save", tmp_path / "hyp.de", *force)
        assert saved.returncode == 0, saved.stderr
        drawn = qkv("attend", "--checkpoint", ckpt, "--beam", "1", "A dog runs.", "--out", tmp_path / "attention", "--json", tmp_path / "a.json", *force)
        assert drawn.returncode == 0, drawn.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"test.en", "test.de", "trace.png", "trace.html", "trace.json", "hyp.de",
                                                   "attention.png", "attention.html", "a.json"}
