"""What every qkv tokenizer is (``TextTokenizer``), its error, and the loading of a SentencePiece
model that both kinds share: qkv's joint ``Tokenizer`` (``qkv.data.tokenizer``) and an imported
Marian model's ``MarianTokenizer`` (``qkv.data.marian_tokenizer``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

from qkv.errors import QkvError


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


def load_processor(proto: bytes, name: str) -> spm.SentencePieceProcessor:
    """A SentencePiece processor from a serialized model; ``name`` (the file) in the error."""
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError, TypeError) as e:
        raise TokenizerError(f"{name} is not a valid SentencePiece model: {e}") from e
    return processor
