"""Writing a user's output files without ever destroying one they did not ask to replace.

Every command that writes a file the user names (``translate -o``, ``evaluate --save``, ``score -o``,
``align -o``, ``attend``'s pictures and ``--json``, traces) goes through ``output_file``: an existing
file is refused unless the user passed ``--force``, and even then unless qkv wrote it (``output_file``
marks what it writes with an extended attribute, ``MARK``, and replaces only a file that bears it); a
file that is also an input (named, or the standard input), a device, a pipe or a socket, or one that lies
inside a checkpoint or run the command reads, is always refused (``check_output``); and the new content goes
to an unnamed temporary file in the same directory (Linux's ``O_TMPFILE``; elsewhere a hidden
``.NAME.*.tmp``) that is given the target's name only once it is complete. So a crash, a kill or a
full disk leaves the previous file as it was and no temporary file behind, and a symlink at the
target is replaced, never followed. Files qkv owns and rewrites (a resumed run's tokenizer, a
distillation's parts) are written the same way by ``replace_whole``. Commands that write a
checkpoint directory (``average``, ``import``) check it with ``check_checkpoint_out``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from qkv.errors import QkvError

Source = str | Path | None
MARK = "user.qkv.output"  # the extended attribute that tells qkv's outputs from the user's files: "size:mtime_ns"
_XATTRS = hasattr(os, "setxattr")  # Linux; elsewhere nothing is marked, so --force replaces nothing
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000  # Linux's linkat(2) constants


def _inside(path: Path, directory: Path) -> bool:
    """True when ``path`` is ``directory`` or lies inside it (symlinks resolved)."""
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def read_dirs(checkpoints: Iterable[Source]) -> list[Path]:
    """What a command that reads ``checkpoints`` must not write into: each resolved checkpoint
    directory and, where a run directory was given, every path qkv writes there (log, tokenizer,
    checkpoints, ...: ``runs.run_entries``). A checkpoint that does not resolve is left to the loading that follows."""
    from qkv.io import checkpoint
    from qkv.io import runs

    protected: list[Path] = []
    for given in checkpoints:
        if given is None:
            continue
        try:
            resolved = checkpoint.resolve(given)
        except checkpoint.CheckpointError:
            continue
        protected.append(resolved)
        given = Path(given)
        if given.is_dir() and given.resolve() != resolved.resolve():  # a run directory
            protected += runs.run_entries(given)
    return protected


def check_output(
    path: str | Path, *, force: bool, inputs: tuple[Source, ...] = (), reads: Iterable[Path] = (), provenance: bool = True
) -> Path:
    """Refuse to write ``path`` when it is one of ``inputs`` (files) or the standard input, not a regular
    file, lies inside one of ``reads`` (``read_dirs``: the checkpoints and runs the command reads), exists
    and ``force`` is False, or (with ``provenance``) exists and qkv did not write it. A command that learns
    more of its inputs later checks early with ``provenance`` False and again with it once it knows them
    all, so that a file it reads is named as its input."""
    path = Path(path)
    for source in inputs:
        if source is not None and path.exists() and Path(source).exists() and os.path.samefile(path, source):
            raise QkvError(f"{path} is also the input: write the output to another file")
    if path.exists() and _is_stdin(path):
        raise QkvError(f"{path} is also the standard input: write the output to another file")
    if not _replaceable(path):
        raise QkvError(f"{path} is not a regular file (a device, a pipe or a socket): qkv writes its outputs whole "
                       "and renames them into place, so it replaces only regular files; leave out the output file to "
                       "write to the standard output")
    for directory in reads:
        if _inside(path, directory):
            raise QkvError(f"{path} is inside {directory}, which this command reads: write the output elsewhere")
    if path.is_dir():
        raise QkvError(f"{path} is a directory; give a file name")
    if path.exists() and not force:
        raise QkvError(f"{path} exists; pass --force to overwrite it")
    if provenance and path.is_symlink():
        raise QkvError(f"{path} is a symbolic link: --force replaces only a regular file that qkv wrote; remove the link "
                       "yourself or write to a new name")
    if provenance and path.exists() and not written_by_qkv(path):
        raise QkvError(f"{path} was not written by qkv (it bears no mark of a qkv output: made by hand or by another "
                       "program, changed since, or on a system or file system where qkv cannot mark files): refusing to replace "
                       "it even with --force; remove it yourself or write to a new name")
    return path


def written_by_qkv(path: Path) -> bool:
    """Whether ``path`` (not followed, if a link) is a regular file that ``output_file`` wrote and nothing
    changed since: it bears ``MARK``, an extended attribute set on the new file before it took its name,
    holding the size and modification time the file had then. A file written by anything else, or copied
    without its attributes, bears none; one edited since, in place or as a new file, has another size or
    time."""
    if not _XATTRS or path.is_symlink() or not path.is_file():
        return False
    try:
        return os.getxattr(path, MARK, follow_symlinks=False) == _stamp(os.stat(path, follow_symlinks=False))
    except OSError:  # no such attribute, or a file system without them
        return False


def _stamp(status: os.stat_result) -> bytes:
    """What ``MARK`` holds: the file's size and modification time (nanoseconds) when qkv finished it."""
    return f"{status.st_size}:{status.st_mtime_ns}".encode()


def _mark(fd: int) -> None:
    """Mark the finished file ``fd`` as qkv's output (nothing where the system keeps no extended attributes)."""
    if _XATTRS:
        with contextlib.suppress(OSError):
            os.setxattr(fd, MARK, _stamp(os.fstat(fd)))  # setting an attribute changes no size nor mtime


def _is_stdin(path: Path) -> bool:
    """True when the standard input is ``path`` itself (``cmd -o F < F``), which replacing would destroy."""
    try:
        return os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):  # no standard input, or one without a descriptor
        return False


def _replaceable(path: Path) -> bool:
    """Whether renaming a new file onto ``path`` replaces only a file: nothing there, a regular file, or a
    symlink (replaced, never followed) to a regular file or to nothing. Never a device, a pipe or a socket,
    nor a symlink to one (``-o /dev/stdout`` would replace the system's link)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True
    if stat.S_ISLNK(mode):
        try:
            mode = os.stat(path).st_mode
        except OSError:  # a dangling or looping link: only the link is replaced
            return True
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)  # a directory is refused apart, with its own message


@contextmanager
def output_file(
    path: str | Path, *, force: bool, inputs: tuple[Source, ...] = (), reads: Iterable[Path] = (), binary: bool = False,
    provenance: bool = True,
) -> Iterator[IO]:
    """A file to write into that becomes ``path`` when the block ends without an error (text, or
    bytes with ``binary``); until then ``path`` is untouched and no other name exists. The file bears
    ``MARK``. ``check_output`` first (``provenance`` False: a library function told where to write, as
    ``open`` is; the commands check their outputs before)."""
    path = check_output(path, force=force, inputs=inputs, reads=reads, provenance=provenance)
    before = _identity(path)
    with _replacing(path, binary=binary, mark=True, expect=before if provenance else _ANY) as handle:
        yield handle


_ANY = object()  # _replacing's expect: replace whatever is there


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names (not followed), or None when nothing is there."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def replace_whole(path: str | Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or is as it was: ``output_file``'s way of writing, without its
    checks, for a file qkv itself owns and rewrites (a run's tokenizer, a distillation's settings)."""
    with _replacing(Path(path), binary=True) as handle:
        handle.write(data)


@contextmanager
def _replacing(path: Path, *, binary: bool, mark: bool = False, expect: object = _ANY) -> Iterator[IO]:
    """A new unnamed file beside ``path`` that is renamed onto it when the block ends without an error;
    with ``mark``, bearing ``MARK`` (where the file system keeps extended attributes). ``expect``: what
    ``path`` was when the output was checked (``_identity``): None, and the new file takes the name only
    if it is still free (a link, which never replaces); a file, and it is replaced only if it is still
    that file and still qkv's. Something else there by then (a long translation gives time) is an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, named = _open_unnamed(path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            if mark:
                _mark(handle.fileno())
            os.fsync(handle.fileno())
            if named is None:
                named = _link(handle.fileno(), path)
        if expect is _ANY:
            os.replace(named, path)
        elif expect is None:
            try:
                os.link(named, path)  # fails if anything took the name meanwhile
            except FileExistsError:
                raise QkvError(f"{path} appeared while qkv was writing it: kept as it is, nothing written") from None
            os.unlink(named)
        else:
            if _identity(path) != expect or not written_by_qkv(path):
                raise QkvError(f"{path} changed while qkv was writing it: kept as it is, nothing written")
            os.replace(named, path)
    except BaseException:
        if named is not None:
            Path(named).unlink(missing_ok=True)
        raise


def _open_unnamed(directory: Path) -> tuple[int, str | None]:
    """A new file in ``directory``: unnamed (O_TMPFILE, None) where the system allows, else a hidden
    temporary name. Either gets the usual mode for a new file (umask applied)."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o666), None
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    fd, name = tempfile.mkstemp(prefix=".qkv-", suffix=".tmp", dir=directory)
    os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes it 0600; a normal file gets the usual mode
    return fd, name


def _link(fd: int, path: Path) -> str:
    """Give the unnamed file ``fd`` a hidden name beside ``path`` (then renamed onto ``path``): the
    only moment a temporary name exists is between this link and that rename. Where the system lets
    neither way of linking an unnamed file work, its bytes are copied to a new hidden file."""
    for _ in range(100):
        name = str(path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp"))
        if os.path.lexists(name):
            continue
        if _linkat_empty_path(fd, name):
            return name
        try:
            os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
            return name
        except FileExistsError:
            continue
        except OSError:
            return _copy_out(fd, path)
    raise OSError(errno.EEXIST, f"cannot find a free temporary name beside {path}")


def _linkat_empty_path(fd: int, name: str) -> bool:
    """linkat(fd, "", name, AT_EMPTY_PATH): Linux, for a process allowed to (root, say)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(name), _AT_EMPTY_PATH) == 0
    except (OSError, AttributeError):
        return False


def _copy_out(fd: int, path: Path) -> str:
    """The unnamed file's bytes in a new hidden file beside ``path``; its name."""
    out, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(out, 0o666 & ~current_umask())  # mkstemp makes it 0600; a normal file gets the usual mode
        os.lseek(fd, 0, os.SEEK_SET)
        while block := os.read(fd, 1 << 20):
            os.write(out, block)
        if _XATTRS:
            with contextlib.suppress(OSError):  # the mark of qkv's output, where the unnamed file bears it
                os.getxattr(fd, MARK)
                _mark(out)  # its own size and time
        os.fsync(out)
    except BaseException:
        os.unlink(name)
        raise
    finally:
        os.close(out)
    return name


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_apart(out: str | Path, reads: Iterable[Path], *, flag: str = "--out", replaced: bool = True) -> Path:
    """Refuse an output directory ``out`` that is or lies inside one of ``reads`` (writing there would
    change what the command reads), or, when the command may replace ``out`` (``replaced``), holds one."""
    out = Path(out)
    for directory in reads:
        if _inside(out, directory) or (replaced and _inside(directory, out)):
            raise QkvError(f"{flag} {out} overlaps {directory}, which this command reads: write the output elsewhere")
    return out


def check_checkpoint_out(out: str | Path, *, force: bool, reads: Iterable[Path] = ()) -> Path:
    """Refuse ``out`` for a new checkpoint (before any work) unless it is new, or ``force`` is given and
    it is a qkv checkpoint: the rule of ``average --out`` and ``import marian --out``. It may not be,
    hold or lie inside one of ``reads`` (the checkpoints the command reads), even with ``force``."""
    from qkv.io.checkpoint import is_checkpoint_dir

    out = check_apart(out, reads)
    if out.exists() or out.is_symlink():
        if not force:
            raise QkvError(f"{out} exists; pass --force to replace it (only if it is a qkv checkpoint)")
        if not is_checkpoint_dir(out):
            raise QkvError(f"{out} is not a qkv checkpoint (it holds other files): refusing to replace it even with --force")
    return out


def output_or_stdout(
    path: str | Path | None, *, force: bool, inputs: tuple[Source, ...] = (), reads: Iterable[Path] = ()
):
    """``output_file(path)`` when the user named a file, else standard output (left open)."""
    if path is None:
        return contextlib.nullcontext(sys.stdout)
    return output_file(path, force=force, inputs=inputs, reads=reads)
