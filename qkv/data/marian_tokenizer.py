"""The tokenizer of a Hugging Face Marian (OPUS-MT) model, id for id as ``transformers.MarianTokenizer``:
a SentencePiece model per side and one vocabulary mapping their pieces to ids. It has qkv's
tokenizer interface (``qkv.data.text_tokenizer.TextTokenizer``); ``qkv.data.tokenizer.load_tokenizer``
reads either kind from a file."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from qkv.data.text_tokenizer import TokenizerError, load_processor

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
        self._source = load_processor(source_spm, f"{name} (source)")
        self._target = load_processor(target_spm, f"{name} (target)")
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
