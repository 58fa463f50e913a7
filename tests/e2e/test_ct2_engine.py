"""`--engine ctranslate2`: CTranslate2 searches behind qkv's commands, on an export made once into
qkv's cache (named for the checkpoint's manifest) and checked against qkv's own search."""

from __future__ import annotations

import pytest

ct2 = pytest.importorskip("ctranslate2")

from qkv.cli.main import main  # noqa: E402
from qkv.infer.search import DecodeConfig  # noqa: E402
from qkv.interop.ct2_engine import CTranslate2Translator, ensure_export, export_dir  # noqa: E402
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
    args = ["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--beam", "3", "-i", str(src)]
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
                               max_len=loaded.model.config.max_len, max_tokens=2048)  # --batch-tokens' default
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
