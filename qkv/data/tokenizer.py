"""A joint subword tokenizer for source and target, wrapping SentencePiece BPE.

Why SentencePiece:
- It detokenizes losslessly: pieces carry their own whitespace (``▁``), so ``decode(encode(x))``
  gives back the original sentence (after NFKC normalization and whitespace collapsing), with its
  case and punctuation. sacreBLEU then scores real, detokenized text, which is what makes BLEU
  numbers comparable across papers; scoring tokenized or lower-cased text inflates them.
- One vocabulary trained on both languages lets the model share source and target embeddings and
  the output projection (section 3.4 of the paper, ``share_embeddings``/``tie_output``).
- Training is fast C++ run in-process from Python strings: no temporary corpus files, no subprocess.

The special ids are fixed when training (pad 0, unk 1, bos 2, eos 3), but every other part of qkv reads
them from a loaded tokenizer (``tokenizer.pad_id``), so a model trained elsewhere with other ids works.

``MarianTokenizer`` is the other kind: the tokenizer of a Hugging Face Marian (OPUS-MT) model, with a
SentencePiece model per side and one vocabulary file mapping their pieces to ids. Both kinds have
the same interface (``encode`` for sources, ``encode_target`` for targets, ``decode``, ``pieces``,
the special ids, ``save``); ``load_tokenizer`` reads either from a file.
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

from qkv.errors import QkvError

# The ids qkv gives the special pieces when it trains a model. Only ``train`` uses them; everything
# else asks the loaded model, which is the source of truth.
_TRAIN_SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}

# SentencePiece holds its training sentences in memory; more than this many adds little to a
# subword vocabulary, so larger corpora are sampled down first.
DEFAULT_MAX_SENTENCES = 1_000_000

MODEL_TYPES = ("bpe", "unigram", "char", "word")  # SentencePiece's algorithms; qkv uses BPE by default


class TextTokenizer(Protocol):
    """What translating, scoring and inspecting need of a tokenizer: qkv's joint ``Tokenizer`` and an
    imported model's ``MarianTokenizer`` (two SentencePiece models and one vocabulary) both are one."""

    @property
    def pad_id(self) -> int: ...

    @property
    def unk_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_target(self, text: str) -> list[int]: ...

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def normalize(self, text: str) -> str: ...

    def pieces(self, ids: Sequence[int]) -> list[str]: ...

    def save(self, path: str | Path) -> None: ...


class TokenizerError(QkvError):
    """A tokenizer could not be trained or loaded; the message names the file or the setting."""


def _sample(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """Uniform sample of at most ``k`` non-empty sentences (reservoir sampling, algorithm R).

    Done here rather than with SentencePiece's ``input_sentence_size``/``shuffle_input_sentence``
    because its sampler ignores our seed (with 0.2.3, ``set_random_generator_seed`` did not change the
    sample), and one pass keeps memory at ``k`` sentences for a corpus of any size.
    The sample keeps corpus order when the corpus has at most ``k`` sentences.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for text in texts:
        if not text.strip():
            continue
        seen += 1
        if len(sample) < k:
            sample.append(text)
        else:
            j = rng.randrange(seen)
            if j < k:
                sample[j] = text
    return sample


def _processor(proto: bytes, name: str) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError, TypeError) as e:
        raise TokenizerError(f"{name} is not a valid SentencePiece model: {e}") from e
    return processor


def _read(path: str | Path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise TokenizerError(f"tokenizer model {path} does not exist") from e
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer model {path}: {e.strerror or e}") from e


class Tokenizer:
    """A loaded SentencePiece model plus the bytes it was loaded from (so it can be saved or embedded)."""

    def __init__(self, model_proto: bytes, *, name: str = "<bytes>") -> None:
        """Load from serialized model bytes; ``name`` (usually the file) appears in error messages."""
        processor = _processor(model_proto, name)
        for special in ("pad", "unk", "bos", "eos"):
            # SentencePiece disables pad (-1) by default; qkv's batching and loss need every one.
            if getattr(processor, f"{special}_id")() < 0:
                raise TokenizerError(
                    f"{name} has no {special} piece; train the tokenizer with qkv (Tokenizer.train), "
                    f"or with SentencePiece and --{special}_id set"
                )
        self._sp = processor
        self._model_proto = bytes(model_proto)
        self.name = name

    # ---- training, loading, saving -------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        path: str | Path,
        *,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        seed: int = 0,
        max_sentences: int = DEFAULT_MAX_SENTENCES,
        split_digits: bool = False,
    ) -> Tokenizer:
        """Train a model on ``texts`` (one sentence each), write it to ``path`` and return it.

        For a joint vocabulary pass the source and target sentences together, for example
        ``itertools.chain(corpus.src, corpus.tgt)``. ``vocab_size`` is an upper bound: a corpus too
        small to yield that many pieces gives a smaller vocabulary (check ``.vocab_size``) instead
        of failing, so tiny test corpora work. Corpora over ``max_sentences`` are sampled with
        ``seed``; training is deterministic for the same texts and seed. ``split_digits`` makes
        every digit its own piece (numbers are then copied digit by digit, as in the dates demo).
        """
        if vocab_size <= len(_TRAIN_SPECIAL_IDS):
            n_special = len(_TRAIN_SPECIAL_IDS)
            raise TokenizerError(f"vocab_size must exceed the {n_special} special pieces, got {vocab_size}")
        if model_type not in MODEL_TYPES:
            raise TokenizerError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
        if not 0.0 < character_coverage <= 1.0:
            raise TokenizerError(f"character_coverage must be in (0, 1], got {character_coverage}")
        if max_sentences <= 0:
            raise TokenizerError(f"max_sentences must be positive, got {max_sentences}")
        sample = _sample(texts, max_sentences, seed)
        if not sample:
            raise TokenizerError("cannot train a tokenizer on an empty corpus (no non-empty sentences)")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                # nmt_nfkc keeps case (the *_cf variant would fold it) and only unifies look-alike
                # characters and whitespace, so decoded output stays ordinary cased text.
                normalization_rule_name="nmt_nfkc",
                hard_vocab_limit=False,  # a smaller vocabulary rather than "Vocabulary size too high"
                input_sentence_size=0,  # the sample above is already the size we want: use all of it
                shuffle_input_sentence=False,
                split_digits=split_digits,
                minloglevel=2,  # training is silent unless it fails
                **_TRAIN_SPECIAL_IDS,
            )
        except RuntimeError as e:
            # The usual cause is a vocab_size below the number of distinct characters; SentencePiece's
            # message says so and what to change.
            raise TokenizerError(
                f"SentencePiece could not train a {model_type} model with vocab_size {vocab_size} "
                f"on {len(sample)} sentences: {e}"
            ) from e
        tokenizer = cls(model.getvalue(), name=str(path))
        tokenizer.save(path)
        return tokenizer

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a ``.model`` file written by ``train`` or ``save``."""
        return cls(_read(path), name=str(path))

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Tokenizer:
        """Load from serialized model bytes, for example those stored inside a checkpoint."""
        return cls(model_proto)

    def save(self, path: str | Path) -> None:
        """Write the serialized model to ``path`` (SentencePiece's own ``.model`` format)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self._model_proto)

    @property
    def model_proto(self) -> bytes:
        """The serialized model; ``Tokenizer.from_bytes(t.model_proto)`` rebuilds ``t``."""
        return self._model_proto

    # ---- vocabulary ----------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special ones included: the model's embedding size."""
        return self._sp.get_piece_size()

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    # ---- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without BOS or EOS (``qkv.data.corpus.collate`` adds those)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` for many sentences at once (SentencePiece spreads them over threads)."""
        return self._sp.encode(list(texts))

    def sample_batch(self, texts: list[str], *, dropout: float, seed: int) -> list[list[int]]:
        """Segmentations drawn at random (BPE-dropout, Provilkov et al. 2020: each merge is skipped
        with probability ``dropout``), the same for the same ``seed``; they decode to the same text.
        Subword regularization for the training data: the model sees a word in many pieces."""
        spm.set_random_generator_seed(seed)
        return self._sp.encode(list(texts), enable_sampling=True, alpha=dropout, nbest_size=-1, num_threads=1)  # one thread: reproducible

    def encode_target(self, text: str) -> list[int]:
        """Subword ids of a target sentence: the same as ``encode``, the vocabulary being joint."""
        return self.encode(text)

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of ``ids``, cut at the first EOS; pad and BOS are dropped.

        Accepts the raw output of a search (a list, or a 1-D tensor's ``.tolist()``), so callers need
        not strip the BOS they started from or the EOS and padding after it.
        """
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        self._check_ids(ids)
        skip = (self.pad_id, self.bos_id)
        return self._sp.decode([i for i in ids if i not in skip])

    def normalize(self, text: str) -> str:
        """``text`` as the tokenizer sees it (NFKC, whitespace collapsed): what ``decode(encode(text))``
        gives back when every character is in the vocabulary's alphabet."""
        return self._sp.normalize(text).replace("\u2581", " ").strip()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One subword string per id (``▁`` marks a word start), e.g. for attention-plot labels."""
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        return [self._sp.id_to_piece(i) for i in ids]

    def _check_ids(self, ids: list[int]) -> None:
        # SentencePiece's own message ("piece id is out of range") does not say which id or why.
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"id {i} is outside the vocabulary of {self.name} (size {self.vocab_size})")


# ---- Hugging Face Marian (OPUS-MT) ------------------------------------------------------------------

MARIAN_KIND = "marian"
MARIAN_FORMAT = 1
# What Hugging Face's decode(..., clean_up_tokenization_spaces=True) undoes, in its order.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


class MarianTokenizer:
    """The tokenizer of a Hugging Face Marian model (OPUS-MT), id for id as ``transformers.MarianTokenizer``.

    Marian segments the source with ``source.spm`` and the target with ``target.spm``, then maps the
    pieces (not SentencePiece's own ids) to ids through one shared ``vocab.json``; a piece that is
    not in it is ``<unk>``. As in transformers, the special tokens' text (``</s>``, ``<unk>``,
    ``<pad>``) inside a sentence is that token, and a leading language code such as ``>>fra<<``
    (multilingual models) is one token. Marian has no BOS: the decoder starts from
    ``decoder_start_id`` (pad in OPUS-MT), which qkv uses as ``bos_id``. ``decode`` gives what
    ``transformers.MarianTokenizer.decode(ids, skip_special_tokens=True)`` gives (``<unk>`` dropped),
    detokenizing with the target's SentencePiece model.
    """

    def __init__(
        self, *, source_spm: bytes, target_spm: bytes, vocab: dict[str, int], decoder_start_id: int,
        eos: str = "</s>", unk: str = "<unk>", pad: str = "<pad>", source_lang: str | None = None,
        target_lang: str | None = None, clean_up_tokenization_spaces: bool = False, name: str = "<bytes>",
    ) -> None:
        if not isinstance(vocab, dict) or not all(isinstance(k, str) and type(v) is int for k, v in vocab.items()):
            raise TokenizerError(f"{name}: the vocabulary must map pieces to integer ids")
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise TokenizerError(f"{name}: the vocabulary's ids must be 0 .. {len(vocab) - 1}, each once")
        for role, token in (("eos", eos), ("unk", unk), ("pad", pad)):
            if token not in vocab:
                raise TokenizerError(f"{name}: the {role} token {token!r} is not in the vocabulary")
        if type(decoder_start_id) is not int or not 0 <= decoder_start_id < len(vocab):
            raise TokenizerError(f"{name}: the decoder start id {decoder_start_id!r} is outside the vocabulary")
        self._source = _processor(source_spm, f"{name} (source)")
        self._target = _processor(target_spm, f"{name} (target)")
        self._source_spm, self._target_spm = bytes(source_spm), bytes(target_spm)
        self.vocab = dict(vocab)
        self._pieces = sorted(self.vocab, key=self.vocab.__getitem__)  # id -> piece
        self.special = {"eos": eos, "unk": unk, "pad": pad}
        self.decoder_start_id = decoder_start_id
        self.source_lang, self.target_lang = source_lang, target_lang
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.name = name
        # transformers splits a text at the special tokens' strings before segmenting it (its "trie"
        # of added tokens; none of the three is a prefix of another, so an alternation is the same).
        self._special_tokens = frozenset(self.special.values())
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self._special_tokens))) + ")")

    # ---- loading, saving -----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The whole tokenizer as one JSON document (the SentencePiece models base64-encoded)."""
        data = {
            "kind": MARIAN_KIND, "format": MARIAN_FORMAT, "vocab": self.vocab, "special": self.special,
            "decoder_start_id": self.decoder_start_id, "source_lang": self.source_lang, "target_lang": self.target_lang,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            "source_spm": base64.b64encode(self._source_spm).decode("ascii"),
            "target_spm": base64.b64encode(self._target_spm).decode("ascii"),
        }
        return json.dumps(data, ensure_ascii=False, sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str = "<bytes>") -> MarianTokenizer:
        """The inverse of ``to_bytes``; every field is checked, and an error names ``name``."""
        try:
            doc = json.loads(data.decode("utf-8"))
            if doc.get("kind") != MARIAN_KIND or doc.get("format") != MARIAN_FORMAT:
                raise TokenizerError(f"{name} is not a format-{MARIAN_FORMAT} Marian tokenizer")
            special = doc["special"]
            return cls(
                source_spm=base64.b64decode(doc["source_spm"], validate=True),
                target_spm=base64.b64decode(doc["target_spm"], validate=True), vocab=doc["vocab"],
                decoder_start_id=doc["decoder_start_id"], eos=special["eos"], unk=special["unk"], pad=special["pad"],
                source_lang=doc.get("source_lang"), target_lang=doc.get("target_lang"),
                clean_up_tokenization_spaces=doc.get("clean_up_tokenization_spaces", False), name=name,
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError, RecursionError) as e:
            if isinstance(e, TokenizerError):
                raise
            raise TokenizerError(f"{name} is not a valid Marian tokenizer ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_bytes())

    @property
    def source_spm(self) -> bytes:
        return self._source_spm

    @property
    def target_spm(self) -> bytes:
        return self._target_spm

    # ---- vocabulary ----------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return self.vocab[self.special["pad"]]

    @property
    def unk_id(self) -> int:
        return self.vocab[self.special["unk"]]

    @property
    def bos_id(self) -> int:
        """Marian's decoder start token (pad in OPUS-MT): what the target starts from."""
        return self.decoder_start_id

    @property
    def eos_id(self) -> int:
        return self.vocab[self.special["eos"]]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"MarianTokenizer({self.name!r}, vocab_size={self.vocab_size})"

    # ---- text <-> ids --------------------------------------------------------------------------

    def _encode(self, text: str, sp: spm.SentencePieceProcessor) -> list[int]:
        ids: list[int] = []
        unk = self.unk_id
        for chunk in self._split.split(text):
            if chunk in self._special_tokens:
                ids.append(self.vocab[chunk])
            elif chunk:
                code = []
                if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:  # a language code, as transformers
                    code, chunk = [chunk[: end + 2]], chunk[end + 2 :]
                ids.extend(self.vocab.get(piece, unk) for piece in code + sp.encode(chunk, out_type=str))
        return ids

    def encode(self, text: str) -> list[int]:
        """Ids of a source sentence with ``source.spm``, without the EOS (``collate`` adds it)."""
        return self._encode(text, self._source)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t, self._source) for t in texts]

    def encode_target(self, text: str) -> list[int]:
        """Ids of a target sentence with ``target.spm`` (transformers' ``text_target=``), without EOS."""
        return self._encode(text, self._target)

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t, self._target) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized target text of ``ids``, cut at the first EOS; pad, BOS and ``<unk>`` are dropped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        skip = (self.pad_id, self.bos_id, self.unk_id)
        text = self._target.decode_pieces([p for i, p in zip(ids, self.pieces(ids)) if i not in skip])
        text = text.replace("\u2581", " ").strip()
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def normalize(self, text: str) -> str:
        """``text`` as the source model sees it (its normalization rules, whitespace collapsed)."""
        return self._source.normalize(text).replace("\u2581", " ").strip()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's string for each id (source and target share it)."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"id {i} is outside the vocabulary of {self.name} (size {self.vocab_size})")
        return [self._pieces[i] for i in ids]


def tokenizer_from_bytes(data: bytes, *, name: str = "<bytes>") -> Tokenizer | MarianTokenizer:
    """A tokenizer of either kind from its serialized bytes: a Marian tokenizer is a JSON document,
    a qkv tokenizer a SentencePiece model (a protobuf, which never starts with ``{``)."""
    if data.lstrip()[:1] == b"{":
        return MarianTokenizer.from_bytes(data, name=name)
    return Tokenizer(data, name=name)


def load_tokenizer(path: str | Path) -> Tokenizer | MarianTokenizer:
    """Load a tokenizer file of either kind (what ``save`` wrote)."""
    return tokenizer_from_bytes(_read(path), name=str(path))
