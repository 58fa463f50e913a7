"""Glossary files and term matching (qkv.infer.glossary), and the constrained search's bookkeeping
(qkv.infer.constrained): what is a term, where it stands, when a form counts as written."""

from __future__ import annotations

import pytest

from qkv.errors import QkvError
from qkv.infer.constrained import _Beam, _advance, _allocate, _met_at_end
from qkv.infer.glossary import Glossary, missing
from qkv.infer.numbers import Numbers
from qkv.infer.terms import _nearest_form, substitute


def test_a_glossary_file_gives_entries_with_their_forms(tmp_path):
    path = tmp_path / "terms.tsv"
    path.write_bytes("\ufeff# product names\n\ndog\tHund\tHunde\t Hundes \r\nNew York\tNew York\n".encode())
    glossary = Glossary.read(path)
    assert [(t.source, t.forms, t.line) for t in glossary.terms] == [
        ("dog", ("Hund", "Hunde", "Hundes"), 3), ("New York", ("New York",), 4)]


@pytest.mark.parametrize("content, message", [
    (b"dog\tHund\ncat\n", "line 2: needs a source term and a target term separated by a tab"),
    (b"dog\t\tHunde\n", "line 1: column 2 is empty"),
    (b"dog\tHund\n \tKatze\n", "line 2: column 1 is empty"),
    (b"dog\tHund\n\xff\tKatze\n", "line 2 is not valid UTF-8"),
    (b"dog\tHund\nDog\tHunde\n", "line 2: 'Dog' is already listed on line 1"),
    (b"dog\t" + b"x" * 201 + b"\n", "line 1: column 2 has 201 characters"),
])
def test_a_malformed_glossary_is_one_line_naming_its_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_bytes(content)
    with pytest.raises(QkvError) as error:
        Glossary.read(path)
    assert str(error.value).startswith(f"{path} {message}")
    assert "\n" not in str(error.value)


def test_terms_match_whole_words_with_the_documented_case_rules():
    glossary = Glossary.parse(["cat\tKatze", "Apple\tApple", "New York\tNew York", "New York City\tNew York City"])
    text = "A cat, a category, CAT and apple at Apple in New  York City and New York."
    found = glossary.matches(text)
    # "category" holds "cat" but not as a word; "apple" is not "Apple"; the longer "New York City" wins
    assert [(m.term.source, text[m.start : m.end], m.words) for m in found] == [
        ("cat", "cat", (1,)), ("cat", "CAT", (4,)), ("Apple", "Apple", (8,)), ("New York City", "New  York City", (10, 11, 12)),
        ("New York", "New York", (14, 15))]
    assert found[1].start == text.index("CAT") and found[-1].start == text.rindex("New York")


def test_a_form_is_found_as_written_or_with_a_capital_first_letter():
    glossary = Glossary.parse(["red\trot\troten", "dog\tHund"])
    red, dog = glossary.terms
    assert glossary.found(red, "Rot und roten, nicht rotes") == [("rot", 0, 3), ("roten", 8, 13)]
    assert glossary.found(dog, "der hund, die Hunde") == []  # "Hund" asks for a capital; "Hunde" is not one of its forms


def test_a_term_twice_in_the_source_needs_its_form_twice():
    glossary = Glossary.parse(["dog\tHund"])
    matches = glossary.matches("a dog and another dog")
    assert [m.start for m in missing(glossary, matches, "ein Hund und ein anderer")] == [18]
    assert missing(glossary, matches, "ein Hund und noch ein Hund") == []


def test_a_form_counts_only_as_a_whole_word():
    # Constraint 0 has one form of two pieces (5, 6); piece 9 continues a word, 1 starts one.
    constraints, joins = [[[5, 6]]], frozenset({9})
    beam = _Beam((), 0.0, (False,), frozenset())
    met, partial = _advance(beam, 5, constraints, joins)
    met, partial = _advance(_Beam((5,), 0.0, met, partial), 6, constraints, joins)
    assert met == (False,) and partial == {(0, 0, 2)}  # complete, not yet met
    done = _Beam((5, 6), 0.0, met, partial)
    assert _met_at_end(done, constraints) == (True,)  # the output's end is a boundary
    assert _advance(done, 1, constraints, joins)[0] == (True,)
    assert _advance(done, 9, constraints, joins) == ((False,), frozenset())  # "Hund" + "en": not the term


def test_one_output_of_a_form_meets_one_of_two_equal_constraints():
    constraints = [[[5]], [[5]]]  # a term asked for twice
    pending = _Beam((5,), 0.0, (False, False), frozenset({(0, 0, 1), (1, 0, 1)}))
    assert _advance(pending, 1, constraints, frozenset())[0] == (True, False)
    assert _met_at_end(pending, constraints) == (True, False)  # nor at the output's end


def test_beam_slots_are_shared_among_the_banks_fullest_first():
    banks = {0: [(-1.0, 0, 1, None, None), (-1.5, 0, 2, None, None), (-2.0, 0, 3, None, None)], 2: [(-9.0, 0, 4, None, None)]}
    # two banks: 2 slots to the fuller one (it has one candidate: its other slot goes to the best left over)
    assert [c[2] for c in _allocate(banks, K=4)] == [4, 1, 2, 3]
    assert [c[2] for c in _allocate(banks, K=2)] == [4, 1]  # however badly the fuller bank scores


def test_terms_are_written_after_their_source_words():
    from qkv.data.term_annotation import annotate, annotated

    assert annotate("A man climbs a ladder .", [(15, 21, "Leiter"), (2, 5, "Mann")]) == "A man # Mann # climbs a ladder # Leiter # ."
    src = ["a b c", "d e", "f"] * 100
    terms = [[(0, "X"), (2, "Y")], [(1, "Z")], []] * 100
    once, again = annotated(src, terms, 0.3, seed=4), annotated(src, terms, 0.3, seed=4)
    assert once == again and once != annotated(src, terms, 0.3, seed=5)  # drawn from the seed alone
    changed = [a for a, s in zip(once, src) if a != s]
    assert 45 <= len(changed) <= 135 and all("#" in a for a in changed)  # about 30% of the 200 pairs that have terms
    assert all(a == "f" for a in once[2::3])  # a pair without pseudo-terms is never annotated


def test_pseudo_terms_are_found_by_their_pair_and_a_wrong_file_is_one_line(tmp_path):
    from qkv.data.term_annotation import pair_key, read_pseudo_terms

    path = tmp_path / "terms.jsonl"
    path.write_text(f'["{pair_key("a dog", "ein Hund")}", [[1, "Hund"]]]\n["{pair_key("x", "y")}", []]\n', encoding="utf-8")
    # found by its text, wherever the pair stands; a pair the file lacks has none
    assert read_pseudo_terms(path, ["b", "a dog"], ["c", "ein Hund"]) == [[], [(1, "Hund")]]
    with pytest.raises(QkvError, match="holds none of the 1 training pairs"):
        read_pseudo_terms(path, ["a cat"], ["eine Katze"])
    path.write_text('{"a": 1}\n', encoding="utf-8")
    with pytest.raises(QkvError, match="line 1 is not a JSON list"):
        read_pseudo_terms(path, ["a"], ["b"])


def test_two_terms_with_one_form_need_it_twice_and_are_answered_at_two_places():
    """"man" -> "Mann" and "guy" -> "Mann" in one sentence: one "Mann" answered both (both reported found
    at the same word, no constrained search for the second); a place now answers one term."""
    from qkv.infer.terms import term_uses

    glossary = Glossary.parse(["man\tMann", "guy\tMann"])
    sentence = "A man talks to a guy"
    matches = glossary.matches(sentence)
    assert [m.term.source for m in missing(glossary, matches, "Ein Mann spricht mit einem Typen")] == ["guy"]
    assert missing(glossary, matches, "Ein Mann spricht mit einem Mann") == []
    uses = term_uses(glossary, matches, sentence, "Ein Mann spricht mit einem Mann")
    assert [(u.source, u.found, u.target_words) for u in uses] == [("man", "Mann", (1,)), ("guy", "Mann", (5,))]
    # the k-th time a term stands in the source is still answered by the k-th place its form stands
    dogs = Glossary.parse(["dog\tHund"])
    uses = term_uses(dogs, dogs.matches("a dog and another dog"), "a dog and another dog", "ein Hund und noch ein Hund")
    assert [u.target_words for u in uses] == [(1,), (5,)]


def test_a_place_two_terms_could_take_goes_to_the_one_that_has_no_other():
    """"guy" (Mann or Kerl) stands before "man" (Mann only): taking the first place it may would leave
    "man" unanswered in "Ein Mann und ein Kerl"; the matching moves "guy" to "Kerl"."""
    from qkv.infer.glossary import answers

    glossary = Glossary.parse(["man\tMann", "guy\tMann\tKerl"])
    sentence, translation = "A guy and a man", "Ein Mann und ein Kerl"
    matches = glossary.matches(sentence)
    assert [m.term.source for m in matches] == ["guy", "man"]
    assert [h and h[0] for h in answers(glossary, matches, translation)] == ["Kerl", "Mann"]
    assert missing(glossary, matches, translation) == []
    assert len(missing(glossary, matches, "Ein Mann und ein Hund")) == 1  # one "Mann" answers one of the two


def _misses(glossary: Glossary, source: str, translation: str):
    return missing(glossary, glossary.matches(source), translation)


def test_a_missing_term_is_written_over_the_words_its_source_words_align_to():
    glossary = Glossary.parse(["life jacket\tRettungsweste\tRettungswesten"])
    source = "A man in a red life jacket sits in a boat."
    translation = "Ein Mann in einer roten Schwimmweste sitzt in einem Boot."
    links = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 5), (7, 6), (8, 7), (9, 8), (10, 9)]
    out = substitute(translation, _misses(glossary, source, translation), links)
    assert out == "Ein Mann in einer roten Rettungsweste sitzt in einem Boot."
    # The form whose ending is most like the replaced word's: the inflection the model chose.
    vests = Glossary.parse(["vest\tWeste\tWesten"])
    assert substitute("Zwei Männer in Jacken.", _misses(vests, "Two men in a vest.", ""), [(4, 3)]) == "Zwei Männer in Westen."
    assert _nearest_form(("Rettungsweste", "Rettungswesten"), "Schwimmwesten") == "Rettungswesten"
    assert _nearest_form(("Rettungsweste", "Rettungswesten"), "Boot") == "Rettungsweste"  # no ending shared: the asked form


def test_substitution_keeps_punctuation_and_a_sentence_initial_capital_and_leaves_what_it_cannot_place():
    glossary = Glossary.parse(["dog\thund", "cat\tKatze", "ball\tBall"])
    source = "dog and cat and ball"
    assert substitute("„Tier“ und Maus.", _misses(glossary, source, ""), [(0, 0), (2, 2)]) == "„Hund“ und Katze."
    # Words between the aligned ones, a word another term answers, or no link at all: left for the search.
    assert substitute("Tier und Maus", _misses(glossary, "cat", ""), [(0, 0), (0, 2)]) == "Tier und Maus"
    misses = _misses(glossary, source, "Tier und Katze")
    assert [m.term.source for m in misses] == ["dog", "ball"]
    assert substitute("Tier und Katze", misses, [(0, 2), (4, 2)], keep={2}) == "Tier und Katze"
    assert substitute("Tier und Katze", misses, [(2, 2)], keep={2}) == "Tier und Katze"
    assert substitute("Tier - Katze", _misses(glossary, "dog", ""), [(0, 1)]) == "Tier - Katze"  # punctuation alone


def test_a_number_replaces_only_the_digits_of_the_word_it_goes_to():
    numbers = Numbers(None)
    source = "A dog runs at 7:45 for $25."
    misses = _misses(numbers, source, "")
    assert [m.term.source for m in misses] == ["7:45", "25"]
    out = substitute("Ein Hund rennt um 155 für55.", misses, [(4, 4), (6, 5)])
    assert out == "Ein Hund rennt um 7:45 für25."
    assert not missing(numbers, numbers.matches(source), out)
    assert substitute("Ein Hund rennt um sieben.", misses[:1], [(4, 4)]) == "Ein Hund rennt um 7:45."


def test_mending_by_the_head_reads_the_encoder_outputs_of_the_first_search(random_checkpoint, monkeypatch):
    import dataclasses

    import torch

    import qkv.inspect.terms as terms
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint
    from qkv.model.transformer import Transformer

    loaded = checkpoint.load(random_checkpoint)
    torch.manual_seed(2)  # a random model with a full-context alignment head: its words miss the terms
    model = Transformer(dataclasses.replace(loaded.model.config, alignment_layer=0, alignment_context="full")).eval()
    translator = Translator(model, loaded.tokenizer)
    texts = ["A dog runs across the green field.", "Two children play with a red ball."]
    glossary = Glossary.from_pairs([["dog", "Hund"], ["ball", "Ball"]])
    plain = terms.alignment_substitution(model, loaded.tokenizer)  # encodes the sentences again
    expected = terms.translate_with_glossary(translator, texts, glossary, align=plain)
    aligning, encoded_while_aligning = [], []
    align, encode = terms.align, model.encode

    def watched_align(*args, **kwargs):
        aligning.append(1)
        try:
            return align(*args, **kwargs)
        finally:
            aligning.clear()

    monkeypatch.setattr(terms, "align", watched_align)
    monkeypatch.setattr(model, "encode", lambda *a, **k: encoded_while_aligning.append(bool(aligning)) or encode(*a, **k))
    found = terms.translate_with_glossary(translator, texts, glossary)  # align="head"
    assert any(s.substituted for r in expected for s in r.sentences)  # mending ran
    assert encoded_while_aligning and not any(encoded_while_aligning)  # the search encoded; the alignment pass did not
    assert [r.text for r in found] == [r.text for r in expected]
