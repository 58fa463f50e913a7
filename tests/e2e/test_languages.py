"""A run records its languages (given, inferred from the file names with a warning, or not known), and
``qkv evaluate`` scores a checkpoint only on a test set of its pair, and on Multi30k only when it was
trained on Multi30k or a split is named."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkv.cli import main as cli
from qkv.data.corpus import language_of
from qkv.io import checkpoint
from qkv.infer.testset import multi30k_pair
from qkv.train.recipes import LanguageWarning, build_configs


def data_of(**data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, config = build_configs("tiny", model={}, train={}, data=data)
    return config, [str(w.message) for w in caught if issubclass(w.category, LanguageWarning)]


def test_a_run_on_your_files_records_the_languages_given_inferred_or_not_known():
    given, said = data_of(corpus="files", train_src="a.txt", train_tgt="b.txt", src_lang="fr", tgt_lang="en")
    assert (given.src_lang, given.tgt_lang, given.languages, said) == ("fr", "en", "given", [])
    inferred, said = data_of(corpus="files", train_src="corpus.de.gz", train_tgt="corpus.en.gz")
    assert (inferred.src_lang, inferred.tgt_lang, inferred.languages) == ("de", "en", "inferred")
    assert len(said) == 1 and "de -> en by its file names" in said[0] and "--src and --tgt" in said[0]
    unknown, said = data_of(corpus="files", train_src="pairs.tsv")
    assert (unknown.src_lang, unknown.tgt_lang, unknown.languages) == (None, None, "unknown")  # was en -> de
    assert len(said) == 1 and "give --src and --tgt" in said[0]
    multi30k, said = data_of()
    assert (multi30k.src_lang, multi30k.tgt_lang, said) == ("en", "de", [])  # Multi30k's default pair, silently
    assert [language_of(n) for n in ("test.en", "x/newstest2014.de.xz", "src.txt", "test", None)] == ["en", "de", None, None, None]


def test_train_dump_config_shows_the_recorded_languages_of_your_files(tmp_path, capsys):
    assert cli.main(["train", "--preset", "tiny", "--train-src", str(tmp_path / "pairs.tsv"), "--dump-config"]) == 0
    out = capsys.readouterr().out
    assert "# src_lang = (not set)" in out and "# tgt_lang = (not set)" in out and 'languages = "unknown"' in out


def test_train_on_your_files_says_which_languages_it_records_and_records_them(dates_tsv, tmp_path, capsys):
    pairs = [line.split("\t") for line in dates_tsv.read_text(encoding="utf-8").splitlines()[:60]]
    for side, k in (("fr", 0), ("en", 1)):
        (tmp_path / f"train.{side}").write_text("".join(p[k] + "\n" for p in pairs), encoding="utf-8")
    run, threads = tmp_path / "run", torch.get_num_threads()
    try:  # one thread: a tiny model's steps are fastest so on a busy CPU
        with pytest.warns(LanguageWarning, match="languages are fr -> en by its file names"):
            assert cli.main(["train", "--preset", "tiny", "--train-src", str(tmp_path / "train.fr"), "--train-tgt", str(tmp_path / "train.en"),
                             "--out", str(run), "--max-steps", "1", "--no-progress", "--data", "vocab_size=80", "train_limit=20",
                             "--train", "eval_every=1", "keep_last=1", "average_last=1", "tune_length_penalty=false", "threads=1"]) == 0
    finally:
        torch.set_num_threads(threads)
    data = checkpoint.read_config(run / "final")["data"]
    assert (data["src_lang"], data["tgt_lang"], data["languages"]) == ("fr", "en", "inferred")  # was en -> de


def saved(random_checkpoint, where, data):
    loaded = checkpoint.load(random_checkpoint)
    return checkpoint.save(where, loaded.model, loaded.tokenizer, configs={"data": data})


def evaluate(capsys, *flags):
    code = cli.main(["evaluate", *map(str, flags)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


FILES = {"corpus": "files", "train_src": "corpus.en", "train_tgt": "corpus.de", "src_lang": "en", "tgt_lang": "de", "languages": "inferred"}


@pytest.mark.parametrize("data, trained_on", [
    (FILES, "your own files (corpus.en, corpus.de)"),
    ({**FILES, "languages": ""}, "your own files"),  # a run from before the record: refused all the same
    ({"corpus": "prepared", "data_dir": "prep", "src_lang": "en", "tgt_lang": "de", "languages": "given"}, "the prepared corpus prep"),
    ({"src_lang": "en", "tgt_lang": "de"}, "an imported model"),
])
def test_evaluate_refuses_multi30k_for_a_model_trained_on_other_data(random_checkpoint, tmp_path, capsys, data, trained_on):
    ckpt = saved(random_checkpoint, tmp_path / "ckpt", data)
    code, out, err = evaluate(capsys, "--checkpoint", ckpt, "--data-dir", tmp_path / "no-multi30k-here")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert trained_on in err and "not on Multi30k" in err and "--src-file SRC --ref-file REF" in err and "--split" in err


def test_evaluate_refuses_a_named_split_for_a_model_that_records_no_languages(random_checkpoint, tmp_path, capsys):
    ckpt = saved(random_checkpoint, tmp_path / "ckpt", {**FILES, "src_lang": None, "tgt_lang": None, "languages": "unknown"})
    code, _, err = evaluate(capsys, "--checkpoint", ckpt, "--split", "val", "--data-dir", tmp_path)
    assert code == 2 and err.count("\n") == 1 and "does not record the languages" in err and "--src-file" in err
    config = checkpoint.read_config(saved(random_checkpoint, tmp_path / "named", FILES))
    assert multi30k_pair(config, "named", split="val") == ("en", "de")  # named, in the languages it records


@pytest.mark.parametrize("data", [
    {"corpus": "multi30k", "src_lang": "en", "tgt_lang": "de", "data_dir": None},
    FILES,
    {"src_lang": "en", "tgt_lang": "de"},  # an imported en -> de model
])
def test_evaluate_refuses_a_test_set_of_another_pair_by_its_file_names(random_checkpoint, tmp_path, capsys, data):
    ckpt = saved(random_checkpoint, tmp_path / "ckpt", data)
    for name, text in (("test.de", "Ein Hund rennt.\n"), ("test.en", "A dog runs.\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
    code, out, err = evaluate(capsys, "--checkpoint", ckpt, "--src-file", tmp_path / "test.de", "--ref-file", tmp_path / "test.en")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "de -> en test set" in err and "translates en -> de" in err and "--src-file FILE.en --ref-file FILE.de" in err
    code, out, _ = evaluate(capsys, "--checkpoint", ckpt, "--src-file", tmp_path / "test.en", "--ref-file", tmp_path / "test.de", "--beam", 1, "--workers", 1)
    assert code == 0 and "BLEU" in out  # its own pair is scored


def test_an_old_run_on_your_files_is_scored_on_any_test_files(random_checkpoint, tmp_path, capsys):
    """Before the record, a run on your files held en -> de whatever its data was: its pair is not checked."""
    ckpt = saved(random_checkpoint, tmp_path / "ckpt", {k: v for k, v in FILES.items() if k != "languages"})
    for name in ("test.de", "test.en"):
        (tmp_path / name).write_text("A dog runs.\n", encoding="utf-8")
    code, out, err = evaluate(capsys, "--checkpoint", ckpt, "--src-file", tmp_path / "test.de", "--ref-file", tmp_path / "test.en", "--beam", 1, "--workers", 1)
    assert code == 0 and "BLEU" in out, err


def test_distill_on_multi30k_asks_for_the_languages_a_teacher_does_not_record(random_checkpoint, tmp_path, capsys):
    teacher = saved(random_checkpoint, tmp_path / "teacher", {k: v for k, v in FILES.items() if k != "languages"})  # an old run on files
    code = cli.main(["distill", "--teacher", str(teacher), "--out", str(tmp_path / "d"), "--data-dir", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not record the languages it translates: give --src and --tgt" in err
