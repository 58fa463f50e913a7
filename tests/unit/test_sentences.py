"""Text as people write it: where the sentence splitter cuts (abbreviations, numbers, quotes, lists),
how a line's sentences are put back together, and sentences in capitals (qkv.data.sentences)."""

from __future__ import annotations

import pytest

from qkv.data.sentences import AS_IS, TITLE, UPPER, Line, TextOptions, case_of, lowercased, prepare_line, recased, split_sentences


@pytest.mark.parametrize("line, sentences", [
    ("A man in a blue shirt. Two dogs play in the snow! Is it raining?",
     ["A man in a blue shirt.", "Two dogs play in the snow!", "Is it raining?"]),
    # abbreviations and initials do not end a sentence
    ("Dr. Smith met Mr. Jones at 3 p.m. in the U.S. today. They talked.",
     ["Dr. Smith met Mr. Jones at 3 p.m. in the U.S. today.", "They talked."]),
    ("It is big, e.g. a truck. A dog barks.", ["It is big, e.g. a truck.", "A dog barks."]),
    # decimal points, prices and times do not either
    ("It costs $12.50 at 3.45 pm. That is 3.5 times more.", ["It costs $12.50 at 3.45 pm.", "That is 3.5 times more."]),
    # a full stop inside quotes stays inside its sentence
    ('He said "Stop. Now." and left. She stayed.', ['He said "Stop. Now." and left.', "She stayed."]),
    # a list's numbers go with their item, not at the end of the item before
    ("1. A dog runs; 2. A cat sleeps; 3. Two men walk.", ["1. A dog runs;", "2. A cat sleeps;", "3. Two men walk."]),
    # nor does a date's day after a comma (English rules would cut "Montag, 12." off)
    ("Montag, 12. Mai 1952", ["Montag, 12. Mai 1952"]),
    # a piece without a letter is not a sentence of its own
    ("A dog runs. ... A cat sleeps.", ["A dog runs.", "... A cat sleeps."]),
    ("one sentence without a full stop", ["one sentence without a full stop"]),
    ("", []),
    ("   ", []),
])
def test_the_splitter_cuts_where_sentences_end(line, sentences):
    assert split_sentences(line, "en")[0] == sentences


def test_the_rules_are_the_source_languages():
    # German "am 3. Mai": an ordinal, not a sentence end, by German rules (English rules cut there)
    line = "Ein Mann fährt z. B. Fahrrad. Er ist am 3. Mai da."
    assert split_sentences(line, "de")[0] == ["Ein Mann fährt z. B. Fahrrad.", "Er ist am 3. Mai da."]
    assert split_sentences("A dog. A cat.", "xx")[0] == ["A dog.", "A cat."]  # an unknown language: general rules


def test_the_whitespace_between_sentences_is_kept():
    sentences, spaces = split_sentences("A dog.  A cat.\tA cow.", "en")
    assert sentences == ["A dog.", "A cat.", "A cow."] and spaces == ["  ", "\t"]
    assert Line(sentences, spaces, [AS_IS] * 3).join(["Ein Hund.", "Eine Katze.", "Eine Kuh."]) == "Ein Hund.  Eine Katze.\tEine Kuh."


def test_capitals_are_translated_in_sentence_case_and_written_back():
    assert case_of("TWO DOGS RUN IN THE SNOW.") == UPPER
    assert case_of("NASA") == UPPER and case_of("USA") == AS_IS  # under four letters: a word, not a sentence
    assert case_of("Two dogs from the USA run.") == AS_IS and case_of("12 34.") == AS_IS
    assert lowercased("TWO DOGS RUN.", UPPER) == "Two dogs run."
    assert lowercased("\"1. TWO DOGS\"", UPPER) == "\"1. Two dogs\""
    assert lowercased("Two Dogs.", AS_IS) == "Two Dogs."
    assert recased("Zwei Hunde laufen über die Straße.", UPPER) == "ZWEI HUNDE LAUFEN ÜBER DIE STRASSE."
    assert recased("Zwei Hunde.", AS_IS) == "Zwei Hunde."


def test_titles_are_translated_in_sentence_case():
    assert case_of("A Man In A Blue Shirt Is Standing On A Ladder.") == TITLE
    assert lowercased("A Man In A Blue Shirt.", TITLE) == "A man in a blue shirt."
    assert recased("Ein Mann in einem blauen Hemd.", TITLE) == "Ein Mann in einem blauen Hemd."  # the model's case
    assert case_of("John Smith met Mary Jones.") == AS_IS  # "met": not every word is capitalized
    assert case_of("Ein Mann in einem blauen Hemd steht auf einer Leiter.") == AS_IS  # German nouns alone
    assert case_of("Red Dog") == AS_IS  # too few words to tell a title from a name


def test_a_line_is_prepared_sentence_by_sentence():
    line = prepare_line("A DOG RUNS. A cat sleeps.", TextOptions(split="en", recase=True))
    assert line.sentences == ["A dog runs.", "A cat sleeps."] and line.cases == [UPPER, AS_IS]
    assert line.join(["Ein Hund rennt.", "Eine Katze schläft."]) == "EIN HUND RENNT. Eine Katze schläft."


def test_a_list_items_number_or_bullet_is_put_back_as_written():
    line = prepare_line("1. A dog runs; 2. A cat sleeps; 3. TWO MEN WALK.", TextOptions(split="en", recase=True))
    assert line.sentences == ["A dog runs;", "A cat sleeps;", "Two men walk."]
    assert line.join(["Ein Hund rennt;", "Eine Katze schläft;", "Zwei Männer gehen."]) == \
        "1. Ein Hund rennt; 2. Eine Katze schläft; 3. ZWEI MÄNNER GEHEN."
    assert prepare_line("- A dog runs.", TextOptions(split="en")).join(["Ein Hund rennt."]) == "- Ein Hund rennt."
    # One number is no list: a German date keeps its ordinal in the search (and so does a lone "2." item).
    for text in ("3. Oktober 1990", "3. Oktober 1990. Ein Hund rennt.", "2. A dog runs."):
        line = prepare_line(text, TextOptions(split="de"))
        assert line.sentences[0].startswith(text.split(".")[0] + ".") and all(m == "" for m in line.markers), line
    for text in ("1.5 dogs run.", "3 dogs run.", "2. A dog runs."):  # a number that is no list marker; no split asked
        options = TextOptions() if text.startswith("2.") else TextOptions(split="en")
        assert prepare_line(text, options).sentences == [text]


@pytest.mark.parametrize("text, options", [
    ("A dog. A cat.", TextOptions()),  # no split: one sentence
    ("  A DOG RUNS.  ", TextOptions(split="en")),  # one sentence (not stripped), and no recasing asked
    ("", TextOptions(split="en", recase=True)),
    ("   ", TextOptions(split="en", recase=True)),
])
def test_a_line_that_is_one_sentence_is_translated_as_written(text, options):
    line = prepare_line(text, options)
    assert line.sentences == [text] and line.spaces == [] and line.join(["x"]) == "x"


def test_case_augmentation_recases_about_its_share_from_the_seed_alone():
    from qkv.data.sentences import case_augmented

    src = [f"a man number {i} rides a bike ." for i in range(2000)]
    tgt = [f"ein mann nummer {i} fährt rad ." for i in range(2000)]
    s1, t1 = case_augmented(src, tgt, 0.2, seed=7)
    assert (s1, t1) == case_augmented(src, tgt, 0.2, seed=7) and s1 != case_augmented(src, tgt, 0.2, seed=8)[0]
    caps = [i for i, (s, t) in enumerate(zip(s1, t1)) if s == src[i].upper() and t == tgt[i].upper()]
    titles = [i for i, (s, t) in enumerate(zip(s1, t1)) if s.startswith("A Man Number") and t == tgt[i]]
    untouched = [i for i, (s, t) in enumerate(zip(s1, t1)) if s == src[i] and t == tgt[i]]
    assert len(caps) + len(titles) + len(untouched) == 2000  # nothing else happens to a pair
    assert 150 < len(caps) < 250 and 150 < len(titles) < 250  # half of 20% each, within sampling noise
    assert case_augmented(src, tgt, 0.0, seed=7) == (src, tgt)
