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

``MarianTokenizer`` (``qkv.data.marian_tokenizer``) is the other kind: the tokenizer of a Hugging Face
Marian (OPUS-MT) model, with a SentencePiece model per side and one vocabulary file mapping their
pieces to ids. Both kinds have the same interface (``qkv.data.text_tokenizer.TextTokenizer``:
``encode`` for sources, ``encode_target`` for targets, ``decode``, ``pieces``, the special ids,
``save``); ``load_tokenizer`` reads either from a file.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.text_tokenizer import TokenizerError, load_processor

# The ids qkv gives the special pieces when it trains a model. Only ``train`` uses them; everything
# else asks the loaded model, which is the source of truth.
_TRAIN_SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}

# SentencePiece holds its training sentences in memory; more than this many adds little to a
# subword vocabulary, so larger corpora are sampled down first.
DEFAULT_MAX_SENTENCES = 1_000_000

MODEL_TYPES = ("bpe", "unigram", "char", "word")  # SentencePiece's algorithms; qkv uses BPE by default


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


def _read(path: str | Path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise TokenizerError(f"tokenizer model {path} does not exist") from e
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer model {path}: {e.strerror or e}") from e


# SentencePiece's threads pay from about this many sentences (one sentence: 0.31 ms through them, 0.02 ms
# alone; 32: 0.78 against 0.59 ms; 128: 1.98 against 2.46 ms; Multi30k test sentences, this project's 2 cores).
ENCODE_THREADS_FROM = 64


class Tokenizer:
    """A loaded SentencePiece model plus the bytes it was loaded from (so it can be saved or embedded)."""

    def __init__(self, model_proto: bytes, *, name: str = "<bytes>") -> None:
        """Load from serialized model bytes; ``name`` (usually the file) appears in error messages."""
        processor = load_processor(model_proto, name)
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
        """``encode`` for many sentences at once (SentencePiece spreads them over threads; below
        ``ENCODE_THREADS_FROM`` sentences, as a server's requests are, one by one: starting its threads
        costs more than they save)."""
        if len(texts) < ENCODE_THREADS_FROM:
            return [self._sp.encode(text) for text in texts]
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


def tokenizer_from_bytes(data: bytes, *, name: str = "<bytes>") -> Tokenizer | MarianTokenizer:
    """A tokenizer of either kind from its serialized bytes: a Marian tokenizer is a JSON document,
    a qkv tokenizer a SentencePiece model (a protobuf, which never starts with ``{``)."""
    if data.lstrip()[:1] == b"{":
        return MarianTokenizer.from_bytes(data, name=name)
    return Tokenizer(data, name=name)


def load_tokenizer(path: str | Path) -> Tokenizer | MarianTokenizer:
    """Load a tokenizer file of either kind (what ``save`` wrote)."""
    return tokenizer_from_bytes(_read(path), name=str(path))
