"""Hostile documents a hunt found (2026-12-07), each read and written without a model: what was lost or
rewritten without a word is now kept or a one-line error, and what took quadratic time is linear."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from qkv.document.formats import MAX_SEGMENT_MARKUP, read
from qkv.document.placement import place
from qkv.document.segments import PLACEHOLDER
from qkv.document.subtitles import _lines
from qkv.errors import QkvError

HEADER = 'msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Plural-Forms: nplurals=2; plural=(n != 1);\\n"\n\n'


def translated(text: str, format: str) -> str:
    """``text`` read, each segment "translated" as its upper case, placed and written back."""
    document = read(text, format)
    return document.write([place(s, s.text.upper(), None) for s in document.segments])


def refused(text: str, format: str, message: str) -> None:
    with pytest.raises(QkvError, match=message):
        read(text, format)


def _seconds(function, *args) -> float:
    """The fastest of three runs (the least disturbed by whatever else the machine runs)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - started)
    return min(times)


@pytest.mark.parametrize("make", [
    lambda n: "A " + "x" * (20 * n) + " runs.",  # one long word: the e-mail pattern rescanned it from every start
    lambda n: "a.b-c+" * (3 * n),
], ids=["long-word", "long-address-like-run"])
def test_placeholders_are_found_in_linear_time(make):
    # 20,000 then 100,000 units (tens of milliseconds, so that a busy machine slows both alike): linear time is
    # five times (15 leaves room for a busy machine), quadratic 25 times.
    small, large = make(20_000), make(100_000)
    list(PLACEHOLDER.finditer(small))  # warm
    ratio = _seconds(lambda: list(PLACEHOLDER.finditer(large))) / max(_seconds(lambda: list(PLACEHOLDER.finditer(small))), 1e-3)
    assert ratio < 15, ratio


def test_an_address_is_still_a_placeholder():
    found = [m.group() for m in PLACEHOLDER.finditer("Mail john.doe+qkv@example.com, or x@y.org.")]
    assert found == ["john.doe+qkv@example.com", "x@y.org"]


def test_cutting_a_cue_into_lines_is_linear():
    small, large = " ".join(["Hund."] * 20_000), " ".join(["Hund."] * 100_000)
    _lines(small, 20_000)
    ratio = _seconds(_lines, large, 100_000) / max(_seconds(_lines, small, 20_000), 1e-3)
    assert ratio < 15, ratio
    assert _lines('Ein <font color="red">Hund</font> rennt', 2) == 'Ein <font color="red">Hund</font>\nrennt'  # never inside a tag


@pytest.mark.parametrize("depth", [12, 40])
def test_a_deep_markdown_list_keeps_every_item(depth):
    text = "".join("  " * i + f"- item {i}\n" for i in range(depth)) + "\nAfter.\n"
    out = translated(text, "markdown")
    assert all(f"ITEM {i}" in out for i in range(depth)) and "AFTER." in out  # markdown-it's preset dropped items past 10


@pytest.mark.parametrize("text", ["> " * 150 + "A dog is running.\n\nAfter.\n",
                                  "".join("  " * i + f"- item {i}\n" for i in range(80))])
def test_markdown_nested_beyond_the_bound_is_refused_not_cut(text):
    refused(text, "markdown", "nested more than 100 deep")


def test_a_byte_order_mark_is_not_text_and_comes_back():
    """``open(path, encoding="utf-8").read()`` keeps a BOM: the API and the server read the heading as one,
    and write the mark back where the document had it, as the file was stored."""
    assert translated("\ufeff# A brown dog\n\nA man runs.\n", "markdown") == "\ufeff# A BROWN DOG\n\nA MAN RUNS.\n"
    assert translated("\ufeff<p>A dog.</p>", "html") == "\ufeff<p>A DOG.</p>"


def test_an_html_block_beyond_the_markup_bound_is_refused():
    fits = "<p>A dog" + "<br>" * (MAX_SEGMENT_MARKUP - 10) + "runs.</p>"
    assert translated(fits, "html").startswith("<p>A DOG")
    refused("<p>A dog" + "<br>" * (MAX_SEGMENT_MARKUP + 1) + "runs.</p>", "html", "pieces of markup")


@pytest.mark.parametrize("text, line", [
    ("WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nA dog --> runs.\n", 4),  # webvtt-py dropped the line
    ("WEBVTT\n\nid --> x\n00:00:01.000 --> 00:00:02.000\nA dog runs.\n", 3),  # and the identifier
])
def test_an_arrow_in_a_webvtt_cue_is_refused_not_dropped(text, line):
    refused(text, "vtt", f"line {line}: '-->' in a cue's text or identifier")


def test_an_arrow_in_a_webvtt_note_is_kept():
    text = "WEBVTT\n\nNOTE a --> b\n\n00:00:01.000 --> 00:00:02.000\nA dog runs.\n"
    assert translated(text, "vtt") == "WEBVTT\n\nNOTE a --> b\n\n00:00:01.000 --> 00:00:02.000\nA DOG RUNS.\n"


def test_a_subrip_timing_inside_a_cue_is_refused_not_translated():
    refused("1\n00:00:01,000 --> 00:00:02,000\nA dog runs\n00:00:03,000 --> 00:00:04,000\nhere.\n", "srt",
            "line 4: a timing line inside a cue's text")
    # a time in the text is text
    assert "1:30:00 -> HERE." in translated("1\n00:00:01,000 --> 00:00:02,000\nA dog runs\nat 1:30:00 -> here.\n", "srt")


@pytest.mark.parametrize("entry, message", [
    ('msgid "A dog\nmsgstr ""\n', "a string not closed"),  # polib read "A do"
    ('#| msgid "A dog\nmsgid "A cat"\nmsgstr ""\n', "a string not closed"),  # a previous msgid too
    ('msgid "A dog runs.\\a"\nmsgstr ""\n', r"the escape \\a"),  # polib wrote back "\\a"
    ('msgid "A \\101 cat"\nmsgstr ""\n', r"the escape \\101"),
    ('msgid "A \\x42 cat"\nmsgstr ""\n', r"the escape \\x42"),
])
def test_a_po_string_polib_would_read_wrong_is_refused(entry, message):
    refused(HEADER + entry, "po", message)


def test_a_po_header_asking_for_millions_of_plural_forms_is_refused():
    text = HEADER.replace("nplurals=2", "nplurals=100000000") + 'msgid "a dog"\nmsgid_plural "dogs"\nmsgstr[0] ""\n'
    refused(text, "po", "nplurals=100000000")


def test_po_tabs_and_a_blank_message_are_kept():
    out = translated(HEADER + 'msgid "Name:\\t%s"\nmsgstr ""\n\nmsgid "%s\\t%d"\nmsgstr ""\n\nmsgid " "\nmsgstr ""\n\n'
                     'msgid "a dog\\n"\n"runs\\n"\nmsgstr ""\n', "po")
    assert 'msgstr "NAME:\\t%s"' in out and 'msgstr "%s\\t%d"' in out and 'msgstr " "' in out
    assert 'msgstr ""\n"A DOG\\n"\n"RUNS\\n"' in out
    if shutil.which("msgfmt"):
        checked = subprocess.run(["msgfmt", "--check", "-o", "/dev/null", "-"], input=out, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr


def test_raw_text_elements_come_back_unescaped_and_untranslated():
    """The standard's parser reads <xmp>, <noembed>, <noframes> and <iframe> text raw: it came back escaped
    ("<xmp>&lt;b&gt;") and translated; now as it was, as <script> always did."""
    out = translated('<p>Fill</p><xmp><b>A man</b> &amp;</xmp><noembed>&amp;</noembed><script>if (a<b) x();</script>', "html")
    assert out == "<p>FILL</p><xmp><b>A man</b> &amp;</xmp><noembed>&amp;</noembed><script>if (a<b) x();</script>"


def test_a_verbatim_elements_own_attributes_are_translated_unless_marked_not_to_be():
    out = translated('<textarea placeholder="Enter your name">a &lt; b</textarea><iframe title="A frame"></iframe>'
                     '<div translate="no" title="keep me">x</div><p>A <span class="notranslate" title="t">b</span> c</p>', "html")
    assert '<textarea placeholder="ENTER YOUR NAME">a &lt; b</textarea>' in out and '<iframe title="A FRAME">' in out
    assert '<div translate="no" title="keep me">x</div>' in out and '<span class="notranslate" title="t">b</span> C' in out
