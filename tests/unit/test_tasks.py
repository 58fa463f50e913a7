import datetime as dt
import re

import pytest

from qkv.data.tasks import (
    FORMATS,
    date_examples,
    date_pairs,
    date_splits,
    english_ordinal,
    english_ordinal_word,
    exact_match,
)

# An independent reader of the sources, written from the languages rather than from qkv.data.tasks' tables.
MONTH_NAMES = {
    **{m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())},
    **{m: i + 1 for i, m in enumerate(
        "january february march april may june july august september october november december".split())},
    **{m: i + 1 for i, m in enumerate(
        "januar februar märz april mai juni juli august september oktober november dezember".split())},
    **{m: i + 1 for i, m in enumerate(
        "janvier février mars avril mai juin juillet août septembre octobre novembre décembre".split())},
    **{m: i + 1 for i, m in enumerate(
        "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split())},
}
WEEKDAY_NAMES = {  # isoweekday: Monday = 1
    **{w: i + 1 for i, w in enumerate("mon tue wed thu fri sat sun".split())},
    **{w: i + 1 for i, w in enumerate("monday tuesday wednesday thursday friday saturday sunday".split())},
    **{w: i + 1 for i, w in enumerate("montag dienstag mittwoch donnerstag freitag samstag sonntag".split())},
    **{w: i + 1 for i, w in enumerate("lundi mardi mercredi jeudi vendredi samedi dimanche".split())},
    **{w: i + 1 for i, w in enumerate("lunes martes miércoles jueves viernes sábado domingo".split())},
}
UNITS = "first second third fourth fifth sixth seventh eighth ninth".split()
TEENS = "tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth".split()
ORDINAL_WORDS = {
    **{w: i + 1 for i, w in enumerate(UNITS)},
    **{w: i + 10 for i, w in enumerate(TEENS)},
    "twentieth": 20,
    "thirtieth": 30,
    **{f"twenty-{w}": 21 + i for i, w in enumerate(UNITS)},
    "thirty-first": 31,
}


def read_date(source: str) -> tuple[dt.date, int | None]:
    """(date, isoweekday named in the source or None)."""
    year_of = lambda y: int(y) if len(y) == 4 else (1900 if int(y) >= 50 else 2000) + int(y)  # noqa: E731
    numeric = re.fullmatch(r"(\d+)([/.])(\d+)\2(\d+)", source)
    if numeric:
        a, _, b, c = numeric.groups()
        if len(a) == 4:
            return dt.date(int(a), int(b), int(c)), None  # year first
        return dt.date(year_of(c), int(b), int(a)), None  # day first, never month first
    day = month = year = weekday = None
    words = [w for token in re.split(r"[\s,]+", source.lower())
             for w in ([token] if token in ORDINAL_WORDS else token.split("-"))]  # 09-May-17, twenty-first
    for word in words:
        word_stem = word.rstrip(".")
        if word_stem in ("the", "of", "de", "le"):
            continue
        if word_stem in WEEKDAY_NAMES:
            weekday = WEEKDAY_NAMES[word_stem]
        elif word_stem in MONTH_NAMES:
            month = MONTH_NAMES[word_stem]
        elif word_stem in ORDINAL_WORDS:
            day = ORDINAL_WORDS[word_stem]
        elif re.fullmatch(r"\d+(st|nd|rd|th|er)?", word_stem):
            digits = re.match(r"\d+", word_stem).group()
            if day is None and not (len(digits) == 4):
                day = int(digits)
                if word_stem != digits:  # the suffix must be the right one
                    assert word_stem in (english_ordinal(day), "1er"), source
            else:
                year = year_of(digits)
        else:
            raise AssertionError(f"unexpected word {word!r} in {source!r}")
    return dt.date(year, month, day), weekday


def test_deterministic_under_seed_and_seeds_differ():
    assert date_pairs(200, seed=3) == date_pairs(200, seed=3)
    assert date_pairs(200, seed=3) != date_pairs(200, seed=4)
    assert date_splits(50, 20, seed=1) == date_splits(50, 20, seed=1)


def test_targets_are_iso_dates_matching_the_source_with_true_weekdays():
    weekdays_checked = 0
    for source, target in date_pairs(2000, seed=0):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", target)
        date = dt.date.fromisoformat(target)
        assert dt.date(1950, 1, 1) <= date <= dt.date(2049, 12, 31)
        parsed, weekday = read_date(source)
        assert parsed == date, (source, target)
        if weekday is not None:
            assert weekday == date.isoweekday(), (source, target)
            weekdays_checked += 1
    assert weekdays_checked > 300


def test_every_format_on_known_dates():
    d = dt.date(2017, 5, 9)  # a Tuesday
    sources = {name: fmt(d) for name, fmt in FORMATS.items()}
    assert sources["en_weekday_dth_of_month_y"] == "Tuesday, 9th of May 2017"
    assert sources["num_dd/mm/yy"] == "09/05/17"
    assert sources["de_d._month_y"] == "9. Mai 2017"
    assert sources["fr_weekday_d_month_y"] == "mardi 9 mai 2017"
    assert sources["es_d_de_month_de_y"] == "9 de mayo de 2017"
    assert sources["en_the_ordinal_of_month_y"] == "the ninth of May, 2017"
    assert len(set(sources.values())) == len(FORMATS)
    for day in (dt.date(1950, 1, 1), dt.date(1999, 12, 31), dt.date(2000, 2, 29), dt.date(2049, 3, 22)):
        for name, fmt in FORMATS.items():
            assert read_date(fmt(day))[0] == day, name
    assert FORMATS["fr_d_month_y"](dt.date(2001, 8, 1)) == "1er août 2001"


def test_english_ordinals():
    assert [english_ordinal(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st"]
    assert [english_ordinal_word(d) for d in (1, 12, 20, 21, 30, 31)] == [
        "first", "twelfth", "twentieth", "twenty-first", "thirtieth", "thirty-first"]


def test_formats_are_varied():
    examples = date_examples(1000, seed=0)
    assert len({e.format for e in examples}) >= 8
    # independently of the labels: the sources' shapes (digits -> 9, letters -> a) differ too
    shapes = {re.sub(r"[^\W\d_]+", "a", re.sub(r"\d", "9", e.source)) for e in examples}
    assert len(shapes) >= 8
    languages = {name.split("_")[0] for name in {e.format for e in examples}}
    assert {"en", "de", "fr", "es", "num"} <= languages


def test_splits_are_disjoint_by_source_and_by_date():
    train, test = date_splits(3000, 500, seed=0)
    assert len(train) == 3000 and len(test) == 500
    assert not {s for s, _ in train} & {s for s, _ in test}
    assert not {t for _, t in train} & {t for _, t in test}
    assert len({t for _, t in test}) == 500  # held-out dates are distinct
    for source, target in train[:200] + test[:200]:
        assert read_date(source)[0] == dt.date.fromisoformat(target)


def test_exact_match():
    assert exact_match(["2017-05-09", "2017-05-10 "], ["2017-05-09", "2017-05-11"]) == 0.5
    assert exact_match(["a"], ["a"]) == 1.0
    with pytest.raises(ValueError, match="hypotheses"):
        exact_match(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        exact_match([], [])
