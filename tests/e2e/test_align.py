"""`qkv align`: Pharaoh word alignments (attention weights, value norms, ALTI+), one line per input line,
and their error rate against a gold file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from qkv.errors import QkvError
from qkv.io import checkpoint
from qkv.inspect.align import align, alignment_error_rate, pharaoh, read_gold
from qkv.model.config import model_preset
from qkv.infer.search import DecodeConfig
from qkv.model.transformer import Transformer
from qkv.data.tokenizer import Tokenizer
from qkv.inspect.visualize import align_source_words, align_words, attention_of, capture_attention, word_alignment

SENTENCES = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book", "children run on the beach"]


def test_pieces_are_merged_into_words_on_hand_made_weights():
    src = ["▁a", "▁bi", "ke", "▁red", "</s>"]  # words: a, bike, red
    tgt = ["▁ein", "▁rot", "es", "▁Rad", "</s>"]  # words: ein, rotes, Rad
    w = torch.tensor([
        [0.7, 0.1, 0.1, 0.1, 0.0],  # ein -> a
        [0.0, 0.2, 0.2, 0.6, 0.0],  # rot  \\ rotes: mean of its rows -> red (0.55) over bike (0.35)
        [0.0, 0.3, 0.0, 0.5, 0.2],  # es   /
        [0.1, 0.3, 0.3, 0.3, 0.0],  # Rad -> bike: its two pieces together (0.6) beat red (0.3)
        [0.0, 0.0, 0.0, 0.0, 1.0],  # EOS: not aligned
    ])  # fmt: skip
    pairs = align_words(w, src, tgt)
    assert [(s, t) for s, t, _ in pairs] == [(0, 0), (2, 1), (1, 2)]
    assert [round(m, 2) for _, _, m in pairs] == [0.7, 0.55, 0.6]
    assert pharaoh([(s, t) for s, t, _ in pairs]) == "0-0 2-1 1-2"


def test_the_source_side_links_each_source_word_with_the_target_word_that_attends_to_it_most():
    src = ["▁a", "▁dog", "</s>"]
    tgt = ["▁ein", "▁Hund", "▁läuft", "</s>"]
    w = torch.tensor([
        [0.8, 0.1, 0.1],  # ein -> a
        [0.2, 0.7, 0.1],  # Hund -> dog
        [0.1, 0.6, 0.3],  # läuft -> dog too, from the target side
        [0.0, 0.0, 1.0],  # EOS: not aligned
    ])  # fmt: skip
    assert [(s, t) for s, t, _ in align_words(w, src, tgt)] == [(0, 0), (1, 1), (1, 2)]
    # From the source side each source word takes one target word: dog -> Hund (0.7 over 0.6).
    assert align_source_words(w, src, tgt) == [(0, 0, pytest.approx(0.8)), (1, 1, pytest.approx(0.7))]
    assert align_source_words(w[:1], src, tgt[-1:]) == []  # no target words: no links


def test_a_model_with_an_alignment_head_is_read_from_the_source_side_by_default(model_dir):
    loaded = checkpoint.load(model_dir)
    refs = ["ein Mann fährt ein rotes Rad", "zwei Hunde spielen im Schnee", "eine Frau liest", "Kinder laufen am Strand"]
    plain = align(loaded.model, loaded.tokenizer, SENTENCES, refs)  # no head: the target side
    assert plain == align(loaded.model, loaded.tokenizer, SENTENCES, refs, link="target")
    loaded.model.config = loaded.model.config.replace(alignment_layer=0)
    headed = align(loaded.model, loaded.tokenizer, SENTENCES, refs)
    source = align(loaded.model, loaded.tokenizer, SENTENCES, refs, link="source", method="attention", layer=0, head=0)
    assert headed == source
    assert headed != align(loaded.model, loaded.tokenizer, SENTENCES, refs, link="target", method="attention", layer=0, head=0)
    for pairs, sentence in zip(headed, SENTENCES):
        assert [s for s, _ in pairs] == list(range(len(sentence.split())))  # every source word once
    with pytest.raises(QkvError, match="link side"):
        align(loaded.model, loaded.tokenizer, SENTENCES, refs, link="both")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("align")
    tokenizer = Tokenizer.train(SENTENCES * 5, 60, directory / "tok.model")
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    return checkpoint.save(directory / "model", Transformer(config), tokenizer)


def test_aligning_own_translations_agrees_with_the_attention_picture(model_dir):
    loaded = checkpoint.load(model_dir)
    config = DecodeConfig(beam_size=2, max_len_b=6)
    batched = align(loaded.model, loaded.tokenizer, SENTENCES, config=config, max_tokens=30,  # several batches
                    method="attention", row="predict", layer=-1)
    for sentence, pairs in zip(SENTENCES, batched):
        capture = capture_attention(loaded.model, loaded.tokenizer, sentence, config)
        src_words, tgt_words = capture.source.split(), capture.translation.split()
        assert [(src_words[s], tgt_words[t]) for s, t in pairs] == [(s, t) for t, s, _ in word_alignment(capture)]
        assert [t for _, t in pairs] == list(range(len(tgt_words)))  # every target word once, in order


def test_align_command_keeps_lines_and_indices_valid(model_dir, tmp_path):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    sources = ["a man rides a red bike", "", "two dogs play", "a book"]
    targets = ["ein Mann fährt ein rotes Rad", "nichts", "", "ein Buch"]
    src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    ref.write_text("".join(t + "\n" for t in targets), encoding="utf-8")

    def run(*args: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(model_dir), *map(str, args)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    result = run("-i", src, "-r", ref, "--layer", "1", "--head", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == len(sources) + 1 and lines[-1] == ""
    assert lines[1] == "" and lines[2] == ""  # an empty side gives an empty line
    for line, s, t in zip(lines, sources, targets):
        for pair in line.split():
            i, j = map(int, pair.split("-"))
            assert 0 <= i < len(s.split()) and 0 <= j < len(t.split())
        assert len(line.split()) == (len(t.split()) if s else 0)
    assert run("-i", src, "--layer", "3").stderr.startswith("qkv align: error: --layer must be between 1 and 2")
    ref.write_text("one line\n", encoding="utf-8")
    assert "line counts differ" in run("-i", src, "-r", ref).stderr


@pytest.mark.parametrize("method", ["attention", "norm", "alti"])
def test_every_method_reads_the_input_row_and_is_batch_invariant(model_dir, method):
    """Read at the input position, target word t takes the row after the one that predicts it; one
    sentence at a time or batched, the pairs are the same."""
    loaded = checkpoint.load(model_dir)
    with torch.no_grad():  # sharper attention than the random weights give, so that rows differ
        for layer in [*loaded.model.encoder_layers, *loaded.model.decoder_layers]:
            for attention in {layer.self_attn, getattr(layer, "cross_attn", layer.self_attn)}:
                attention.in_proj.weight.mul_(4.0)
    targets = ["ein Mann fährt ein rotes Rad", "zwei Hunde spielen", "eine Frau liest", "Kinder rennen"]
    batched = align(loaded.model, loaded.tokenizer, SENTENCES, targets, method=method, max_tokens=1000, row="input", layer=-2)
    alone = [align(loaded.model, loaded.tokenizer, [s], [t], method=method, row="input", layer=-2)[0]
             for s, t in zip(SENTENCES, targets)]
    assert batched == alone
    if method == "attention":
        shifted = []
        for s, t in zip(SENTENCES, targets):
            src_ids, tgt_ids = loaded.tokenizer.encode(s), loaded.tokenizer.encode_target(t)
            capture = attention_of(loaded.model, loaded.tokenizer, s, src_ids, tgt_ids)
            w = capture.cross[-2].mean(dim=0)  # (T, S): the layer below the last
            w = torch.cat([w[1:], torch.zeros_like(w[:1])])  # target piece t read at row t + 1
            shifted.append([(i, j) for i, j, _ in align_words(w, capture.src_tokens, capture.tgt_tokens)])
        assert batched == shifted
        predict = align(loaded.model, loaded.tokenizer, SENTENCES, targets, method=method, row="predict", layer=-2)
        assert predict != batched  # the two readings differ on this model


def test_alignment_error_rate_on_hand_made_links(tmp_path):
    gold = tmp_path / "gold"
    gold.write_text("1-1 2p2 3-3\n1p2\n", encoding="utf-8")
    read = read_gold(gold)
    assert read == [({(0, 0), (2, 2)}, {(0, 0), (1, 1), (2, 2)}), (set(), {(0, 1)})]
    # A = {(0,0), (1,1), (0,2)} and {(0,1)}: |A| 4, |S| 2, |A & S| 1, |A & P| 3 -> 1 - 4/6
    rate = alignment_error_rate([[(0, 0), (1, 1), (0, 2)], [(0, 1)]], read)
    assert rate == pytest.approx({"aer": 1 - 4 / 6, "precision": 3 / 4, "recall": 1 / 2})
    assert alignment_error_rate([[(0, 0), (2, 2)], []], read)["aer"] == 0.0
    gold.write_text("1-1 2x2\n", encoding="utf-8")
    with pytest.raises(Exception, match="line 1: '2x2' is not a link"):
        read_gold(gold)


def test_align_command_reports_the_error_rate_and_refuses_a_bad_gold_file(model_dir, tmp_path):
    src, ref, gold = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "gold"
    src.write_text("a man rides\ntwo dogs\n", encoding="utf-8")
    ref.write_text("ein Mann fährt\nzwei Hunde\n", encoding="utf-8")
    gold.write_text("1-1 2-2 3-3\n1-1 2-2\n", encoding="utf-8")
    run = lambda *a: subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(model_dir), "-i", src,  # noqa: E731
                                     "-r", ref, *map(str, a)], capture_output=True, text=True, timeout=120)
    result = run("--gold", gold, "--method", "alti")
    assert result.returncode == 0, result.stderr
    predicted = [[tuple(map(int, p.split("-"))) for p in line.split()] for line in result.stdout.splitlines()]
    expected = alignment_error_rate(predicted, read_gold(gold))["aer"]
    assert f"AER {100 * expected:.1f} " in result.stderr and "on 2 pairs" in result.stderr
    gold.write_text("1-1\n", encoding="utf-8")
    assert "--gold has 1 lines but --input 2" in run("--gold", gold).stderr
    assert "--head goes with --method attention or norm" in run("--method", "alti", "--head", "1").stderr


def test_a_hostile_gold_file_is_one_line_or_read_as_documented(tmp_path):
    gold = tmp_path / "gold"
    gold.write_bytes(b"1-1\r\n\r\n2p3 1-2\r\n")  # CRLF line ends; a blank line is a pair without links
    assert read_gold(gold) == [({(0, 0)}, {(0, 0)}), (set(), set()), ({(0, 1)}, {(1, 2), (0, 1)})]
    cases = {
        b"1-1\n2-2 \xff3-3\n": "line 2 is not valid UTF-8",  # was a UnicodeDecodeError traceback
        b"1-1\n-1-2\n": "line 2: '-1-2' is not a link",
        b"1p-2\n": "line 1: '1p-2' is not a link",
        b"0-1\n": "line 1: '0-1': indices are 1-based",
        b"1-" + b"9" * 5000 + b"\n": r"line 1: '1-9{38}'\.\.\. is not a link",  # the message stays one short line
        b"1-\xd9\xa3\n": "is not a link",  # an Arabic-Indic digit: int() would have read it as 3
    }
    for text, message in cases.items():
        gold.write_bytes(text)
        with pytest.raises(QkvError, match=message):
            read_gold(gold)
    with pytest.raises(QkvError, match="cannot read"):
        read_gold(tmp_path)  # a directory
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a FIFO is read as a stream, as --gold <(zcat gold.gz) gives one
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"1-1\n"))
    writer.start()
    assert read_gold(fifo) == [({(0, 0)}, {(0, 0)})]
    writer.join()


def test_align_gold_refuses_links_outside_the_pair_and_never_overwrites_the_gold_file(model_dir, tmp_path):
    src, ref, gold = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "gold"
    src.write_text("a man rides\ntwo dogs\n", encoding="utf-8")
    ref.write_text("ein Mann fährt\nzwei Hunde\n", encoding="utf-8")
    run = lambda *a: subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(model_dir), "-i", src,  # noqa: E731
                                     *map(str, a)], capture_output=True, text=True, timeout=120)
    gold.write_text("1-1 2-2 3-3\n1-1 2-999999999\n", encoding="utf-8")
    result = run("-r", ref, "--gold", gold)  # counted as a link never found, it raised the AER
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"qkv align: error: {gold}, line 2: link 2-999999999 is outside the pair's 2 source and 2 target words"]
    gold.write_text("1-1 2-2 3-3\n1-1 2-2\n", encoding="utf-8")
    before = gold.read_bytes()
    result = run("-r", ref, "--gold", gold, "-o", gold, "--force")  # it replaced the gold file with the alignments
    assert result.returncode == 2 and "is also the input" in result.stderr and gold.read_bytes() == before
    for extra in ((), ("-r", ref, "--pieces")):  # an AER of the model's own translations, or of pieces against words
        result = run("--gold", gold, *extra)
        assert result.returncode == 2 and "--gold scores word alignments of the references" in result.stderr
