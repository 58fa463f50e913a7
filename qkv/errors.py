"""The one base class of what a user can cause and fix: a bad setting, flag, file, checkpoint or
tokenizer, a missing optional package.

``qkv``'s command line prints a ``QkvError`` (and an ``OSError``: a missing file, a full disk) as one
line and exits with status 2; anything else (a PyTorch failure such as running out of memory, or a
bug) shows as itself, with its traceback. It is a ``ValueError``, so code that caught the errors of
a bad value before still catches them.
"""

from __future__ import annotations


class QkvError(ValueError):
    """Something the user can fix; the message says what and how, in one line."""


class MissingPackage(QkvError):
    """An optional package a command needs is not installed (the message names the pip extra)."""


class NonFiniteLoss(QkvError, FloatingPointError):
    """Training met a NaN or infinite loss or gradient with ``on_nan=stop``; the last good checkpoint
    is named. Also a ``FloatingPointError``, as it was before ``QkvError`` existed."""


class CheckpointError(QkvError):
    """A checkpoint is missing, incomplete, corrupted or from an unknown format (``qkv.io.checkpoint``),
    or its weights do not fit its config (``qkv.io.weights``)."""


class DataError(QkvError):
    """A corpus cannot be read or used; the message names the file, line or setting at fault."""
