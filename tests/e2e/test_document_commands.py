"""Documents end to end on a small trained model: `qkv translate --format`, `qkv markup`, the server's
`format`, and bad input (one line, nothing written)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from bs4 import BeautifulSoup

from qkv.serve.app import create_app

PAGE = """<!DOCTYPE html>
<html lang="en"><head><title>A dog on the beach</title></head>
<body>
<h1>A <b>brown dog</b> runs on the beach</h1>
<p>A man in a <a href="/shirts?a=1&amp;b=2" class="k">blue shirt</a> is <i>riding</i> a bike.<br>Run <code>ls -l</code> now.</p>
<p>Two <img src="dog.png" alt="a small dog"> dogs play in the <span translate="no">Park Avenue</span> snow.</p>
</body></html>
"""
SRT = "1\n00:00:01,000 --> 00:00:02,000\nA man in a blue shirt\n\n2\n00:00:02,500 --> 00:00:04,000\nis riding a bike.\n"
PO = r'''msgid ""
msgstr ""
"Project-Id-Version: demo\n"
"PO-Revision-Date: 2026-12-06 00:00+0000\n"
"Last-Translator: qkv\n"
"Language-Team: none\n"
"MIME-Version: 1.0\n"
"Content-Type: text/plain; charset=UTF-8\n"
"Content-Transfer-Encoding: 8bit\n"
"Plural-Forms: nplurals=2; plural=(n != 1);\n"

#, python-format
msgid "A man in a %(color)s shirt is riding {vehicle}."
msgstr ""

#, c-format
msgid "%d dog runs on the beach"
msgid_plural "%d dogs run on the beach"
msgstr[0] ""
msgstr[1] ""
'''


def qkv(*args, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def shape(page: str):
    """The page's elements in order with their attributes, the translated ones (alt, title, lang) left out."""
    soup = BeautifulSoup(page, "html5lib")
    return [(t.name, {k: v for k, v in t.attrs.items() if k not in ("alt", "title", "lang")}) for t in soup.find_all(True)]


def test_a_page_comes_back_with_every_element_and_the_same_through_stdin(tiny_run, tmp_path):
    (tmp_path / "page.html").write_text(PAGE, encoding="utf-8")
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "page.html", "-o", "page.de.html", "--beam", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = (tmp_path / "page.de.html").read_text(encoding="utf-8")
    assert sorted(map(str, shape(out))) == sorted(map(str, shape(PAGE)))  # every element, its attributes
    blocks = lambda page: [n for n, _ in shape(page) if n in ("html", "head", "title", "body", "h1", "p")]  # noqa: E731
    assert blocks(out) == blocks(PAGE)
    assert '<html lang="de">' in out and "<code>ls -l</code>" in out and '<span translate="no">Park Avenue</span>' in out
    assert 'href="/shirts?a=1&amp;b=2" class="k"' in out
    piped = qkv("translate", "--checkpoint", tiny_run, "--format", "html", "--beam", "2", cwd=tmp_path, stdin=PAGE)
    assert piped.returncode == 0 and piped.stdout == out


def test_markup_is_placed_onto_a_given_translation(tiny_run, tmp_path):
    (tmp_path / "en.html").write_text('<p>A man in a <b>blue shirt</b> is <a href="/r">riding</a> a bike.</p>\n', encoding="utf-8")
    (tmp_path / "de.html").write_text("<p>Ein Mann in einem blauen Hemd fährt Fahrrad.</p>\n", encoding="utf-8")
    done = qkv("markup", "--checkpoint", tiny_run, "--source", "en.html", "-i", "de.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    soup = BeautifulSoup(done.stdout, "html5lib")
    assert soup.p.get_text() == "Ein Mann in einem blauen Hemd fährt Fahrrad."  # the given words, untouched
    assert len(soup.find_all("b")) == 1 and soup.find("a")["href"] == "/r"
    bad = qkv("markup", "--checkpoint", tiny_run, "--source", "en.html", cwd=tmp_path, stdin="<p>one</p><p>two</p>")
    assert bad.returncode != 0 and "2 text blocks where the source has 1" in bad.stderr


def test_subtitles_keep_their_cues_and_a_catalogue_passes_msgfmt(tiny_run, tmp_path):
    done = qkv("translate", "--checkpoint", tiny_run, "--format", "srt", "--beam", "2", "--confidence", "json", cwd=tmp_path, stdin=SRT)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [r["where"] for r in reports] == ["cue 1"] and 0 <= reports[0]["confidence"] <= 1  # one sentence over two cues
    lines = lambda text: [b.splitlines()[:2] for b in text.strip().split("\n\n")]  # noqa: E731
    assert lines(done.stdout) == lines(SRT) and all(len(b.splitlines()) >= 3 for b in done.stdout.strip().split("\n\n"))
    (tmp_path / "de.po").write_text(PO, encoding="utf-8")
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "de.po", "-o", "out.po", "--beam", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = (tmp_path / "out.po").read_text(encoding="utf-8")
    import polib

    entries = [e for e in polib.pofile(out) if e.msgid]
    assert "%(color)s" in entries[0].msgstr and "{vehicle}" in entries[0].msgstr
    assert all("%d" in entries[1].msgstr_plural[n] for n in (0, 1))
    if shutil.which("msgfmt") is None:
        pytest.skip("msgfmt (gettext) is not installed: the catalogue was not checked by it")
    check = subprocess.run(["msgfmt", "--check", "-o", str(tmp_path / "out.mo"), str(tmp_path / "out.po")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_a_windows_subtitle_file_comes_back_with_its_byte_order_mark_and_cr_lf(tiny_run, tmp_path):
    (tmp_path / "en.srt").write_bytes(("\ufeff" + SRT.replace("\n", "\r\n")).encode("utf-8"))
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "en.srt", "-o", "de.srt", "--beam", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = (tmp_path / "de.srt").read_bytes()
    assert out.startswith(b"\xef\xbb\xbf") and out.count(b"\n") == out.count(b"\r\n") > 0
    piped = qkv("translate", "--checkpoint", tiny_run, "--format", "srt", "--beam", "2", cwd=tmp_path, stdin=SRT)
    assert out.decode("utf-8") == "\ufeff" + piped.stdout.replace("\n", "\r\n")  # the same translation, as stored


def test_bad_documents_are_one_line_and_nothing_is_written(tiny_run, tmp_path):
    (tmp_path / "broken.srt").write_text("1\n00:00:01,000 -> 00:00:02,000\nHi\n", encoding="utf-8")
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "broken.srt", "-o", "out.srt", cwd=tmp_path)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and "line 1" in done.stderr
    assert not (tmp_path / "out.srt").exists()
    early = qkv("translate", "--checkpoint", tmp_path / "no-such-run", "-i", "broken.srt", cwd=tmp_path)
    assert early.returncode != 0 and "line 1: not a SubRip cue" in early.stderr  # read before any model loads
    (tmp_path / "page.html").write_text(PAGE, encoding="utf-8")
    same = qkv("translate", "--checkpoint", tiny_run, "-i", "page.html", "-o", "page.html", cwd=tmp_path)
    assert same.returncode != 0 and (tmp_path / "page.html").read_text(encoding="utf-8") == PAGE
    (tmp_path / "latin1.html").write_bytes("<p>caf\u00e9</p>".encode("latin-1"))
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "latin1.html", cwd=tmp_path)
    assert done.returncode != 0 and "not UTF-8" in done.stderr and "Traceback" not in done.stderr


def test_the_server_gives_the_commands_document_and_charges_it(tiny_run, tmp_path):
    app = create_app(tiny_run, max_request_work=10**7, max_queue_work=10**7)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=300) as client:
                page = await client.post("/v1/translate", json={"texts": [PAGE], "format": "html", "beam_size": 2, "confidence": True})
                broken = await client.post("/v1/translate", json={"texts": ["1\nnot a cue\n"], "format": "srt"})
                nbest = await client.post("/v1/translate", json={"texts": [PAGE], "format": "html", "n_best": 2})
                return page, broken, nbest

    page, broken, nbest = asyncio.run(scenario())
    assert page.status_code == 200, page.text
    command = qkv("translate", "--checkpoint", tiny_run, "--format", "html", "--beam", "2", "--loop-guard", "0", cwd=tmp_path, stdin=PAGE)
    assert command.returncode == 0, command.stderr
    assert page.json()["translations"] == [command.stdout]
    segments = page.json()["segments"][0]
    assert len(segments) >= 4 and all(0 <= s["confidence"] <= 1 and "where" in s for s in segments)
    assert broken.status_code == 422 and "texts[0]" in json.dumps(broken.json())
    assert nbest.status_code == 422 and "n_best" in nbest.text


def test_the_server_keeps_a_plain_texts_placeholders_as_the_command_keeps_a_lines(tiny_run, tmp_path):
    # a newcomer's review: the server's texts without a format let the model rewrite URLs and drop emoji
    app = create_app(tiny_run, max_request_work=10**7, max_queue_work=10**7)
    texts = ["A man writes to john.doe@example.com now.", "A dog \U0001F436 runs to https://example.com/dog now.", "A dog runs."]

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=300) as client:
                plain = await client.post("/v1/translate", json={"texts": texts, "beam_size": 2})
                scored = await client.post("/v1/translate", json={"texts": texts, "beam_size": 2, "n_best": 1})
                return plain, scored

    plain, scored = asyncio.run(scenario())
    assert plain.status_code == 200 and scored.status_code == 200, plain.text
    out = plain.json()["translations"]
    for line, kept in zip(out, (["john.doe@example.com"], ["\U0001F436", "https://example.com/dog"], [])):
        assert all(line.count(k) == 1 for k in kept), line
    command = qkv("translate", "--checkpoint", tiny_run, "--beam", "2", "--loop-guard", "0", cwd=tmp_path, stdin="\n".join(texts) + "\n")
    assert command.returncode == 0, command.stderr
    assert out == command.stdout.splitlines()  # what the command gives the same lines
    assert "https://example.com/dog" not in scored.json()["translations"][1]  # n_best searches the text as written


HOSTILE = ('<p>A dog <b>runs</b>.</p><script>parent.document.title = "ran";</script>'
           '<img src="missing.png" onerror="parent.document.title = \'ran\'">')


def test_the_page_shows_a_document_and_its_translation_and_runs_none_of_its_scripts(tiny_run, browser, tmp_path):
    import importlib.util

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    spec = importlib.util.spec_from_file_location("load_test", Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py")
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    with load_test.ServerProcess(tiny_run, log_path=tmp_path / "server.log") as server:
        expected = httpx.post(f"{server.url}/v1/translate", json={"texts": [HOSTILE], "format": "html", "beam_size": 2},
                              timeout=300).json()["translations"][0]
        browser.get(server.url + "/")
        title = browser.title
        browser.find_element(By.ID, "input").clear()
        browser.execute_script("document.getElementById('input').value = arguments[0];", HOSTILE)
        browser.find_element(By.ID, "beam").clear()
        browser.find_element(By.ID, "beam").send_keys("2")
        Select(browser.find_element(By.ID, "format")).select_by_visible_text("html")
        browser.find_element(By.ID, "translate").click()
        frames = WebDriverWait(browser, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#doc-translation iframe"))
        source_frame = browser.find_element(By.CSS_SELECTOR, "#doc-source iframe")
        assert frames[0].get_attribute("sandbox") == "" and source_frame.get_attribute("sandbox") == ""
        assert frames[0].get_attribute("srcdoc") == expected  # the server's answer, shown as a page
        browser.switch_to.frame(frames[0])
        assert browser.find_element(By.TAG_NAME, "b") is not None  # rendered, markup and all
        browser.switch_to.default_content()
        assert browser.title == title  # neither the script nor the onerror handler ran


def test_a_glossarys_terms_hold_in_a_document(tiny_run):
    from qkv.data.sentences import TextOptions
    from qkv.document.translate import translate_document
    from qkv.infer.glossary import Glossary
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint

    loaded = checkpoint.load(tiny_run / "final")
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=4), text=TextOptions(split="en", recase=True))
    page = '<p>A <b>man</b> in a blue shirt climbs a <a href="/l">ladder</a>.</p>'
    glossary = Glossary.parse(["man\tFeuerwehrmann", "ladder\tLeiter"])  # --numbers goes the same way (a Glossary)
    out = translate_document(translator, page, "html", glossary=glossary).text
    soup = BeautifulSoup(out, "html5lib")
    assert "Feuerwehrmann" in soup.p.get_text() and "Leiter" in soup.p.get_text()  # in the 60-step model's nonsense
    assert len(soup.find_all("b")) == 1 and soup.find("a")["href"] == "/l"


def test_lang_without_a_document_is_refused_not_ignored(tiny_run, tmp_path):
    done = qkv("translate", "--checkpoint", tiny_run, "--lang", "de", cwd=tmp_path, stdin="A dog.\n")
    assert done.returncode != 0 and "--lang" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("lang", ["de\nPlural-Forms: nplurals=99", "de\" onload=\"x", ""])
def test_lang_that_is_not_a_language_tag_is_refused_before_it_is_written_into_the_document(tiny_run, tmp_path, lang):
    # a hostile-input hunt: a line feed in --lang wrote header fields of its own into a PO catalogue
    (tmp_path / "in.po").write_text('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\nmsgid "A dog."\nmsgstr ""\n')
    done = qkv("translate", "--checkpoint", tiny_run, "-i", "in.po", "-o", "out.po", "--lang", lang, cwd=tmp_path)
    assert done.returncode != 0 and "--lang" in done.stderr and "language tag" in done.stderr
    assert not (tmp_path / "out.po").exists()


def test_plain_lines_keep_their_placeholders_as_the_text_format_does(random_checkpoint, tmp_path, capsys):
    # a newcomer's review: the line mode (no --format) let the model rewrite URLs, e-mail addresses and %s
    from qkv.cli import main as cli

    lines = ["A man writes to john.doe@example.com now.", "A dog runs to https://example.com/dog now.", "",
             "Two children play with %s and {name}.", "A dog runs across the green field.", "A dog\tTwo children\tA ball",
             "A dog \U0001F436 runs to the \u2764\uFE0F ball."]
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    run = ["translate", "--checkpoint", str(random_checkpoint), "-i", str(source), "--beam", "2", "--workers", "1"]
    assert cli.main(run) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(lines) and out[2] == ""
    kept_ones = (["john.doe@example.com"], ["https://example.com/dog"], [], ["%s", "{name}"], [], [], ["\U0001F436", "\u2764\uFE0F"])
    for line, kept in zip(out, kept_ones):  # emoji too: the model's vocabulary has none, and they vanished
        assert all(line.count(k) == 1 for k in kept), line
    assert cli.main([*run, "--format", "text"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == out[:2]  # what --format text gives those lines
    assert cli.main([*run, "--n-best", "2"]) == 0  # the plain path (--n-best keeps it): the line without one is the same
    assert capsys.readouterr().out.splitlines()[4].split("\t")[0] == out[4]
    assert out[5].count("\t") == 2  # a line's tab-separated parts translated apart, the tabs kept


def test_plain_lines_keep_their_placeholders_with_a_glossary_too(random_checkpoint, tmp_path, capsys):
    # a newcomer's review: with --glossary the model read the URL and {name}, and wrote neither
    from qkv.cli import main as cli

    lines = ["Hello {name}, a dog runs to https://example.com/dog now.", "A dog runs across the green field."]
    source, glossary = tmp_path / "in.txt", tmp_path / "terms.tsv"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    glossary.write_text("dog\tHund\n", encoding="utf-8")
    run = ["translate", "--checkpoint", str(random_checkpoint), "-i", str(source), "--beam", "2", "--workers", "1", "--glossary", str(glossary)]
    assert cli.main(run) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(out[0].count(k) == 1 for k in ("{name}", "https://example.com/dog")), out
    assert all("Hund" in line for line in out), out  # the term in both, the marked line's and the plain one's
    assert cli.main([*run, "--format", "text"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == out[0]  # what --format text --glossary gives that line


def test_confidence_keeps_a_lines_placeholders_and_judges_what_the_model_read(random_checkpoint, tmp_path, capsys):
    # a newcomer's review: adding --confidence fed the URL and {name} to the model and changed the translation
    import json

    from qkv.cli import main as cli

    lines = ["Hello {name}, a dog runs to https://example.com/dog now.", "A dog runs across the green field.", "%s", ""]
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    run = ["translate", "--checkpoint", str(random_checkpoint), "-i", str(source), "--beam", "2", "--workers", "1"]
    assert cli.main(run) == 0
    plain = capsys.readouterr().out.splitlines()
    assert cli.main([*run, "--confidence"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == plain and all(len(r) == 3 and 0 <= float(r[1]) <= 1 for r in rows)
    assert rows[2][1] == rows[3][1] == "1.000"  # nothing the model read: judged as an empty line is
    assert cli.main([*run, "--confidence", "json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["translation"] for o in objects] == plain and objects[0]["words"]
    assert rows[0][1] == f"{objects[0]['confidence']:.3f}"  # the light pass and the full one agree


def test_a_line_beyond_the_text_formats_bounds_goes_plain_alone(random_checkpoint):
    # one such line used to send every marked line of its chunk down the plain path (a review)
    import warnings

    from qkv.cli.document import text_format_writer
    from qkv.document.formats import MAX_SEGMENT_WORDS
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint

    loaded = checkpoint.load(random_checkpoint)
    write = text_format_writer(Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=1)))
    long = " ".join(["dog"] * (MAX_SEGMENT_WORDS + 1)) + "\tA cat"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long line is cut to the model's positions, with a warning
        out = write(["Visit https://example.com/dog today.", "A dog\tA cat", long])
    assert len(out) == 3 and out[0].count("https://example.com/dog") == 1 and out[1].count("\t") == 1
    assert "\t" not in out[2]  # the long line alone translated as a plain line
