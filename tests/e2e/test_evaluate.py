"""Scores are sacreBLEU's, the length terms are printed beside them, and the length penalty a
checkpoint's training chose is the default."""

from __future__ import annotations

import math

import pytest
from sacrebleu.metrics import BLEU

from qkv.io import checkpoint
from qkv.cli import main as cli
from qkv.infer.bleu import format_scores, score

REFS = ["a man rides a red bike down the street", "two dogs play in the deep snow", "a woman reads a book"]


def test_short_translations_show_a_length_ratio_below_one_and_its_brevity_penalty():
    hyps = ["a man rides a bike", "two dogs play", "a woman reads a book"]  # 13 tokens against 21
    scores = score(hyps, REFS)
    assert (scores["hyp_len"], scores["ref_len"]) == (13, 21)
    assert scores["length_ratio"] == round(13 / 21, 4)
    assert scores["brevity_penalty"] == round(math.exp(1 - 21 / 13), 4)
    assert scores["bleu"] == round(BLEU().corpus_score(hyps, [REFS]).score, 2)
    assert format_scores(scores).splitlines()[-1] == (
        "length    ratio 0.619 (translations 13 / references 21 tokens), brevity penalty 0.540"
    )
    full = score(REFS, REFS)
    assert full["brevity_penalty"] == 1.0 and full["length_ratio"] == 1.0 and full["bleu"] == 100.0


def test_the_length_penalty_chosen_in_training_is_the_default_and_a_flag_overrides_it(random_checkpoint, tmp_path, capsys):
    loaded = checkpoint.load(random_checkpoint)
    tuned = checkpoint.save(tmp_path / "tuned", loaded.model, loaded.tokenizer,
                            configs={"data": loaded.config["data"], "decode": {"length_penalty": 1.7}})
    (tmp_path / "src").write_text("A dog runs.\nTwo children play.\n")
    (tmp_path / "ref").write_text("Ein Hund rennt.\nZwei Kinder spielen.\n")
    files = ["--src-file", str(tmp_path / "src"), "--ref-file", str(tmp_path / "ref"), "--beam", "2"]
    for path, flags, expected in [(tuned, [], 1.7), (tuned, ["--length-penalty", "0.3"], 0.3), (random_checkpoint, [], 0.6)]:
        assert cli.main(["evaluate", "--checkpoint", str(path), *files, *flags]) == 0
        assert f"length penalty {expected}," in capsys.readouterr().out


def test_the_summary_says_how_the_lines_were_split_recased_and_guarded(random_checkpoint, tmp_path, capsys):
    # each changes the score: two runs must not print the same settings (a newcomer's review)
    (tmp_path / "src").write_text("A dog runs.\nTWO CHILDREN PLAY.\n")
    (tmp_path / "ref").write_text("Ein Hund rennt.\nZWEI KINDER SPIELEN.\n")
    files = ["--src-file", str(tmp_path / "src"), "--ref-file", str(tmp_path / "ref"), "--beam", "2", "--checkpoint", str(random_checkpoint)]
    assert cli.main(["evaluate", *files]) == 0
    assert "length penalty 0.6, split (en), recased, loop guard 2," in capsys.readouterr().out
    assert cli.main(["evaluate", *files, "--no-split", "--keep-case", "--loop-guard", "0"]) == 0
    assert "length penalty 0.6, no split, case kept, no loop guard," in capsys.readouterr().out


@pytest.mark.parametrize("decode", [{"length_penalty": "1"}, {"length_penalty": True}, {"length_penalty": -1},
                                    {"length_penalty": 1e9}, {"beam_size": 5}, [1.0]])
def test_a_checkpoints_decoding_defaults_are_checked(decode):
    with pytest.raises(checkpoint.CheckpointError, match="decode"):
        checkpoint.decode_defaults({"decode": decode})
    assert checkpoint.decode_defaults({}) == {} and checkpoint.decode_defaults({"decode": {"length_penalty": 2}}) == {"length_penalty": 2.0}


def test_a_run_on_prepared_data_reads_multi30k_from_qkv_data(random_checkpoint, tmp_path, monkeypatch, capsys):
    """The data_dir of a run on prepared data is its prepared directory, not a Multi30k one: evaluate used to
    look for the split there, not in $QKV_DATA as its --help says."""
    import gzip

    loaded = checkpoint.load(random_checkpoint)
    data = {"corpus": "prepared", "data_dir": str(tmp_path / "prepared"), "src_lang": "en", "tgt_lang": "de", "languages": "given"}
    ck = checkpoint.save(tmp_path / "ck", loaded.model, loaded.tokenizer, configs={"data": data})
    multi30k = tmp_path / "multi30k"
    multi30k.mkdir()
    for lang, lines in (("en", ["A dog runs.", "Two children play.", "A red ball."]), ("de", REFS)):
        (multi30k / f"test_2016_flickr.{lang}.gz").write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    monkeypatch.setenv("QKV_DATA", str(multi30k))
    code = cli.main(["evaluate", "--checkpoint", str(ck), "--split", "test_2016_flickr", "--beam", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("multi30k-test_2016_flickr-en-de: 3 sentences")
