"""`--engine ctranslate2` with qkv's search options: `--shortlist` as CTranslate2's vocabulary map,
`--no-repeat-ngram` and the loop guard, each acting on that engine (they were refused or ignored)."""

from __future__ import annotations

import shutil

import pytest

ct2 = pytest.importorskip("ctranslate2")

from qkv.cli.main import main  # noqa: E402
from qkv.infer.search import DecodeConfig, loops, max_output_length  # noqa: E402
from qkv.infer.translator import Translator  # noqa: E402
from qkv.interop.ct2_engine import CTranslate2Translator, ensure_export  # noqa: E402
from qkv.interop.ctranslate2 import ct2_translate_ids  # noqa: E402
from qkv.infer import shortlist as shortlists  # noqa: E402
from qkv.io import checkpoint  # noqa: E402

LINES = ["A man is riding a bike.", "Two dogs play in the snow.", "A woman sings on a stage.",
         "Children are playing football in a park.", "An old man sits on a bench near the water."]


@pytest.fixture
def listed(tiny_run, tmp_path, monkeypatch):
    """A copy of the tiny run's final checkpoint with a shortlist (qkv shortlist), and its own export cache."""
    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model"
    shutil.copytree(checkpoint.resolve(tiny_run), copy)
    assert main(["shortlist", "--checkpoint", str(copy), "--k", "5", "--frequent", "20", "--max-pairs", "2000"]) == 0
    return copy


def test_shortlist_is_the_vocabulary_map_and_translates_as_qkvs_shortlist(listed):
    """One sentence a batch, CTranslate2's map of a sentence is that sentence's own shortlist: greedy,
    both engines give the same translations, and they differ from the search over the whole vocabulary
    somewhere (or the map would not restrict anything)."""
    loaded = checkpoint.load(listed)
    table = shortlists.load(listed / checkpoint.SHORTLIST, src_vocab=loaded.model.config.src_vocab_size,
                            tgt_vocab=loaded.model.config.tgt_vocab_size)
    ct2_dir, _ = ensure_export(listed)
    assert (ct2_dir / "vmap.txt").is_file()
    greedy = DecodeConfig(beam_size=1)
    translator = Translator(loaded.model, loaded.tokenizer, greedy, shortlist=table)
    src_ids = [translator.encode(s) for s in LINES]
    ours = [h[0].tokens for h in translator.translate_ids(src_ids)]
    engine = ct2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
    theirs = [ct2_translate_ids(engine, loaded.tokenizer, [ids], greedy, max_len=loaded.model.config.max_len, use_vmap=True)[0]
              for ids in src_ids]
    assert theirs == ours
    allowed = [set(table.frequent.tolist()) | {t for s in ids for t in table.table[s].tolist() if t >= 0} for ids in src_ids]
    assert all(set(out) <= ok for out, ok in zip(theirs, allowed))

    translated = CTranslate2Translator(loaded.model, loaded.tokenizer, greedy, ct2_dir=ct2_dir, shortlist=table, threads=1)
    assert translated.use_vmap
    assert [h[0].tokens for h in translated.translate_ids(src_ids)] == \
        ct2_translate_ids(translated.engine, loaded.tokenizer, src_ids, greedy, max_len=loaded.model.config.max_len,
                          max_tokens=translated.max_tokens, use_vmap=True)


def test_no_repeat_ngram_and_the_loop_guard_act_on_ctranslate2(tiny_run, tmp_path, monkeypatch):
    """The tiny model loops; --no-repeat-ngram 1 on CTranslate2 leaves no token twice, and the loop guard
    searches exactly the looping outputs again with that n-gram size."""
    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    loaded = checkpoint.load(tiny_run)
    ct2_dir, _ = ensure_export(tiny_run)
    plain = DecodeConfig(beam_size=2)
    run = lambda config: [h[0].tokens for h in CTranslate2Translator(  # noqa: E731
        loaded.model, loaded.tokenizer, config, ct2_dir=ct2_dir, threads=1).translate_ids(src_ids)]
    src_ids = [Translator(loaded.model, loaded.tokenizer).encode(s) for s in LINES]
    before = run(plain)
    assert any(len(set(out)) < len(out) for out in before)  # something repeats without the option
    blocked = run(DecodeConfig(beam_size=2, no_repeat_ngram_size=1))
    assert all(len(set(out)) == len(out) for out in blocked)

    looping = [i for i, (ids, out) in enumerate(zip(src_ids, before)) if loops(out, max_output_length(loaded.model, len(ids) + 1, plain))]
    assert looping, "the tiny model should loop on some of these lines"
    guarded = run(DecodeConfig(beam_size=2, loop_guard=1))
    for i, out in enumerate(guarded):
        assert out == (blocked[i] if i in looping else before[i])


def test_the_command_line_passes_no_repeat_ngram_to_ctranslate2(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src.txt"
    src.write_text("\n".join(LINES) + "\n")
    base = ["translate", "--checkpoint", str(tiny_run), "--engine", "ctranslate2", "--beam", "2", "-i", str(src), "--no-split"]
    assert main([*base, "--loop-guard", "0"]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main([*base, "--loop-guard", "0", "--no-repeat-ngram", "1"]) == 0
    blocked = capsys.readouterr().out.splitlines()
    assert plain != blocked
    assert all(len(set(line.split())) == len(line.split()) for line in blocked)


def test_a_deep_encoder_shallow_decoder_student_exports_with_its_map_and_translates_the_same(random_checkpoint, tmp_path, monkeypatch):
    """A student's shape (the multi30k-6-1 preset's layers, at the tiny width): qkv and CTranslate2 give
    the same greedy translations, with and without the shortlist as the vocabulary map (one sentence a
    batch). Random weights, scaled up so that no step is a near tie: the export's layout is what is
    tested, not the quality."""
    import torch

    from qkv.model.transformer import Transformer
    from qkv.train.recipes import build_configs

    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    preset, _, _ = build_configs("multi30k-6-1", model={}, train={}, data={})
    assert (preset.n_encoder_layers, preset.n_decoder_layers) == (6, 1)
    tok = checkpoint.load(random_checkpoint).tokenizer
    torch.manual_seed(3)
    config = preset.replace(d_model=32, n_heads=2, d_ff=64, dropout=0.0, src_vocab_size=tok.vocab_size,
                            tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    model = Transformer(config)
    with torch.no_grad():
        model.src_embed.weight.mul_(8.0)  # tied to the output projection: logits far apart
        # <pad>, <unk>, <s> at logit 0: a random model would write <s>, which CTranslate2's map always
        # allows and qkv's shortlist never does (a trained model never writes it)
        model.src_embed.weight[: tok.bos_id + 1] = 0.0
    student = checkpoint.save(tmp_path / "student", model, tok, configs={"data": {"src_lang": "en", "tgt_lang": "de"}})
    assert main(["shortlist", "--checkpoint", str(student), "--train-src", str(_lines(tmp_path, "src", LINES * 4)),
                 "--train-tgt", str(_lines(tmp_path, "tgt", (LINES[1:] + LINES[:1]) * 4)), "--k", "5", "--frequent", "10"]) == 0
    loaded = checkpoint.load(student)
    table = shortlists.load(student / checkpoint.SHORTLIST, src_vocab=config.src_vocab_size, tgt_vocab=config.tgt_vocab_size)
    ct2_dir, _ = ensure_export(student)
    engine = ct2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
    greedy = DecodeConfig(beam_size=1, max_len_a=0, max_len_b=8)
    for shortlist, use_vmap in ((None, False), (table, True)):
        translator = Translator(loaded.model, tok, greedy, shortlist=shortlist)
        src_ids = [translator.encode(s) for s in LINES]
        ours = [h[0].tokens for h in translator.translate_ids(src_ids)]
        theirs = [ct2_translate_ids(engine, tok, [ids], greedy, max_len=config.max_len, use_vmap=use_vmap)[0] for ids in src_ids]
        assert theirs == ours


def _lines(where, name, lines):
    path = where / f"{name}.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_batch_is_split_over_ctranslate2s_threads_and_translates_the_same(tiny_run, tmp_path, monkeypatch):
    """A server's batch (32 sentences, far under max_tokens) goes to CTranslate2 in as many batches as it
    has threads, so that none is idle; the translations are those of one thread and one batch."""
    monkeypatch.setenv("QKV_CT2_CACHE", str(tmp_path / "cache"))
    loaded = checkpoint.load(tiny_run)
    ct2_dir, _ = ensure_export(tiny_run)
    src_ids = [Translator(loaded.model, loaded.tokenizer).encode(s) for s in LINES * 7][:32]
    config = DecodeConfig(beam_size=2)
    outputs, sizes = {}, {}
    for threads in (1, 2):
        translator = CTranslate2Translator(loaded.model, loaded.tokenizer, config, ct2_dir=ct2_dir, threads=threads, max_tokens=4096)
        calls = []
        real = translator.engine.translate_batch
        translator.engine = type("Spy", (), {"translate_batch": lambda self, batch, **kw: calls.append(kw) or real(batch, **kw)})()
        outputs[threads] = [h[0].tokens for h in translator.translate_ids(src_ids)]
        sizes[threads] = [kw["max_batch_size"] for kw in calls]
    total = sum(len(ids) + 1 for ids in src_ids)
    assert sizes[1] == [total]  # one thread: the whole batch at once
    assert sizes[2] and all(size < total for size in sizes[2]) and sizes[2][0] >= -(-total // 2)
    assert outputs[2] == outputs[1]
