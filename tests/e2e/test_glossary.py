"""Glossaries end to end: the constrained search places every term on a trained model, a sentence
without terms translates exactly as without a glossary, and `qkv translate`, `qkv evaluate` and the
server take a glossary, report where each term went, and refuse a malformed one in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from qkv.infer.constrained import constrained_beam_search
from qkv.infer.glossary import Glossary, missing
from qkv.infer.search import DecodeConfig
from qkv.infer.terms import constraint_forms, translate_with_glossary, word_continuations
from qkv.infer.translator import Translator, collate_sources
from qkv.io import checkpoint
from qkv.serve.app import create_app

SOURCES = ["A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.",
           "A woman with a red umbrella walks past a dog and another dog.", "Children run on the beach."]
# Terms the 60-step model would not write by itself: the constrained search must place them.
ENTRIES = ["man\tFeuerwehrmann", "blue shirt\tblaues Oberhemd", "ladder\tLeiter\tLeitern", "umbrella\tRegenschirm",
           "dog\tHund\tHunde", "red\trot\troten\troter"]


def qkv(*args, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def trained(tiny_run):
    return checkpoint.load(tiny_run / "final")


def test_the_constrained_search_places_every_term_on_a_trained_model(trained):
    glossary = Glossary.parse(ENTRIES)
    tok = trained.tokenizer
    matches = [glossary.matches(s) for s in SOURCES]
    constraints = [[[tok.encode_target(f) for f in constraint_forms(m.term)] for m in ms] for ms in matches]
    assert constraints[3] == [] and len(constraints[2]) == 4  # "dog" twice, "red", "umbrella"
    assert any(len(form) > 1 for cs in constraints for forms in cs for form in forms)  # terms of several pieces
    src = collate_sources([tok.encode(s) for s in SOURCES], pad_id=tok.pad_id, eos_id=tok.eos_id)
    config = DecodeConfig(beam_size=4)
    found = constrained_beam_search(trained.model, src, constraints, bos_id=tok.bos_id, eos_id=tok.eos_id, config=config,
                                    joins=word_continuations(tok), beam_size=6)
    for sentence, ms, hyp in zip(SOURCES, matches, found):
        text = tok.decode(hyp.tokens)
        assert all(hyp.met), (sentence, text)
        for term in {m.term for m in ms}:  # each term as often as the source has it, as whole words
            assert len(glossary.found(term, text)) >= sum(m.term == term for m in ms), (term, text)
    # Searched alone, each sentence gets what it got in the batch.
    for i in range(len(SOURCES)):
        alone = constrained_beam_search(trained.model, src[i : i + 1, : int((src[i] != tok.pad_id).sum())], constraints[i : i + 1],
                                        bos_id=tok.bos_id, eos_id=tok.eos_id, config=config, joins=word_continuations(tok), beam_size=6)
        assert alone[0].tokens == found[i].tokens


def test_the_repeat_ban_spares_the_tokens_that_write_a_term(trained):
    # A form that repeats a bigram itself ("Hund Hund Hund" repeats "Hund Hund"): with repeated bigrams banned
    # (the loop guard's second search) the search must still write it, and repeat nothing else.
    tok = trained.tokenizer
    form = tok.encode_target("Hund Hund Hund")
    assert len(form) >= 3 and len(set(zip(form, form[1:]))) < len(form) - 1  # the form itself repeats a bigram
    src = collate_sources([tok.encode(SOURCES[1])], pad_id=tok.pad_id, eos_id=tok.eos_id)
    config = DecodeConfig(beam_size=4, no_repeat_ngram_size=2)
    hyp, = constrained_beam_search(trained.model, src, [[[form]]], bos_id=tok.bos_id, eos_id=tok.eos_id, config=config,
                                   joins=word_continuations(tok), beam_size=4)
    assert all(hyp.met) and "Hund Hund Hund" in tok.decode(hyp.tokens), tok.decode(hyp.tokens)
    at = next(i for i in range(len(hyp.tokens)) if hyp.tokens[i : i + len(form)] == form)
    bigrams = [tuple(hyp.tokens[i : i + 2]) for i in range(len(hyp.tokens) - 1) if not at <= i < at + len(form) - 1]
    assert len(bigrams) == len(set(bigrams))  # outside the term, no bigram twice


def test_a_length_cap_still_places_every_term_within_it(trained):
    glossary = Glossary.parse(ENTRIES)
    tok = trained.tokenizer
    matches = [glossary.matches(s) for s in SOURCES[:3]]
    constraints = [[[tok.encode_target(f) for f in constraint_forms(m.term)] for m in ms] for ms in matches]
    src = collate_sources([tok.encode(s) for s in SOURCES[:3]], pad_id=tok.pad_id, eos_id=tok.eos_id)
    search = lambda caps: constrained_beam_search(trained.model, src, constraints, bos_id=tok.bos_id, eos_id=tok.eos_id,  # noqa: E731
                                                  config=DecodeConfig(beam_size=4), joins=word_continuations(tok), beam_size=6,
                                                  max_lengths=caps)
    caps = [sum(max(len(f) for f in forms) for forms in cs) + 1 for cs in constraints]  # the terms and one token more
    assert any(len(h.tokens) > cap for h, cap in zip(search(None), caps))  # uncapped, an output is longer
    for hyp, cap in zip(search([1] * len(caps)), caps):  # one token of its own; the search adds the terms
        assert len(hyp.tokens) <= cap and all(hyp.met), (cap, tok.decode(hyp.tokens))


def test_a_constrained_output_is_no_longer_than_the_first_translation_and_its_terms(trained):
    from qkv.infer.terms import FIRST_SLACK

    glossary = Glossary.parse(ENTRIES)
    tok = trained.tokenizer
    translator = Translator(trained.model, tok, DecodeConfig(beam_size=4))
    firsts = [h[0].tokens for h in translator.translate_ids([translator.encode(s) for s in SOURCES])]
    results = translate_with_glossary(translator, SOURCES, glossary, always=True)
    searched = [(r.sentences[0], first) for r, first in zip(results, firsts) if r.sentences[0].constrained]
    assert len(searched) == 2  # the first and third hold terms ("dogs" is not the term "dog")
    for sentence, first in searched:
        terms = sum(max(len(tok.encode_target(f)) for f in constraint_forms(u.term)) for u in sentence.uses)
        assert len(sentence.tokens) <= len(first) + terms + FIRST_SLACK
        assert all(u.found for u in sentence.uses), sentence.translation


def test_a_glossary_changes_only_the_sentences_that_miss_a_term(trained):
    translator = Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=4))
    plain = translator.translate(SOURCES)
    results = translate_with_glossary(translator, SOURCES, Glossary.parse(ENTRIES))
    assert results[1].text == plain[1] and results[3].text == plain[3]  # no term ("dogs" is not "dog")
    assert [r.sentences[0].constrained for r in results] == [True, False, True, False]
    assert all(u.found for r in results for s in r.sentences for u in s.uses)
    again = translate_with_glossary(translator, SOURCES, Glossary.parse(ENTRIES), always=True)
    assert [r.text for r in again][1::2] == plain[1::2]


def test_a_translation_that_misses_a_term_is_mended_where_its_source_term_aligns(trained, monkeypatch):
    """Given an aligner, a sentence whose translation misses a term gets the term's form in place of the
    words its source words align to, and no second search; where the aligner links nothing, the
    constrained search runs as without one, at the mended beam."""
    import qkv.infer.terms as terms

    translator = Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=4))
    glossary = Glossary.parse(ENTRIES)
    plain = translator.translate(SOURCES)
    searched = translate_with_glossary(translator, SOURCES, glossary)

    def diagonal(sources, targets):  # source word k of m with target word k (n - 1) // (m - 1) of n
        links = []
        for source, target in zip(sources, targets):
            m, n = len(source.split()), len(target.split())
            links.append([(k, k * (n - 1) // max(m - 1, 1)) for k in range(m)] if n else [])
        return links

    mended = translate_with_glossary(translator, SOURCES, glossary, align=diagonal)
    assert [r.text for r in mended][1::2] == plain[1::2]  # no term: as without a glossary
    substituted = [i for i, r in enumerate(mended) if r.sentences[0].substituted]
    assert substituted, [r.as_dict() for r in mended]
    for i in substituted:
        sentence = mended[i].sentences[0]
        assert not sentence.constrained and all(u.found for u in sentence.uses), mended[i].as_dict()
        assert trained.tokenizer.decode(sentence.tokens) == sentence.translation
        # Every word but the terms' is the plain translation's, in order: the terms went where their source terms align.
        (links,) = diagonal([SOURCES[i]], [plain[i]])
        misses = missing(glossary, glossary.matches(SOURCES[i]), plain[i])
        replaced = {t for s, t in links if any(s in m.words for m in misses)}
        written = {k for u in sentence.uses for k in u.target_words}
        words, plain_words = sentence.translation.split(), plain[i].split()
        assert [w for k, w in enumerate(words) if k not in written] == [w for k, w in enumerate(plain_words) if k not in replaced]
    # Where the aligner links nothing, the sentences that miss a term are searched, with the mended beam.
    nothing = translate_with_glossary(translator, SOURCES, glossary, align=lambda sources, targets: [[] for _ in sources])
    assert not any(s.substituted for r in nothing for s in r.sentences)
    monkeypatch.setattr(terms, "CONSTRAINED_BEAM", terms.MENDED_BEAM)
    assert [r.as_dict() for r in nothing] == [r.as_dict() for r in translate_with_glossary(translator, SOURCES, glossary)]


def test_translate_with_a_glossary_and_its_report(tiny_run, tmp_path):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("".join(e + "\n" for e in ENTRIES), encoding="utf-8")
    stdin = "".join(s + "\n" for s in SOURCES) + "\n"
    plain = qkv("translate", "--checkpoint", tiny_run, "--beam", "4", cwd=tmp_path, stdin=stdin)
    result = qkv("translate", "--checkpoint", tiny_run, "--beam", "4", "--glossary", glossary, cwd=tmp_path, stdin=stdin)
    assert result.returncode == 0, result.stderr
    lines, before = result.stdout.splitlines(), plain.stdout.splitlines()
    assert len(lines) == len(SOURCES) + 1 and lines[1::2] == before[1::2] and lines[-1] == ""
    assert "Feuerwehrmann" in lines[0] and "Regenschirm" in lines[2]
    report = qkv("translate", "--checkpoint", tiny_run, "--beam", "4", "--glossary", glossary, "--glossary-report",
                 cwd=tmp_path, stdin=stdin)
    objects = [json.loads(line) for line in report.stdout.splitlines()]
    assert [o["translation"] for o in objects] == lines
    first = {t["source"]: t for t in objects[0]["terms"]}
    assert set(first) == {"man", "blue shirt", "ladder"}
    assert first["blue shirt"]["source_words"] == [4, 5] and first["blue shirt"]["found"] == "blaues Oberhemd"
    words = lines[0].split()
    assert " ".join(words[i] for i in first["blue shirt"]["target_words"]).startswith("blaues Oberhemd")
    assert all(isinstance(t["placed"], bool) and t["aligned_to"] is not None for t in first.values())
    assert objects[1]["terms"] == [] and objects[-1] == {"translation": "", "terms": []}
    assert [t["source"] for t in objects[2]["terms"]].count("dog") == 2


@pytest.mark.parametrize("content, message", [
    (b"man\tMann\nladder\n", "line 2: needs a source term and a target term separated by a tab"),
    (b"man\t\n", "line 1: column 2 is empty"),
    (b"man\tMann\n\xfe\xff\n", "line 2 is not valid UTF-8"),
])
def test_a_malformed_glossary_is_one_line_before_anything_is_loaded(random_checkpoint, tmp_path, content, message):
    glossary = tmp_path / "bad.tsv"
    glossary.write_bytes(content)
    result = qkv("translate", "--checkpoint", random_checkpoint, "--glossary", glossary, cwd=tmp_path, stdin="a man\n")
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
    missing = qkv("translate", "--checkpoint", random_checkpoint, "--glossary", tmp_path / "none.tsv", cwd=tmp_path, stdin="a\n")
    assert "cannot read the glossary" in missing.stderr
    assert "not with --n-best" in qkv("translate", "--checkpoint", random_checkpoint, "--glossary", glossary, "--n-best", "2",
                                      cwd=tmp_path, stdin="a\n").stderr


def test_hostile_glossaries_cost_no_line(random_checkpoint):
    loaded = checkpoint.load(random_checkpoint)
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=2))
    many = Glossary.parse([f"word{i}\tWort{i}" for i in range(300)] + ["dog\tHund", "the green field\tdie grüne Wiese",
                                                                          "green\tgrün", "A dog runs across the green field and far beyond it\tx"])
    texts = ["A dog runs across the green field.", "", "green green green green", "word7 word8 word9 word10 word11 word12"]
    results = translate_with_glossary(translator, texts, many)
    assert len(results) == len(texts) and results[1].text == ""
    # overlapping terms: the longest wins ("the green field", not "green"); a term longer than the sentence matches nothing
    assert [u.term.source for u in results[0].sentences[0].uses] == ["dog", "the green field"]
    assert len(results[2].sentences[0].uses) == 4 and len(results[3].sentences[0].uses) == 6
    # "Wort7": the 60-piece vocabulary has no digits; such a term is reported, never searched for
    assert [u.writable for u in results[3].sentences[0].uses] == [False] * 6
    assert results[3].text == translator.translate([texts[3]])[0] and not results[3].sentences[0].constrained
    for r in results:  # every term that can be written is placed, or the sentence says the search could not
        s = r.sentences[0]
        assert all(u.found for u in s.uses if u.writable) or s.unplaceable


def test_evaluate_prints_the_term_use(tiny_run, tmp_path):
    src, ref, glossary = tmp_path / "src.en", tmp_path / "ref.de", tmp_path / "terms.tsv"
    src.write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    ref.write_text("Ein Feuerwehrmann.\nZwei Hunde.\nEine Frau.\nKinder.\n", encoding="utf-8")
    glossary.write_text("".join(e + "\n" for e in ENTRIES), encoding="utf-8")
    result = qkv("evaluate", "--checkpoint", tiny_run, "--src-file", src, "--ref-file", ref, "--glossary", glossary, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "glossary: 7 terms asked for; 7 found (100.0%)" in result.stdout, result.stdout
    assert "; 0 sentences mended by alignment, " in result.stdout, result.stdout  # the tiny model has no alignment head


def post(app, *bodies: dict) -> list:
    """The server's answers to ``bodies``, in order, within one lifespan of ``app``."""
    import asyncio

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                return [await client.post("/v1/translate", json=body) for body in bodies]

    return asyncio.run(scenario())


def test_the_server_takes_a_glossary_and_says_where_each_term_went(tiny_run):
    body = {"texts": SOURCES[:2], "beam_size": 4, "glossary": [e.split("\t") for e in ENTRIES]}
    with_terms, without = post(create_app(tiny_run), body, body | {"glossary": None})
    assert with_terms.status_code == 200, with_terms.text
    answer = with_terms.json()
    loaded = checkpoint.load(tiny_run)
    expected = translate_with_glossary(Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=4)), SOURCES[:2], Glossary.parse(ENTRIES))
    assert answer["translations"] == [r.text for r in expected]
    assert [[t["source"] for t in ts] for ts in answer["terms"]] == [["man", "blue shirt", "ladder"], []]
    assert all(t["found"] and "placed" in t for t in answer["terms"][0])
    assert "terms" not in without.json() and without.json()["translations"][1] == answer["translations"][1]


def test_the_server_cuts_and_recases_a_glossarys_texts_as_the_command_does(tiny_run, tmp_path):
    # a newcomer's review: a glossary (or numbers) made the server search a paragraph whole, in capitals
    from qkv.data.sentences import TextOptions

    text = SOURCES[0] + " " + SOURCES[2].upper()
    body = {"texts": [text, SOURCES[3]], "beam_size": 4, "glossary": [e.split("\t") for e in ENTRIES]}
    (answer,) = post(create_app(tiny_run, loop_guard=2), body)  # the loop guard qkv serve runs by default
    assert answer.status_code == 200, answer.text
    loaded = checkpoint.load(tiny_run)
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=4, loop_guard=2), text=TextOptions(split="en", recase=True))
    expected = translate_with_glossary(translator, [text, SOURCES[3]], Glossary.parse(ENTRIES))
    assert len(expected[0].sentences) == 2 and answer.json()["translations"] == [r.text for r in expected]
    assert [(t["source"], t.get("sentence")) for t in answer.json()["terms"][0]] == [
        ("man", 0), ("blue shirt", 0), ("ladder", 0), ("RED", 1), ("UMBRELLA", 1), ("DOG", 1), ("DOG", 1)]
    command = qkv("translate", "--checkpoint", tiny_run, "--beam", "4", "--glossary", tmp_path / "g.tsv", cwd=tmp_path,
                  stdin=text + "\n") if (tmp_path / "g.tsv").write_text("".join(e + "\n" for e in ENTRIES)) else None
    assert command.returncode == 0 and command.stdout.splitlines() == [expected[0].text], command.stderr


def test_pseudo_terms_then_term_aware_fine_tuning(random_checkpoint, tmp_path):
    from tests.conftest import RANDOM_MODEL_SENTENCES

    english, german = RANDOM_MODEL_SENTENCES[0::2], RANDOM_MODEL_SENTENCES[1::2]
    src, tgt, terms = tmp_path / "train.en", tmp_path / "train.de", tmp_path / "terms.jsonl"
    src.write_text("".join(s + "\n" for s in english * 4), encoding="utf-8")
    tgt.write_text("".join(s + "\n" for s in german * 4), encoding="utf-8")
    result = qkv("pseudo-terms", "--checkpoint", random_checkpoint, "--train-src", src, "--train-tgt", tgt, "--out", terms, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = [json.loads(line)[1] for line in terms.read_text(encoding="utf-8").splitlines()]
    assert len(found) == 4 * len(english)
    for pair, source, target in zip(found, english * 4, german * 4):  # one-to-one links of words of 4 or more letters
        assert all(word.isalpha() and len(word) >= 4 and word in target.split() for _, word in pair)
        assert all(source.split()[i].isalpha() and len(source.split()[i]) >= 4 for i, _ in pair)
    assert "exists" in qkv("pseudo-terms", "--checkpoint", random_checkpoint, "--train-src", src, "--train-tgt", tgt,
                           "--out", terms, cwd=tmp_path).stderr
    train = ("train", "--init-from", random_checkpoint, "--train-src", src, "--train-tgt", tgt, "--max-steps", "2",
             "--train", "lr=1e-4", "warmup_steps=1", "--src", "en", "--tgt", "de")
    refused = qkv(*train, "--data", "term_share=0.5", "--out", tmp_path / "run0", cwd=tmp_path)
    assert "term_share needs term_file" in refused.stderr
    result = qkv(*train, "--data", "term_share=0.5", f"term_file={terms}", "--out", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert checkpoint.load(tmp_path / "run").model.term_aware and not checkpoint.load(random_checkpoint).model.term_aware


def test_a_capitalised_term_in_a_title_case_line_and_two_terms_of_one_form_are_asked_for(trained):
    """A term with a capital letter standing as written in a Title Case line was neither asked for nor
    reported ("terms": []): the line was matched after it was recased for the search. And two terms
    with one form ("man" and "guy", both "Mann") were both reported at one "Mann", with no constrained
    search for the second: now the translation holds the form twice, each term at its own word."""
    from qkv.data.sentences import TextOptions

    translator = Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=2), text=TextOptions(split="en", recase=True))
    title, both = translate_with_glossary(translator, ["Two Dogs Run Through New York", "A man talks to a guy."],
                                          Glossary.parse(["New York\tNew York", "man\tMann", "guy\tMann"]))
    (term,) = title.terms()
    assert term["source"] == "New York" and term["found"] == "New York", title.as_dict()
    assert "New York" in title.text
    man, guy = both.terms()
    assert (man["source"], guy["source"]) == ("man", "guy") and man["found"] == guy["found"] == "Mann", both.as_dict()
    assert man["target_words"] != guy["target_words"] and both.text.count("Mann") >= 2


@pytest.fixture(scope="module")
def guided_run(tmp_path_factory):
    """The tiny preset trained 60 updates with guided alignment (an alignment head)."""
    from qkv.cli.main import main
    from tests.conftest import require_multi30k

    multi30k = require_multi30k()

    run = tmp_path_factory.mktemp("guided") / "run"
    assert main(["train", "--preset", "tiny", "--data-dir", str(multi30k), "--out", str(run), "--no-progress", "--max-steps", "60",
                 "--train", "alignment=0.5", "--data", "valid_limit=20"]) == 0
    return run


def test_qkv_translate_mends_by_the_alignment_head_where_the_model_has_one(guided_run, trained, tmp_path):
    """A model with an alignment head mends a translation that misses a term (``"substituted": true``, no
    constrained search); a model without one has no aligner and searches again."""
    from qkv.inspect.terms import alignment_substitution

    assert alignment_substitution(trained.model, trained.tokenizer) is None
    assert alignment_substitution(checkpoint.load(guided_run / "final").model, trained.tokenizer) is not None
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("".join(e + "\n" for e in ENTRIES), encoding="utf-8")
    # One single-word term a sentence: the 60-update head may link the words of several terms to one word
    # of its short translations, which no substitution can share (those sentences are searched).
    stdin = "A man is standing.\nA dog runs on the grass.\nChildren play with an umbrella.\n"
    report = qkv("translate", "--checkpoint", guided_run, "--beam", "4", "--glossary", glossary, "--glossary-report",
                 cwd=tmp_path, stdin=stdin)
    assert report.returncode == 0, report.stderr
    objects = [json.loads(line) for line in report.stdout.splitlines()]
    mended = [o for o in objects if any(t["substituted"] for t in o["terms"])]
    assert mended, objects
    for o in mended:
        assert all(t["found"] and not t["constrained"] and not t["unplaceable"] for t in o["terms"]), o
    plain = qkv("translate", "--checkpoint", guided_run, "--beam", "4", "--glossary", glossary, cwd=tmp_path, stdin=stdin)
    assert plain.stdout.splitlines() == [o["translation"] for o in objects]
    # The server mends as `qkv translate` does, and says so.
    lines = stdin.splitlines()
    body = {"texts": lines, "beam_size": 4, "glossary": [e.split("\t") for e in ENTRIES]}
    (answer,) = post(create_app(guided_run), body)
    assert answer.status_code == 200, answer.text
    # (Its translations are not the command's: the server's search has no loop guard by default.)
    terms = answer.json()["terms"]
    assert any(t["substituted"] for ts in terms for t in ts), terms
    assert all(t["found"] and not t["constrained"] for ts in terms if any(t["substituted"] for t in ts) for t in ts), terms
    # The library's entry mends as the command does.
    import qkv as library

    translator = library.Translator.from_checkpoint(guided_run)
    results = library.translate_with_glossary(translator, lines, library.Glossary.parse(ENTRIES))
    assert [[t["substituted"] for t in r.terms()] for r in results] == [[t["substituted"] for t in o["terms"]] for o in objects]
    searched = library.translate_with_glossary(translator, lines, library.Glossary.parse(ENTRIES), align=None)
    assert not any(t["substituted"] for r in searched for t in r.terms())
