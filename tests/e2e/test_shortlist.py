"""Vocabulary shortlists: the table is the Dice rule counted by hand; a search restricted to each
sentence's ids is the search over those ids (greedy by hand, beam scores renormalised over them),
whatever the batch; every id allowed gives the exact search; `qkv shortlist` adds the table to a
checkpoint under its manifest, refuses to replace it without --force, and a failure leaves the
checkpoint as it was; `--shortlist` decodes with it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from itertools import product
from pathlib import Path

import pytest
import torch
from test_decode import BOS, EOS, V, batch, make_model, max_output_length, sources

from qkv.errors import QkvError
from qkv.infer import shortlist
from qkv.infer.ensemble import Ensemble
from qkv.infer.search import DecodeConfig, length_penalty, search
from qkv.io import checkpoint
from qkv.model.quantize import int8_model


def random_pairs(n: int, seed: int, src_vocab: int = 30, tgt_vocab: int = 25) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        src = torch.randint(0, src_vocab, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()
        # targets lean on their sources, so some pairs of pieces co-occur far more than others
        tgt = [(3 * p + 1) % tgt_vocab for p in src if torch.rand(1, generator=g) < 0.7]
        tgt += torch.randint(0, tgt_vocab, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist()
        pairs.append((src, tgt))
    return pairs


def dice_by_hand(pairs, src_vocab: int, tgt_vocab: int, k: int, frequent: int):
    """The shortlist rule with plain loops: per source piece the k target pieces of highest Dice
    coefficient (ties: the lower id); the ``frequent`` most frequent target pieces (ties: the lower id)."""
    c_s, c_t, c_st, tokens = Counter(), Counter(), Counter(), Counter()
    for src, tgt in pairs:
        c_s.update(set(src))
        c_t.update(set(tgt))
        c_st.update(product(set(src), set(tgt)))
        tokens.update(tgt)
    table = []
    for s in range(src_vocab):
        scored = [(-2 * c_st[s, t] / (c_s[s] + c_t[t]), t) for t in range(tgt_vocab) if c_st[s, t]]
        table.append([t for _, t in sorted(scored)[:k]])
    top = sorted((t for t in range(tgt_vocab) if tokens[t]), key=lambda t: (-tokens[t], t))[:frequent]
    return table, sorted(top)


@pytest.mark.parametrize("chunk", [7, 50_000])
def test_the_table_is_the_dice_rule_counted_by_hand(chunk):
    pairs = random_pairs(300, seed=1)
    built = shortlist.build(pairs, src_vocab=30, tgt_vocab=25, k=4, frequent=6, chunk=chunk)
    table, top = dice_by_hand(pairs, 30, 25, k=4, frequent=6)
    assert [[t for t in row if t >= 0] for row in built.table.tolist()] == table
    assert built.frequent.tolist() == top
    assert built.info["pairs"] == 300
    # a sentence's list: the frequent pieces and the rows of its own source pieces, nothing else
    src = pairs[0][0]
    assert built.vocab([src])[0].tolist() == sorted(set(top) | {t for s in src for t in table[s]})


def test_ids_outside_the_vocabularies_are_refused():
    with pytest.raises(QkvError, match="outside its vocabulary"):
        shortlist.build([([1, 30], [2])], src_vocab=30, tgt_vocab=25)
    with pytest.raises(QkvError, match="outside its vocabulary"):
        shortlist.build([([1], [-1])], src_vocab=30, tgt_vocab=25)
    with pytest.raises(QkvError, match="needs sentence pairs"):
        shortlist.build([], src_vocab=30, tgt_vocab=25)


def lists_for(src_ids: list[list[int]], seed: int, size: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(V - 4, generator=g)[:size] + 4 for _ in src_ids]


@torch.inference_mode()
def greedy_by_hand(model, src_ids: list[int], allowed: list[int], limit: int) -> list[int]:
    """Greedy search without a cache over ``allowed`` (and EOS): the argmax of their logits."""
    allowed = sorted(set(allowed) | {EOS})
    prefix = [BOS]
    for _ in range(limit):
        logits = model(batch([src_ids]), torch.tensor([prefix]))[0, -1]  # (V,)
        token = allowed[int(logits[allowed].argmax())]
        if token == EOS:
            break
        prefix.append(token)
    return prefix[1:]


def test_restricted_greedy_search_is_the_argmax_over_each_sentences_own_ids():
    model = make_model(3)
    src_ids = sources([5, 2, 9, 4], seed=3)
    vocab = lists_for(src_ids, seed=3)
    config = DecodeConfig(beam_size=1, max_len_b=6)
    got = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab)
    for ids, allowed, hyps in zip(src_ids, vocab, got):
        limit = max_output_length(model, len(ids) + 1, config)
        assert hyps[0].tokens == greedy_by_hand(model, ids, allowed.tolist(), limit)
    assert got != search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)  # it did restrict


@torch.inference_mode()
def test_restricted_beam_scores_are_log_probabilities_renormalised_over_the_sentences_ids():
    model = make_model(1)
    src_ids = sources([3, 8, 1, 5], seed=1)
    vocab = lists_for(src_ids, seed=5, size=8)
    config = DecodeConfig(beam_size=3, n_best=2, length_penalty=0.6, max_len_a=1.0, max_len_b=3)
    results = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab)
    for ids, allowed, hyps in zip(src_ids, vocab, results):
        allowed = sorted(set(allowed.tolist()) | {EOS})
        limit = max_output_length(model, len(ids) + 1, config)
        for h in hyps:
            assert set(h.tokens) <= set(allowed)
            with_eos = len(h.tokens) < limit
            target = h.tokens + [EOS] if with_eos else h.tokens
            logits = model(batch([ids]), torch.tensor([[BOS, *target[:-1]]]))[0][:, allowed]  # (T, U)
            expected = sum(logits.log_softmax(-1)[i, allowed.index(t)].item() for i, t in enumerate(target))
            assert h.log_prob == pytest.approx(expected, abs=1e-4)
            assert h.score == pytest.approx(h.log_prob / length_penalty(len(target), 0.6))


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_restricted_sentence_decodes_the_same_alone_or_in_a_batch(beam_size):
    model = make_model(4)
    src_ids = sources([6, 1, 11, 3, 8], seed=4)
    vocab = lists_for(src_ids, seed=4)
    config = DecodeConfig(beam_size=beam_size)
    together = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab)
    alone = [search(model, batch([ids]), bos_id=BOS, eos_id=EOS, config=config, vocab=[v])[0] for ids, v in zip(src_ids, vocab)]
    assert [h[0].tokens for h in together] == [h[0].tokens for h in alone]
    for hyps, allowed in zip(together, vocab):
        assert set(hyps[0].tokens) <= set(allowed.tolist())


@pytest.mark.parametrize("beam_size", [1, 4])
def test_every_id_allowed_is_the_exact_search(beam_size):
    model = make_model(2)
    src_ids = sources([7, 3, 10, 5], seed=2)
    everything = [torch.arange(V) for _ in src_ids]
    config = DecodeConfig(beam_size=beam_size, n_best=min(2, beam_size))
    exact = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)
    listed = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=everything)
    assert [[h.tokens for h in hs] for hs in listed] == [[h.tokens for h in hs] for hs in exact]
    if beam_size > 1:
        for a, b in zip(exact, listed):
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_suppressed_ids_stay_out_of_a_restricted_search(beam_size):
    model = make_model(0)
    src_ids = sources([6, 9, 4, 7], seed=2)
    vocab = lists_for(src_ids, seed=2, size=10)
    config = DecodeConfig(beam_size=beam_size, n_best=beam_size, max_len_b=8)
    free = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab)
    common = Counter(t for hyps in free for h in hyps for t in h.tokens).most_common(1)[0][0]
    held = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab, suppress=(common,))
    assert all(common not in h.tokens for hyps in held for h in hyps) and held != free


@pytest.mark.parametrize("beam_size", [1, 3])
def test_an_ensemble_and_an_int8_model_search_within_the_lists(beam_size):
    src_ids = sources([6, 9, 4], seed=6)
    vocab = lists_for(src_ids, seed=6)
    config = DecodeConfig(beam_size=beam_size)
    for model in (Ensemble([make_model(5), make_model(6)]), int8_model(make_model(5))):
        got = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab)
        for hyps, allowed in zip(got, vocab):
            assert set(hyps[0].tokens) <= set(allowed.tolist())


def test_a_damaged_table_is_refused(tmp_path):
    good = shortlist.build(random_pairs(50, seed=2), src_vocab=30, tgt_vocab=25, k=3, frequent=4)
    shortlist.save(good, tmp_path / "ok.safetensors")
    assert shortlist.load(tmp_path / "ok.safetensors", src_vocab=30, tgt_vocab=25).table.equal(good.table)
    with pytest.raises(QkvError, match="31"):
        shortlist.load(tmp_path / "ok.safetensors", src_vocab=31, tgt_vocab=25)
    with pytest.raises(QkvError, match="outside the model's 20"):
        shortlist.load(tmp_path / "ok.safetensors", src_vocab=30, tgt_vocab=20)
    (tmp_path / "bad.safetensors").write_bytes(b"not a table")
    with pytest.raises(QkvError, match="cannot be read"):
        shortlist.load(tmp_path / "bad.safetensors", src_vocab=30, tgt_vocab=25)


# ---- qkv shortlist and --shortlist ---------------------------------------------------------------


def qkv(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_qkv_shortlist_adds_the_table_under_the_manifest_and_translate_uses_it(random_checkpoint, tmp_path):
    import shutil

    from conftest import RANDOM_MODEL_SENTENCES

    ck = tmp_path / "ck"
    shutil.copytree(random_checkpoint, ck)
    (tmp_path / "train.en").write_text("\n".join(RANDOM_MODEL_SENTENCES[0::2]) + "\n")
    (tmp_path / "train.de").write_text("\n".join(RANDOM_MODEL_SENTENCES[1::2]) + "\n")
    before = snapshot(ck)

    missing = qkv("translate", "--checkpoint", str(ck), "--shortlist", "--input", str(tmp_path / "train.en"), cwd=tmp_path)
    assert missing.returncode != 0 and "qkv shortlist" in missing.stderr

    done = qkv("shortlist", "--checkpoint", str(ck), "--train-src", str(tmp_path / "train.en"),
               "--train-tgt", str(tmp_path / "train.de"), "--k", "3", "--frequent", "5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    after = snapshot(ck)
    assert set(after) == set(before) | {checkpoint.SHORTLIST}
    assert all(after[name] == before[name] for name in before if name != checkpoint.MANIFEST)  # nothing else changed
    checkpoint.verify(ck)  # the manifest covers the new file
    assert not any(p.name.startswith("ck.") for p in tmp_path.iterdir())  # no ck.tmp or ck.old left
    loaded = checkpoint.load(ck)
    table = shortlist.load(ck / checkpoint.SHORTLIST, src_vocab=loaded.model.config.src_vocab_size,
                           tgt_vocab=loaded.model.config.tgt_vocab_size)
    assert table.k == 3 and table.info["pairs"] == len(RANDOM_MODEL_SENTENCES) // 2

    again = qkv("shortlist", "--checkpoint", str(ck), "--train-src", str(tmp_path / "train.en"),
                "--train-tgt", str(tmp_path / "train.de"), "--k", "5", cwd=tmp_path)
    assert again.returncode != 0 and "--force" in again.stderr and snapshot(ck) == after

    out = tmp_path / "out.de"
    translated = qkv("translate", "--checkpoint", str(ck), "--shortlist", "--input", str(tmp_path / "train.en"),
                     "--output", str(out), "--loop-guard", "0", cwd=tmp_path)  # the search the library's Translator runs
    assert translated.returncode == 0, translated.stderr
    assert len(out.read_text().splitlines()) == len(RANDOM_MODEL_SENTENCES) // 2
    sources_ids = [loaded.tokenizer.encode(line) for line in RANDOM_MODEL_SENTENCES[0::2]]
    allowed = [set(ids.tolist()) | {loaded.tokenizer.eos_id} for ids in table.vocab(sources_ids)]
    from qkv.infer.translator import Translator

    hyps = Translator(loaded.model, loaded.tokenizer, shortlist=table).translate_ids(sources_ids)
    assert all(set(h[0].tokens) <= a for h, a in zip(hyps, allowed))
    assert [loaded.tokenizer.decode(h[0].tokens) for h in hyps] == out.read_text().splitlines()

    forced = qkv("shortlist", "--checkpoint", str(ck), "--train-src", str(tmp_path / "train.en"),
                 "--train-tgt", str(tmp_path / "train.de"), "--k", "5", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert shortlist.load(ck / checkpoint.SHORTLIST, src_vocab=table.table.size(0), tgt_vocab=25_000).k == 5


def test_a_failure_while_adding_leaves_the_checkpoint_as_it_was(random_checkpoint, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(random_checkpoint, ck)
    before = snapshot(ck)

    def fail(path: Path) -> None:
        path.write_bytes(b"half a table")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        checkpoint.add_file(ck, checkpoint.SHORTLIST, fail)
    assert snapshot(ck) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with pytest.raises(checkpoint.CheckpointError, match="not an optional"):
        checkpoint.add_file(ck, checkpoint.WEIGHTS, lambda path: None)
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="notes.txt"):  # not verifiable: refused, untouched
        checkpoint.add_file(ck, checkpoint.SHORTLIST, lambda path: path.write_bytes(b""))
    assert (ck / "notes.txt").read_text() == "mine" and not (ck / checkpoint.SHORTLIST).exists()


def test_the_ctranslate2_export_carries_the_table_as_its_vocabulary_map(random_checkpoint, tmp_path):
    import shutil

    ctranslate2 = pytest.importorskip("ctranslate2")
    from conftest import RANDOM_MODEL_SENTENCES

    from qkv.interop.ctranslate2 import export_ctranslate2

    ck = tmp_path / "ck"
    shutil.copytree(random_checkpoint, ck)
    loaded = checkpoint.load(ck)
    tok = loaded.tokenizer
    pairs = [(tok.encode(s), tok.encode(t)) for s, t in zip(RANDOM_MODEL_SENTENCES[0::2], RANDOM_MODEL_SENTENCES[1::2])]
    table = shortlist.build(pairs, src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, k=2, frequent=3, always=(tok.eos_id,))
    checkpoint.add_file(ck, checkpoint.SHORTLIST, lambda path: shortlist.save(table, path))
    out = export_ctranslate2(ck, tmp_path / "ct2")
    pieces = tok.pieces(range(tok.vocab_size))
    lines = (out / "vmap.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "\t" + " ".join(pieces[i] for i in table.frequent.tolist())
    expected = {pieces[s]: [pieces[t] for t in row if t >= 0] for s, row in enumerate(table.table.tolist()) if max(row) >= 0}
    assert {line.split("\t")[0]: line.split("\t")[1].split(" ") for line in lines[1:]} == expected

    engine = ctranslate2.Translator(str(out), device="cpu")
    source = tok.pieces(tok.encode(RANDOM_MODEL_SENTENCES[0]))
    allowed = {t for p in source for t in expected.get(p, [])} | set(lines[0].split("\t")[1].split(" "))
    mapped = engine.translate_batch([source], beam_size=2, use_vmap=True, max_decoding_length=12)[0].hypotheses[0]
    free = engine.translate_batch([source], beam_size=2, max_decoding_length=12)[0].hypotheses[0]
    assert set(mapped) <= allowed | {pieces[i] for i in (tok.unk_id, tok.bos_id)}  # CTranslate2 always adds these
    assert not set(free) <= allowed  # the random model does use other pieces: the map restricted it


def test_qkv_shortlist_counts_the_runs_own_multi30k_pairs_by_default(tiny_run, tmp_path):
    import shutil

    from qkv.data.corpus import load_multi30k
    from qkv.train.recipes import DataConfig
    from qkv.model.config import config_from_dict

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    done = qkv("shortlist", "--checkpoint", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = checkpoint.load(run / "final")
    data = config_from_dict(DataConfig, loaded.config["data"])
    train = load_multi30k("train", data.src_lang, data.tgt_lang, data.data_dir)
    n = data.train_limit or len(train.src)
    tok = loaded.tokenizer
    expected = shortlist.build(((tok.encode(s), tok.encode(t)) for s, t in zip(train.src[:n], train.tgt[:n])),
                               src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, always=(tok.eos_id,))
    table = shortlist.load(run / "final" / checkpoint.SHORTLIST, src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size)
    assert table.info["pairs"] == n and table.table.equal(expected.table) and table.frequent.equal(expected.frequent)
    assert f"{n:,} pairs counted" in done.stdout


def _shortlist_cli(*args: str) -> tuple[int, str]:
    """``qkv shortlist ARGS`` in this process (no interpreter to start): its status and stderr."""
    import contextlib
    import io

    from qkv.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["shortlist", *args])
    return code, err.getvalue()


def test_long_lines_are_counted_as_training_cut_them_in_bounded_memory(random_checkpoint, tmp_path):
    """A line pair of thousands of pieces used to be counted whole: its pairs of pieces, and the memory,
    grew with the square of its length. The pieces past the model's max_len - 1 never reached training."""
    import shutil
    import tracemalloc

    ck = tmp_path / "ck"
    shutil.copytree(random_checkpoint, ck)
    src = ["A dog runs across the green field. " * 150 + "Two children play with a red ball. " * 150, "A dog runs."]
    tgt = ["Ein Hund rennt über die grüne Wiese. " * 150 + "Zwei Kinder spielen mit einem roten Ball. " * 150, "Ein Hund rennt."]
    (tmp_path / "train.en").write_text("\n".join(src) + "\n")
    (tmp_path / "train.de").write_text("\n".join(tgt) + "\n")
    code, err = _shortlist_cli("--checkpoint", str(ck), "--train-src", str(tmp_path / "train.en"), "--train-tgt",
                               str(tmp_path / "train.de"), "--k", "3", "--frequent", "5")
    assert code == 0, err
    loaded = checkpoint.load(ck)
    tok, cut = loaded.tokenizer, loaded.model.config.max_len - 1
    assert len(tok.encode(src[0])) > cut and len(tok.encode_target(tgt[0])) > cut
    whole = [(tok.encode(s), tok.encode_target(t)) for s, t in zip(src, tgt)]
    counted = [(s[:cut], t[:cut]) for s, t in whole]
    kwargs = dict(src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, k=3, frequent=5, always=(tok.eos_id,))
    expected, uncut = shortlist.build(counted, **kwargs), shortlist.build(whole, **kwargs)
    assert not expected.table.equal(uncut.table)  # the test can tell a cut count from a whole one
    table = shortlist.load(ck / checkpoint.SHORTLIST, src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size)
    assert table.table.equal(expected.table) and table.frequent.equal(expected.frequent)

    # 3,000 distinct pieces a side: 9 million pairs of pieces whole, 10,000 cut to 100
    pair = (list(range(3000)), list(range(3000)))
    tracemalloc.start()
    shortlist.build([pair], src_vocab=3000, tgt_vocab=3000, k=2, frequent=0, max_len=100)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # the table itself (3,000 x 2 int32) and counts of 3,000: well under 8 MiB


def test_pairs_are_counted_in_chunks_of_bounded_pairs_of_pieces():
    pairs = random_pairs(300, seed=2)
    table, top = dice_by_hand(pairs, 30, 25, k=4, frequent=6)
    built = shortlist.build(pairs, src_vocab=30, tgt_vocab=25, k=4, frequent=6, max_keys=40)  # a flush every few pairs
    assert [[t for t in row if t >= 0] for row in built.table.tolist()] == table and built.frequent.tolist() == top


def test_train_files_of_different_lengths_are_refused_and_bz2_is_read_as_bz2(random_checkpoint, tmp_path):
    """The target one line short used to shift every later pair; --help promised .bz2, which was read as text."""
    import bz2
    import shutil

    from conftest import RANDOM_MODEL_SENTENCES

    ck = tmp_path / "ck"
    shutil.copytree(random_checkpoint, ck)
    before = snapshot(ck)
    sources, targets = RANDOM_MODEL_SENTENCES[0::2], RANDOM_MODEL_SENTENCES[1::2]
    (tmp_path / "train.en").write_text("\n".join(sources) + "\n")
    (tmp_path / "train.de").write_text("\n".join(targets[:-1]) + "\n")
    code, err = _shortlist_cli("--checkpoint", str(ck), "--train-src", str(tmp_path / "train.en"), "--train-tgt", str(tmp_path / "train.de"))
    assert code == 2 and len(err.splitlines()) == 1
    assert f"line counts differ: {tmp_path / 'train.en'} has {len(sources)} lines but {tmp_path / 'train.de'} has {len(sources) - 1}" in err
    assert snapshot(ck) == before

    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(sources, targets)).encode()
    (tmp_path / "train.tsv.bz2").write_bytes(bz2.compress(tsv))
    code, err = _shortlist_cli("--checkpoint", str(ck), "--train-src", str(tmp_path / "train.tsv.bz2"), "--k", "3")
    assert code == 0, err
    tok = checkpoint.load(ck).tokenizer
    expected = shortlist.build([(tok.encode(s), tok.encode_target(t)) for s, t in zip(sources, targets)], src_vocab=tok.vocab_size,
                               tgt_vocab=tok.vocab_size, k=3, always=(tok.eos_id,))
    assert shortlist.load(ck / checkpoint.SHORTLIST, src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size).table.equal(expected.table)
