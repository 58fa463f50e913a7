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
    # titles and reference words that sentencex's English list lacks (a newcomer's review): not sentence ends
    ("A man and Ms. Smith are walking a dog.", ["A man and Ms. Smith are walking a dog."]),
    ("A woman, Ms. Jones, met Dr. Who. They talked.", ["A woman, Ms. Jones, met Dr. Who.", "They talked."]),
    ("The dog weighs approx. 5 kg. Call tel. 555 now.", ["The dog weighs approx. 5 kg.", "Call tel. 555 now."]),
    # but a sentence that ends after a title's word, or a "No." before a capital, still ends
    ("He met Dr. Smith. She left.", ["He met Dr. Smith.", "She left."]),
    ("It is a dog. No. It is a cat.", ["It is a dog.", "No.", "It is a cat."]),
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


def test_a_line_feed_ends_a_sentence_and_comes_back_between_the_translations():
    # the server's texts (a newcomer's review): "A day at the beach\nA family ..." was read as one sentence
    sentences, spaces = split_sentences("A man on a bike\nA dog in the snow \r\n\n  - A girl with a kite\n", "en")
    assert sentences == ["A man on a bike", "A dog in the snow", "- A girl with a kite"] and spaces == ["\n", " \r\n\n  "]
    line = prepare_line("A DAY AT THE BEACH\nA dog runs. A cat sleeps.", TextOptions(split="en", recase=True))
    assert line.sentences == ["A day at the beach", "A dog runs.", "A cat sleeps."] and line.spaces == ["\n", " "]
    assert line.join(["Ein Tag am Strand", "Ein Hund rennt.", "Eine Katze schläft."]) == (
        "EIN TAG AM STRAND\nEin Hund rennt. Eine Katze schläft.")
    assert split_sentences("\n\nA dog runs.\n\n", "en") == (["A dog runs."], [])


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


def test_a_letter_a_no_break_space_and_a_full_stop_are_split_not_a_panic(random_checkpoint):
    # "Plan B\u00a0." made sentencex 1.0.32 panic, and qkv translate lose its whole chunk (issue 72, #14)
    sentences, spaces = split_sentences("Plan B\u00a0. A dog runs.", "en")
    assert ([s.replace("\u00a0", " ") for s in sentences], spaces) == split_sentences("Plan B . A dog runs.", "en")
    for wide in ("\u00a0", "\u2003", "\u3000\u00a0", "\u202f"):
        assert split_sentences(f"I saw Plan B{wide}. Then I left.", "en")[0] == [f"I saw Plan B{wide}.", "Then I left."]
    import io

    from qkv.infer.translator import Translator, translate_stream
    from qkv.io import checkpoint

    loaded = checkpoint.load(random_checkpoint)
    translator = Translator(loaded.model, loaded.tokenizer, text=TextOptions(split="en", recase=True))
    lines = ["A dog runs.", "Plan B\u00a0.", "TWO CHILDREN PLAY. A cat sleeps."]
    out = io.StringIO()
    translate_stream(translator, io.BytesIO("".join(f"{line}\n" for line in lines).encode()), out, name="in")
    assert out.getvalue().count("\n") == 3 and out.getvalue().splitlines()[0] == translator.translate(["A dog runs."])[0]


def test_a_failing_splitter_leaves_its_line_whole_with_a_one_line_warning(monkeypatch):
    import sentencex

    from qkv.data.sentences import SplitterWarning

    class Panic(BaseException):  # what pyo3 raises for a Rust panic: no Exception
        pass

    segment = sentencex.segment

    def fails_on_b(lang, text):
        if "B" in text:
            raise Panic("end byte index 7 is not a char boundary\nmore detail")
        return segment(lang, text)

    monkeypatch.setattr(sentencex, "segment", fails_on_b)
    with pytest.warns(SplitterWarning) as said:
        line = prepare_line("Plan B. A DOG RUNS.", TextOptions(split="en", recase=True))
    assert line.sentences == ["Plan b. a dog runs."]  # one sentence (in Title Case), not cut
    (warning,) = said
    assert "\n" not in str(warning.message) and "Panic: end byte index 7" in str(warning.message)
    assert prepare_line("A dog. A cat.", TextOptions(split="en")).sentences == ["A dog.", "A cat."]  # the others split


class _Reading:
    """A compiled pattern that counts the characters it is given to read."""

    def __init__(self, pattern, counter):
        self.pattern, self.counter = pattern, counter

    def __getattr__(self, name):
        method = getattr(self.pattern, name)

        def counted(*args, **kwargs):
            self.counter[0] += sum(len(a) for a in args if isinstance(a, str))  # sub's text comes after its replacement
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize("line", [
    " ".join(f"{i % 1000}." for i in range(4000)),  # a list's numbers: 22 KB of pieces without a letter (issue 72, #13)
    "x" * 20_000 + ", 1. " + "2, 3. " * 2000,  # a word and its number waiting for a second word
    "a" + "." * 20_000,  # a run of non-spaces with no letter after the first character
    "A dog runs. " + "\n\n" * 4000 + "1.",
    "a" + " " * 20_000 + "b\n" + " \n" * 5000 + "c",  # spaces around line feeds (a text's lines, cut apart)
])
def test_the_splitter_reads_each_character_a_bounded_number_of_times(line, monkeypatch):
    import qkv.data.sentences as sentences

    read = [0]
    for name in ("_LETTER", "_SPACE", "_NUMBER", "_MARKER", "_LETTER_RUN", "_WIDE_BEFORE_STOP", "_WORD"):
        if hasattr(sentences, name):
            monkeypatch.setattr(sentences, name, _Reading(getattr(sentences, name), read))
    prepare_line(line, TextOptions(split="en", recase=True))
    assert read[0] <= 12 * len(line), f"{read[0]} characters read for a line of {len(line)}: not linear"
