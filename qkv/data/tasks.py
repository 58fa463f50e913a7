"""Synthetic translation tasks generated in code: human-written dates -> ISO 8601.

Why dates: the mapping is exactly checkable (one right answer, scored by exact match), yet it has
the alignments that make attention worth looking at. A month name aligns with two month digits
("Mai", "mayo", "Sep" -> "05", "09"), the day and year are copied but reordered ("May 9, 2017" ->
"2017-05-09"), a two-digit year must be widened ("17" -> "2017"), and some source words (the weekday,
"of", "de", "le") align with nothing. A tiny model learns it in minutes on a CPU, so the whole
train -> translate -> evaluate -> visualize loop can be tested end to end without a corpus.

Sources come in 21 formats across English, German, French and Spanish. Every format is
unambiguous for the years covered (1950-2049): numeric dates are always day-first (never the US
month-first order) or year-first, and a two-digit year yy means 19yy for yy >= 50, else 20yy.
Weekday names are the true weekday of the date.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass

from qkv.errors import QkvError

FIRST_DATE = dt.date(1950, 1, 1)
LAST_DATE = dt.date(2049, 12, 31)
_N_DAYS = (LAST_DATE - FIRST_DATE).days + 1

MONTHS = {
    "en": "January February March April May June July August September October November December".split(),
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember".split(),
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre".split(),
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split(),
}
WEEKDAYS = {  # Monday first, as datetime.date.weekday() counts
    "en": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "de": "Montag Dienstag Mittwoch Donnerstag Freitag Samstag Sonntag".split(),
    "fr": "lundi mardi mercredi jeudi vendredi samedi dimanche".split(),
    "es": "lunes martes miércoles jueves viernes sábado domingo".split(),
}
_ORDINAL_WORDS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
    "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth"
).split()


def english_ordinal(day: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th', 22 -> '22nd'."""
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def english_ordinal_word(day: int) -> str:
    """1 -> 'first', 21 -> 'twenty-first', 30 -> 'thirtieth' (days of the month only)."""
    if not 1 <= day <= 31:
        raise QkvError(f"not a day of the month: {day}")
    if day <= 20:
        return _ORDINAL_WORDS[day - 1]
    if day == 30:
        return "thirtieth"
    tens = "twenty" if day < 30 else "thirty"
    return f"{tens}-{_ORDINAL_WORDS[day % 10 - 1]}"


def _month(d: dt.date, lang: str, abbreviated: bool = False) -> str:
    name = MONTHS[lang][d.month - 1]
    return name[:3] if abbreviated else name


def _weekday(d: dt.date, lang: str, abbreviated: bool = False) -> str:
    name = WEEKDAYS[lang][d.weekday()]
    return name[:3] if abbreviated else name


def _yy(d: dt.date) -> str:
    return f"{d.year % 100:02d}"


# Each format renders a date as a human would write it. Names are "<language>_<pattern>".
FORMATS: dict[str, Callable[[dt.date], str]] = {
    "en_d_month_y": lambda d: f"{d.day} {_month(d, 'en')} {d.year}",  # 9 May 2017
    "en_month_d_y": lambda d: f"{_month(d, 'en')} {d.day}, {d.year}",  # May 9, 2017
    "en_weekday_dth_of_month_y": lambda d: (  # Tuesday, 9th of May 2017
        f"{_weekday(d, 'en')}, {english_ordinal(d.day)} of {_month(d, 'en')} {d.year}"
    ),
    "en_weekday_month_dth_y": lambda d: (  # Tuesday, May 9th, 2017
        f"{_weekday(d, 'en')}, {_month(d, 'en')} {english_ordinal(d.day)}, {d.year}"
    ),
    "en_dth_month_y": lambda d: f"{english_ordinal(d.day)} {_month(d, 'en')} {d.year}",  # 9th May 2017
    "en_the_ordinal_of_month_y": lambda d: (  # the ninth of May, 2017
        f"the {english_ordinal_word(d.day)} of {_month(d, 'en')}, {d.year}"
    ),
    "en_wkd_d_mon_y": lambda d: (  # Tue, 9 May 2017
        f"{_weekday(d, 'en', True)}, {d.day} {_month(d, 'en', True)} {d.year}"
    ),
    "en_d_mon_yy": lambda d: f"{d.day} {_month(d, 'en', True)} {_yy(d)}",  # 9 May 17
    "en_dd_mon_yy": lambda d: f"{d.day:02d}-{_month(d, 'en', True)}-{_yy(d)}",  # 09-May-17
    "num_dd/mm/yy": lambda d: f"{d.day:02d}/{d.month:02d}/{_yy(d)}",  # 09/05/17
    "num_dd/mm/yyyy": lambda d: f"{d.day:02d}/{d.month:02d}/{d.year}",  # 09/05/2017
    "num_yyyy/mm/dd": lambda d: f"{d.year}/{d.month:02d}/{d.day:02d}",  # 2017/05/09
    "num_d.m.yyyy": lambda d: f"{d.day}.{d.month}.{d.year}",  # 9.5.2017
    "num_dd.mm.yy": lambda d: f"{d.day:02d}.{d.month:02d}.{_yy(d)}",  # 09.05.17
    "de_d._month_y": lambda d: f"{d.day}. {_month(d, 'de')} {d.year}",  # 9. Mai 2017
    "de_weekday_d._month_y": lambda d: (  # Dienstag, 9. Mai 2017
        f"{_weekday(d, 'de')}, {d.day}. {_month(d, 'de')} {d.year}"
    ),
    "fr_d_month_y": lambda d: f"{_french_day(d)} {_month(d, 'fr')} {d.year}",  # 9 mai 2017, 1er mai 2017
    "fr_weekday_d_month_y": lambda d: (  # mardi 9 mai 2017
        f"{_weekday(d, 'fr')} {_french_day(d)} {_month(d, 'fr')} {d.year}"
    ),
    "fr_le_d_month_y": lambda d: f"le {_french_day(d)} {_month(d, 'fr')} {d.year}",  # le 9 mai 2017
    "es_d_de_month_de_y": lambda d: f"{d.day} de {_month(d, 'es')} de {d.year}",  # 9 de mayo de 2017
    "es_weekday_d_de_month_de_y": lambda d: (  # martes, 9 de mayo de 2017
        f"{_weekday(d, 'es')}, {d.day} de {_month(d, 'es')} de {d.year}"
    ),
}


def _french_day(d: dt.date) -> str:
    return "1er" if d.day == 1 else str(d.day)  # French writes the first of the month as an ordinal


@dataclass(frozen=True)
class DateExample:
    source: str  # the date as a human wrote it
    target: str  # ISO 8601, YYYY-MM-DD
    format: str  # the key of FORMATS that wrote the source
    date: dt.date


def _example(d: dt.date, fmt: str) -> DateExample:
    return DateExample(source=FORMATS[fmt](d), target=d.isoformat(), format=fmt, date=d)


def _date(index: int) -> dt.date:
    return FIRST_DATE + dt.timedelta(days=index)


def date_examples(n: int, *, seed: int) -> list[DateExample]:
    """``n`` examples with dates uniform over 1950-2049 and formats uniform over FORMATS."""
    if n < 0:
        raise QkvError(f"n must be non-negative, got {n}")
    rng = random.Random(seed)
    names = list(FORMATS)
    return [_example(_date(rng.randrange(_N_DAYS)), rng.choice(names)) for _ in range(n)]


def date_pairs(n: int, *, seed: int) -> list[tuple[str, str]]:
    """``n`` (source, target) pairs such as ("Tuesday, 9th of May 2017", "2017-05-09"); the same under a seed."""
    return [(e.source, e.target) for e in date_examples(n, seed=seed)]


def date_splits(n_train: int, n_test: int, *, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training and held-out test pairs whose dates (and so source strings) never overlap.

    The test set holds ``n_test`` distinct dates; training pairs are drawn from the other dates,
    so a model is scored on dates it never saw in any format. Since every format is unambiguous,
    distinct dates also mean distinct source strings.
    """
    if n_train < 0 or n_test < 0:
        raise QkvError(f"split sizes must be non-negative, got {n_train} and {n_test}")
    if n_test >= _N_DAYS:
        raise QkvError(f"n_test must be below the {_N_DAYS} dates available, got {n_test}")
    rng = random.Random(seed)
    names = list(FORMATS)
    test_days = rng.sample(range(_N_DAYS), n_test)
    held_out = set(test_days)
    test = [_example(_date(i), rng.choice(names)) for i in test_days]
    train = []
    while len(train) < n_train:
        i = rng.randrange(_N_DAYS)
        if i not in held_out:
            train.append(_example(_date(i), rng.choice(names)))
    return [(e.source, e.target) for e in train], [(e.source, e.target) for e in test]


def exact_match(hyps: list[str], refs: list[str]) -> float:
    """Fraction of hypotheses equal to their reference (surrounding whitespace ignored)."""
    if len(hyps) != len(refs):
        raise QkvError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not refs:
        raise QkvError("exact_match needs at least one reference")
    return sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(refs)
