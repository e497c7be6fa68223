"""Files read from outside the process, opened as what they are, once.

A name the package reads (a model's ``config.json``, a recipe, a tokenizer file, a checkpoint's ``meta.json`` and
``*.pt``) may name something other than a file: a FIFO (opening it waits for a writer that may never come), a
device (``/dev/zero`` never ends, ``/dev/tty`` waits for a key), a socket, a directory, or a link to one of these;
or a link that dangles or loops. ``open_regular_file`` is the way in: it refuses each by name before anything is
opened (``is a FIFO, not a file``; ``links to /dev/zero, a character device, not a file``; ``a link to X, which
does not exist``), opens the file non-blocking (one swapped for a FIFO meanwhile cannot hang the open) and checks
the descriptor it got (``fstat``), so what is read is what was checked, and its size is known before a byte is
read. "file not found" is said only when nothing is there.

Links a user named are followed. A file found by scanning a directory of our own (a checkpoint's ``*.pt``, the
files of a snapshot in the Hugging Face cache, a checkpoint's stored results) is read only when it resolves inside
that directory (``within``): a link out of it is refused, never read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from astrai_fabric.errors import UserError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
"""Non-blocking: opening a FIFO (one put in place between the look and the open) returns at once instead of
waiting for a writer; it changes nothing for a regular file. No controlling terminal from a tty."""


@dataclass(frozen=True)
class OpenedFile:
    """A regular file open for reading: ``file`` (binary, at its start) and ``size_bytes``, its size when opened
    (``fstat`` of this descriptor); ``path`` as the caller named it."""

    path: Path
    file: BinaryIO
    size_bytes: int

    def read(self) -> bytes:
        """The file's bytes, at most ``size_bytes``: what it held when opened (one growing meanwhile is cut there)."""
        return self.file.read(self.size_bytes)

    @property
    def reopenable_path(self) -> str:
        """A name that opens this very file again, for readers that take only a name (``torch.load(mmap=True)``):
        the descriptor's ``/proc/self/fd/N`` where the system has one, so the file read is the one checked; else
        ``path``."""
        by_descriptor = f"/proc/self/fd/{self.file.fileno()}"
        return by_descriptor if os.path.exists(by_descriptor) else str(self.path)


@contextmanager
def open_regular_file(
    path: str | Path,
    *,
    within: str | Path | Sequence[str | Path] | None = None,
    within_name: str | None = None,
    expected: str | None = None,
    error: type[UserError] = UserError,
    name: str | None = None,
) -> Iterator[OpenedFile]:
    """``path`` open for reading, or an ``error`` saying what it is instead (see the module's docstring).

    ``within``: the directory (or directories) of our own ``path`` was found in by a scan; ``path`` must resolve
    inside one of them (``within_name`` says which in the message; default: the first). ``expected`` is added to a
    refusal (``(expected a model config.json)``); ``name`` is what the message calls the file (default: ``path``).
    """
    path = Path(path)
    label = name or str(path)
    suffix = f" (expected {expected})" if expected else ""
    target = _checked_target(path, label, suffix, within, within_name, error)
    try:
        fd = os.open(target, READ_FLAGS | (getattr(os, "O_NOFOLLOW", 0) if within is not None else 0))
    except OSError as err:
        raise error(f"{label}: cannot read it ({err.strerror or err}){suffix}") from None
    try:
        size_bytes = regular_file_size(fd, path, error, name=label, expected=expected)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield OpenedFile(path, file, size_bytes)


def regular_file_size(
    fd: int, path: Path, error: type[UserError] = UserError, name: str | None = None, expected: str | None = None
) -> int:
    """The size of the file open as ``fd`` (``fstat``), refused unless it is a regular file: what was opened, even
    where ``path`` named something else a moment before (a FIFO put in place between the look and the open)."""
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        raise error(
            _not_a_file(path, name or str(path), status.st_mode) + (f" (expected {expected})" if expected else "")
        )
    return status.st_size


def read_regular_file(
    path: str | Path,
    *,
    max_bytes: int,
    what: str,
    within: str | Path | Sequence[str | Path] | None = None,
    error: type[UserError] = UserError,
) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular_file``), refused before a byte is read when it holds
    more than ``max_bytes``; ``what`` says what it should hold."""
    with open_regular_file(path, within=within, expected=what, error=error) as opened:
        if opened.size_bytes > max_bytes:
            raise error(f"{path}: {opened.size_bytes} bytes, too large for {what} (at most {_amount(max_bytes)})")
        try:
            return opened.read()
        except OSError as err:
            raise error(f"{path}: cannot read it ({err.strerror or err})") from None


def check_regular_file(
    path: str | Path,
    *,
    within: str | Path | Sequence[str | Path] | None = None,
    within_name: str | None = None,
    error: type[UserError] = UserError,
) -> int:
    """Refuse ``path`` unless it is a regular file (inside ``within``) as ``open_regular_file`` would; its size.
    For a caller that only needs to know, or whose reader opens files by name later (a safetensors shard)."""
    with open_regular_file(path, within=within, within_name=within_name, error=error) as opened:
        return opened.size_bytes


def file_kind(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file's is: ``a FIFO``, ``a character device``, ..."""
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "a special file")


def _checked_target(
    path: Path,
    label: str,
    suffix: str,
    within: str | Path | Sequence[str | Path] | None,
    within_name: str | None,
    error: type[UserError],
) -> Path:
    """What to open for ``path``: refused by ``stat`` (following links) unless a regular file; with ``within``, its
    resolved name, refused unless inside one of those directories."""
    try:
        status = os.stat(path)
    except OSError as err:
        raise error(f"{label}: {_unreachable(path, err)}{suffix}") from None
    if not stat.S_ISREG(status.st_mode):
        raise error(_not_a_file(path, label, status.st_mode) + suffix)
    if within is None:
        return path
    roots = [Path(within)] if isinstance(within, str | os.PathLike) else [Path(root) for root in within]
    real = Path(os.path.realpath(path))
    if not any(Path(os.path.realpath(root)) in real.parents for root in roots):
        raise error(
            f"{label}: links to {real}, outside {within_name or roots[0]}; its files are read only from inside it: "
            "copy the file in instead of linking it"
        )
    return real  # opened without following a link: one put there since is refused, not followed


def _not_a_file(path: Path, label: str, mode: int) -> str:
    if os.path.islink(path):
        return f"{label}: links to {os.path.realpath(path)}, {file_kind(mode)}, not a file"
    return f"{label}: is {file_kind(mode)}, not a file"


def _unreachable(path: Path, err: OSError) -> str:
    """Why ``stat`` found no file at ``path``: nothing there, a link to nothing, a loop, a file as a directory."""
    if err.errno == errno.ENOENT:
        if os.path.islink(path):
            return f"a link to {os.readlink(path)}, which does not exist"
        return "file not found"
    if err.errno == errno.ELOOP:
        return f"a link that cannot be followed ({err.strerror})"
    if err.errno == errno.ENOTDIR:
        blocker = next((p for p in reversed(path.parents) if os.path.exists(p) and not os.path.isdir(p)), None)
        return f"file not found ({blocker} is a file, not a directory)" if blocker else "file not found"
    return f"cannot read it ({err.strerror or err})"


def _amount(num_bytes: int) -> str:
    if num_bytes % (1 << 30) == 0:
        return f"{num_bytes >> 30} GiB"
    return f"{num_bytes >> 20} MiB" if num_bytes % (1 << 20) == 0 else f"{num_bytes:,} bytes"
