"""`--engine ctranslate2`: CTranslate2 searches behind qkv's commands, on an export made once into
qkv's cache (named for the checkpoint's manifest) and checked against qkv's own search."""

from __future__ import annotations

import pytest

ct2 = pytest.importorskip("ctranslate2")

from qkv.cli.main import main  # noqa: E402
from qkv.infer.search import DecodeConfig  # noqa: E402
from qkv.interop.ct2_engine import CT2_BATCH_TOKENS, CTranslate2Translator, ensure_export, export_dir  # noqa: E402
from qkv.interop.ctranslate2 import ct2_translate_ids  # noqa: E402
from qkv.io import checkpoint  # noqa: E402
from qkv.errors import QkvError  # noqa: E402

LINES = ["A man is riding a bike.", "Two dogs play in the snow.", "", "A woman sings on a stage.",
         "Children are playing football in a park."]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_translate_is_ctranslate2_used_directly_on_an_export_made_once(tiny_run, tmp_path, cache, capsys):
    src = tmp_path / "src.txt"
    src.write_text("\n".join(LINES) + "\n")
    # --loop-guard 0: the direct call below searches once (the guard on CTranslate2: test_ct2_options.py)
    args = ["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--beam", "3", "-i", str(src), "--loop-guard", "0"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert "exporting" in first.err and "parity:" in first.err
    loaded = checkpoint.load(tiny_run)
    made = export_dir(loaded.path)
    assert made.parent == cache and (made / "model.bin").is_file()
    assert not any(p.name.endswith(".ct2") for p in loaded.path.parent.iterdir())  # nothing beside the checkpoint
    # CTranslate2 used directly, with the checkpoint's decoding settings and qkv's search rules.
    tok = loaded.tokenizer
    config = DecodeConfig(beam_size=3, **checkpoint.decode_defaults(loaded.config))
    direct = ct2_translate_ids(ct2.Translator(str(made), device="cpu"), tok, [tok.encode(s) for s in LINES], config,
                               max_len=loaded.model.config.max_len, max_tokens=CT2_BATCH_TOKENS)  # without --batch-tokens
    assert first.out.split("\n")[:-1] == [tok.decode(ids) for ids in direct]
    assert main(args) == 0  # the second run reuses the export
    again = capsys.readouterr()
    assert again.out == first.out and "exporting" not in again.err


def test_evaluate_and_confidence_run_on_ctranslate2(tiny_run, tmp_path, cache, capsys):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(LINES) + "\n")
    ref.write_text("\n".join(["Ein Mann fährt Fahrrad."] * len(LINES)) + "\n")
    assert main(["evaluate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--int8",
                 "--src-file", str(src), "--ref-file", str(ref)]) == 0
    assert ", ctranslate2 int8" in capsys.readouterr().out
    assert main(["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--confidence", "-i", str(src)]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.split("\n")[:-1]]
    assert len(rows) == len(LINES) and all(len(r) == 3 and 0 <= float(r[1]) <= 1 for r in rows)
    assert main(["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--bf16", "-i", str(src)]) == 2
    assert "not with --bf16" in capsys.readouterr().err


def test_an_export_that_does_not_translate_as_qkv_does_is_removed(tiny_run, random_checkpoint, cache):
    """A new export is checked on the first sentences it translates: here the cache holds another
    model's export (the random one's) under the trained checkpoint's name, and it is refused and removed."""
    loaded = checkpoint.load(tiny_run)
    wrong, fresh = ensure_export(random_checkpoint)
    assert fresh
    translator = CTranslate2Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=1), ct2_dir=wrong, check=True,
                                       log=lambda m: None)
    with pytest.raises(QkvError, match="not using it"):
        translator.translate(LINES)
    assert not wrong.exists()


def test_the_server_searches_with_ctranslate2_and_refuses_what_it_cannot(tiny_run, cache):
    """create_app(engine="ctranslate2"): the translations are CTranslate2's (as `qkv translate --engine
    ctranslate2` gives them), confidence is still qkv's reading, n_best above 1 and sampling are 422s."""
    import asyncio

    import httpx

    from qkv.serve.app import create_app

    texts = [line for line in LINES if line]
    app = create_app(tiny_run, engine="ctranslate2")

    async def ask(bodies):
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                return [await client.post("/v1/translate", json=b) for b in bodies]

    ok, nbest, sample = asyncio.run(ask([{"texts": texts, "beam_size": 3, "confidence": True},
                                         {"texts": texts, "beam_size": 3, "n_best": 2},
                                         {"texts": texts, "sampling": True}]))
    assert ok.status_code == 200, ok.text
    loaded = checkpoint.load(tiny_run)
    tok = loaded.tokenizer
    config = DecodeConfig(beam_size=3, **checkpoint.decode_defaults(loaded.config))
    direct = ct2_translate_ids(ct2.Translator(str(export_dir(loaded.path)), device="cpu"), tok,
                               [tok.encode(s) for s in texts], config, max_len=loaded.model.config.max_len,
                               max_tokens=4096)  # --max-batch-tokens' default
    assert ok.json()["translations"] == [tok.decode(ids) for ids in direct]
    assert len(ok.json()["confidence"]) == len(texts)
    for refused, field in ((nbest, "n_best"), (sample, "sampling")):
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", field], refused.text


def test_what_ctranslate2_cannot_do_is_refused_before_any_export(tiny_run, tmp_path, cache, capsys):
    """--workers 2 was accepted (and `qkv evaluate` reported "2 workers" for one CTranslate2 process);
    --n-best and --sampling were refused only after a full export. Now each is one line, and no cache entry."""
    src = tmp_path / "src.txt"
    src.write_text("\n".join(LINES) + "\n")
    base = ["--checkpoint", str(tiny_run), "--engine", "ctranslate2"]
    for args, message in [
        (["translate", *base, "-i", str(src), "--workers", "2"], "not with --workers above 1"),
        (["evaluate", *base, "--src-file", str(src), "--ref-file", str(src), "--workers", "2"], "not with --workers above 1"),
        (["translate", *base, "-i", str(src), "--n-best", "2", "--beam", "2"], "not with --sampling or --n-best"),
        (["translate", *base, "-i", str(src), "--sampling"], "not with --sampling or --n-best"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not cache.exists()  # refused before the export: nothing written into the cache
    assert main(["evaluate", *base, "--src-file", str(src), "--ref-file", str(src)]) == 0  # auto: one process, said so
    assert " workers" not in capsys.readouterr().out


def test_a_cache_entry_is_verified_and_rebuilt_only_when_qkv_wrote_it(tiny_run, random_checkpoint, tmp_path, cache, capsys):
    """A cache entry was trusted by its file names: another model's model.bin in it translated with that
    model (exit 0), a cut one failed every later run with a traceback, an older export was reused forever.
    Now each entry carries its own manifest and is verified on use: qkv's entry that does not verify is
    exported again; a directory qkv cannot prove it wrote is refused in one line naming it, and kept."""
    import json
    import os
    import shutil

    from conftest import snapshot

    from qkv.interop.ct2_engine import CACHE_MANIFEST, UNCHECKED, checkpoint_digest, verify_entry

    src = tmp_path / "src.txt"
    src.write_text("\n".join(LINES) + "\n")
    args = ["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "-i", str(src)]
    assert main(args) == 0
    good = capsys.readouterr().out
    ours = export_dir(checkpoint.resolve(tiny_run))
    digest = checkpoint_digest(checkpoint.resolve(tiny_run))
    assert verify_entry(ours, digest) is None and json.loads((ours / CACHE_MANIFEST).read_text())["files"]["model.bin"]
    other, _ = ensure_export(random_checkpoint, log=lambda m: None)  # another model's export, in the same cache
    # another model's model.bin in the entry: exported again, and the translations are this model's
    shutil.copy(other / "model.bin", ours / "model.bin")
    assert main(args) == 0
    swapped = capsys.readouterr()
    assert swapped.out == good and f"the CTranslate2 export {ours} does not verify (model.bin is " in swapped.err  # another size
    logs = []
    log = logs.append
    for damage, why in [
        (lambda d: os.truncate(d / "model.bin", (d / "model.bin").stat().st_size // 2), "model.bin is "),  # cut short
        (lambda d: (d / CACHE_MANIFEST).write_text((d / CACHE_MANIFEST).read_text().replace('"export_version": 2', '"export_version": 1')),
         "written with export version 1, not 2"),  # an older export code's
        (lambda d: (shutil.rmtree(d), shutil.copytree(other, d)), "the export of another checkpoint"),  # a whole entry copied
        (lambda d: (d / "model.bin").unlink(), "model.bin is missing"),
    ]:
        ensure_export(tiny_run, log=lambda m: None)
        if not ours.exists():  # the entry is unchecked until a translation checks it: give it its checked name
            os.replace(ours.with_name(ours.name + UNCHECKED), ours)
        damage(ours)
        logs.clear()
        made, fresh = ensure_export(tiny_run, log=log)
        assert fresh and why in logs[0] and logs[1].startswith("exporting"), logs
        assert verify_entry(made, digest) is None
        os.replace(made, ours)
    # Directories qkv cannot prove it wrote: refused in one line naming them, every byte kept.
    for mine in ("no manifest", "a file of the user's"):
        if mine == "no manifest":
            (ours / CACHE_MANIFEST).unlink()  # an entry from before manifests, or one made by hand
        else:
            ensure_export(tiny_run, log=lambda m: None)
            os.replace(ours.with_name(ours.name + UNCHECKED), ours)
            (ours / "notes.txt").write_text("mine\n")
        before = snapshot(ours)
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"qkv translate: error: {ours} is in qkv's CTranslate2 cache but "), err
        assert snapshot(ours) == before
        shutil.rmtree(ours)


KILLED_EXPORT = """
import os, sys, time
import qkv.interop.ct2_engine as engine
real = engine.export_ctranslate2
def export_then_hang(checkpoint_dir, out):
    made = real(checkpoint_dir, out)
    open(sys.argv[2], "w").close()  # the export is written, not yet renamed into place: kill me now
    time.sleep(600)
engine.export_ctranslate2 = export_then_hang
engine.ensure_export(sys.argv[1], log=lambda m: None)
"""


def test_a_later_run_removes_what_a_killed_export_left_and_nothing_else(random_checkpoint, tmp_path, cache):
    """A process killed during an export left its staging directory (<key>.unchecked.<random>.tmp) in the
    cache for ever. Its marker names the process: a later export removes it once that process is gone,
    and leaves alone every directory qkv cannot prove it left (no marker, a running process's, another
    host's, one holding a file of the user's, a link)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import socket
    from pathlib import Path

    from conftest import snapshot

    from qkv.interop.ct2_engine import STAGING_MARKER, UNCHECKED, stale_staging

    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(random_checkpoint), str(ready)],
                             env={**os.environ, "QKV_CT2_CACHE": str(cache)})
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the export did not start"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (left,) = [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    assert (left / "export" / "model.bin").exists() and json.loads((left / STAGING_MARKER).read_text())["pid"] == child.pid
    assert stale_staging(left)

    key = export_dir(checkpoint.resolve(random_checkpoint)).name
    mine = {"format": "qkv ctranslate2 staging", "pid": child.pid, "host": socket.gethostname()}  # as the killed one's

    def staged(suffix: str, marker: dict | None, extra: str | None = None) -> Path:
        where = cache / f"{key}{UNCHECKED}.{suffix}.tmp"
        (where / "export").mkdir(parents=True)
        (where / "export" / "model.bin").write_bytes(b"weights")
        if marker is not None:
            (where / STAGING_MARKER).write_text(json.dumps(marker))
        if extra:
            (where / extra).write_text("mine\n")
        return where

    kept = [
        staged("nomarker", None),  # killed before it wrote its marker, or made by hand
        staged("running", mine | {"pid": os.getppid()}),  # a running process's export (pytest's parent)
        staged("elsewhere", mine | {"host": mine["host"] + "-other"}),  # another host's, sharing the cache
        staged("users", mine, extra="notes.txt"),  # holds what qkv never writes there
    ]
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / STAGING_MARKER).write_text(json.dumps(mine))
    link = cache / f"{key}{UNCHECKED}.link.tmp"
    link.symlink_to(user_dir)
    before = {p: snapshot(p) for p in [*kept, user_dir]}
    logs = []
    made, fresh = ensure_export(random_checkpoint, log=logs.append)
    assert fresh and made.exists() and not left.exists()
    assert f"removing {left}, left by a CTranslate2 export that did not finish" in logs
    assert {p: snapshot(p) for p in [*kept, user_dir]} == before and link.is_symlink()
    assert sorted(p.name for p in cache.iterdir() if p.name.endswith(".tmp")) == sorted([*(p.name for p in kept), link.name])
