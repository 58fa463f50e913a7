"""Which test set a checkpoint may be scored on: its own languages, and Multi30k only when it was trained
on Multi30k (or when asked for by name).

A checkpoint's config.json says what it was trained on: ``data.corpus`` ("multi30k", "files" or
"prepared"; none for an imported model) and ``data.src_lang``/``tgt_lang``. For your own data a run
records how it knows them (``data.languages``: given, inferred or unknown); a run on your own data
from before that record holds en -> de whatever its data was, so its languages count as not known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.data.corpus import language_of
from qkv.errors import QkvError

MULTI30K_TEST = "test_2016_flickr"


def trained_languages(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """(source, target) languages a checkpoint's config.json records, None where it does not know one."""
    data = config.get("data") or {}
    if data.get("corpus", "multi30k") in ("files", "prepared") and not data.get("languages"):
        return None, None  # a run on your own data from before qkv recorded its languages: en -> de by default
    if data.get("corpus") == "multi30k":  # Multi30k's default pair, when the run named none
        return data.get("src_lang") or "en", data.get("tgt_lang") or "de"
    return data.get("src_lang"), data.get("tgt_lang")


def _trained_on(data: dict[str, Any]) -> str:
    if data.get("corpus") == "files":
        return "your own files (" + ", ".join(str(data[k]) for k in ("train_src", "train_tgt") if data.get(k)) + ")"
    if data.get("corpus") == "prepared":
        return f"the prepared corpus {data.get('data_dir')}"
    return "data its config.json does not name (an imported model, say)"


def multi30k_pair(config: dict[str, Any], checkpoint: str | Path, *, split: str | None) -> tuple[str, str]:
    """The language pair of the Multi30k split to score ``checkpoint`` on; ``split``: the split the user
    named (None: the default test set). A model trained on other data is scored on Multi30k only when a
    split is named, and only in the languages it records; otherwise a one-line QkvError says what to pass."""
    data = config.get("data") or {}
    src, tgt = trained_languages(config)
    if data.get("corpus") != "multi30k" and split is None:
        raise QkvError(
            f"{checkpoint} was trained on {_trained_on(data)}, not on Multi30k: score it on a test set of its own "
            f"with --src-file SRC --ref-file REF (or give --split {MULTI30K_TEST} to score it on Multi30k all the same)"
        )
    if not (src and tgt):
        raise QkvError(
            f"{checkpoint} does not record the languages it translates, so no Multi30k split can be chosen for it: "
            "score it with --src-file SRC --ref-file REF"
        )
    return src, tgt


def check_test_files(config: dict[str, Any], checkpoint: str | Path, src_file: str | Path, ref_file: str | Path) -> None:
    """Refuse (one-line QkvError) a test set whose file names give another language pair than the one
    ``checkpoint`` records (``test.de`` and ``test.en`` for an en -> de model); names that give no
    language (``src.txt``) and checkpoints that record none are not checked."""
    trained = trained_languages(config)
    test = (language_of(src_file), language_of(ref_file))
    if any(t and s and t != s for t, s in zip(test, trained)):
        shown = [t or "?" for t in test]
        raise QkvError(
            f"{src_file} and {ref_file} are a {shown[0]} -> {shown[1]} test set by their names, but {checkpoint} translates "
            f"{trained[0] or '?'} -> {trained[1] or '?'}: give a test set in its languages "
            f"(--src-file FILE.{trained[0] or 'SRC'} --ref-file FILE.{trained[1] or 'TGT'})"
        )
