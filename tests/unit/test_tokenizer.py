"""The SentencePiece tokenizer: training, special ids, lossless round trips, saving and loading."""

from __future__ import annotations

import io
import random

import pytest
import sentencepiece as spm

from qkv.data.tokenizer import Tokenizer, TokenizerError

SUBJECTS = ["A man", "The Dog", "Two young women", "An old MAN", "Ein Mann", "Zwei Kinder", "Une femme"]
VERBS = ["is running", "sits", "läuft", "spielt", "mange", "looks at", "is holding"]
OBJECTS = ["a red ball", "the camera", "das Wasser", "einen Ball", "la pomme", "New York", "3 dogs"]
ENDINGS = [".", "!", "?", ", quickly.", " (again).", "; well.", ": \"yes\"."]


def sentences(n: int, seed: int) -> list[str]:
    """Cased sentences with punctuation, digits and accents, in English, German and French words."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}" for _ in range(n)
    ]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return sentences(500, seed=0)


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory) -> Tokenizer:
    return Tokenizer.train(corpus, vocab_size=120, path=tmp_path_factory.mktemp("tok") / "spm.model")


def test_special_ids_are_the_ones_set_at_training(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.pieces([tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == len(tok) == 120


def test_round_trip_keeps_case_and_punctuation(tok):
    unseen = [s for s in sentences(200, seed=1) if s not in set(sentences(500, seed=0))]
    assert unseen, "the test needs sentences the tokenizer was not trained on"
    for text in unseen + ["AN old MAN sits. A DAY in New York!", 'Une femme mange la pomme: "yes".']:
        assert tok.decode(tok.encode(text)) == text


def test_encode_adds_no_bos_or_eos_and_batch_matches(tok, corpus):
    ids = tok.encode(corpus[0])
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.encode_batch(corpus[:5]) == [tok.encode(t) for t in corpus[:5]]


def test_decode_cuts_at_first_eos_and_drops_pad_and_bos(tok):
    first, second = tok.encode("A man sits."), tok.encode("The Dog läuft!")
    ids = [tok.bos_id, *first, tok.eos_id, *second, tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "A man sits."
    assert tok.decode([tok.bos_id, *first, tok.pad_id]) == "A man sits."
    assert tok.decode([tok.eos_id, *first]) == ""


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(TokenizerError, match=f"id {tok.vocab_size} is outside"):
        tok.decode([5, tok.vocab_size])


def test_pieces_one_per_id_and_spell_the_text(tok):
    text = "Two young women spielt einen Ball (again)."
    ids = tok.encode(text)
    pieces = tok.pieces(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces).replace("\u2581", " ").strip() == text


def test_whitespace_is_normalized_not_kept(tok):
    # nmt_nfkc collapses runs of spaces and trims ends: the one way a round trip changes text.
    assert tok.decode(tok.encode("  A man   sits. ")) == "A man sits."


def test_vocab_size_too_high_for_the_corpus_gives_a_smaller_vocabulary(tmp_path):
    tok = Tokenizer.train(["A man sits.", "The Dog läuft!"], vocab_size=5000, path=tmp_path / "small.model")
    assert 4 < tok.vocab_size < 5000
    assert tok.decode(tok.encode("The Dog läuft!")) == "The Dog läuft!"


def test_vocab_size_below_the_alphabet_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(TokenizerError, match="vocab_size 10.*Increase vocab_size"):
        Tokenizer.train(corpus, vocab_size=10, path=tmp_path / "x.model")
    assert not (tmp_path / "x.model").exists()


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"model_type": "bpe2"}, "model_type must be one of bpe, unigram, char, word, got 'bpe2'"),
        ({"character_coverage": 0.0}, r"character_coverage must be in \(0, 1\]"),
        ({"vocab_size": 4}, "vocab_size must exceed the 4 special pieces"),
    ],
)
def test_bad_training_settings_are_named(corpus, tmp_path, kwargs, pattern):
    with pytest.raises(TokenizerError, match=pattern):
        Tokenizer.train(corpus, path=tmp_path / "x.model", **{"vocab_size": 100, **kwargs})


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(TokenizerError, match="empty corpus"):
        Tokenizer.train(["", "  "], vocab_size=100, path=tmp_path / "x.model")


def test_training_is_silent_and_deterministic(corpus, tmp_path, capfd):
    a = Tokenizer.train(iter(corpus), vocab_size=100, path=tmp_path / "a.model")
    b = Tokenizer.train(iter(corpus), vocab_size=100, path=tmp_path / "b.model")
    out, err = capfd.readouterr()  # file-descriptor level: catches SentencePiece's C++ logging too
    assert out == "" and err == ""
    assert a.model_proto == b.model_proto


def test_large_corpora_are_sampled_with_the_seed(corpus, tmp_path):
    def train(seed: int, name: str) -> bytes:
        return Tokenizer.train(corpus, 60, tmp_path / name, seed=seed, max_sentences=20).model_proto

    assert train(0, "a.model") == train(0, "b.model")
    assert train(0, "c.model") != train(1, "d.model")


def test_train_writes_the_file_and_save_load_round_trips(tok, corpus, tmp_path):
    loaded = Tokenizer.load(tok.name)
    assert loaded.model_proto == tok.model_proto
    tok.save(tmp_path / "sub" / "copy.model")
    copy = Tokenizer.load(tmp_path / "sub" / "copy.model")
    embedded = Tokenizer.from_bytes(tok.model_proto)
    for t in (loaded, copy, embedded):
        assert t.encode_batch(corpus[:20]) == tok.encode_batch(corpus[:20])


def test_load_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match="nope.model does not exist"):
        Tokenizer.load(path)


def test_load_corrupt_file_names_it(tmp_path):
    path = tmp_path / "corrupt.model"
    path.write_bytes(b"this is not a protobuf")
    with pytest.raises(TokenizerError, match="corrupt.model is not a valid SentencePiece model"):
        Tokenizer.load(path)


def test_load_rejects_a_model_without_a_pad_piece(corpus, tmp_path):
    model = io.BytesIO()
    # SentencePiece's defaults: no pad piece (pad_id=-1).
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=80, minloglevel=2, hard_vocab_limit=False
    )
    path = tmp_path / "nopad.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(TokenizerError, match="nopad.model has no pad piece"):
        Tokenizer.load(path)
