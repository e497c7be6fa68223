"""The Hugging Face cache read as what it claims to hold, before huggingface_hub or a run reads a name from it.

huggingface_hub resolves a branch or tag by reading ``refs/REVISION`` and joining what it holds onto
``snapshots/``: a ref holding ``../../../../elsewhere`` or an absolute path makes any folder on the machine a
"snapshot", loaded as the model and recorded unpinned. Here every name resolved in the cache stays inside it and is
what it says it is:

- a revision (``org/name@REVISION``, ``download --revision``) is a commit (40 hex characters) or a branch or tag
  name (``main``, ``v1.0``, ``refs/pr/1``): git's spelling, never ``..``, a leading ``/`` or a NUL
  (``is_revision_name``);
- the repository's folder (``models--org--name``) is a folder of the cache (``repository_folder``);
- a ref is a regular file of ``refs/`` holding exactly 40 hex characters (``read_ref``), never read as a path;
- a snapshot (``snapshots/COMMIT``) is a real folder of the repository's folder, and every file and folder in it
  resolves inside the repository's folder (``checked_snapshot``): huggingface_hub links each file to
  ``../../blobs/HASH``, which is normal; a link to ``/etc/passwd``, to another repository's blobs, or anywhere else
  out of it is refused.

Anything else is one line naming the cache path and what was expected. A ref naming a commit whose snapshot is not
there (an interrupted download leaves one) is "not cached": fetched again online, said in the one line offline.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from astrai_fabric.errors import UserError

COMMIT = re.compile(r"[0-9a-f]{40}")
"""A commit as the Hub names it and huggingface_hub's ``snapshots/`` folders are named: 40 lowercase hex digits."""
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
"""A branch, tag (``v1.0``, ``refs/pr/1``) or commit in the characters the Hub allows."""
REF_BYTES_SHOWN = 48
"""How much of a ref that is not a commit is read and shown (a commit is 40 bytes): never a whole file."""
_FIX = "remove the repository's folder from the cache and download it again"


def is_revision_name(text: object) -> bool:
    """``text`` is a commit or a branch or tag name that names a file of ``refs/`` (``main``, ``v1.0``,
    ``refs/pr/1``): the Hub's characters, and no part that is empty, ``.``/``..`` or hidden (``a//b``, ``a/../b``,
    ``a/.x``), no trailing ``/`` or ``.``, no ``.lock`` (git's own rules for a ref name)."""
    if not isinstance(text, str) or not _REVISION.fullmatch(text):
        return False
    return not any(part == "" or part.startswith(".") or part.endswith((".", ".lock")) for part in text.split("/"))


def check_revision(revision: str, where: str) -> None:
    """``revision`` as ``is_revision_name`` says, or one line naming it (``where`` is the flag or command)."""
    if not is_revision_name(revision):
        raise UserError(
            f"{where}: revision {_shown(revision)} is not a branch, tag or commit name (expected letters, digits, "
            "'-', '_', '.' and '/' between names, as in main, v1.0, refs/pr/1 or a 40-hex commit; never '..', a "
            "leading '/' or a hidden part)"
        )


def repository_folder(cache: Path, repo_id: str, repo_type: str, where: str) -> Path:
    """``cache/{models|datasets}--org--name``, where huggingface_hub keeps ``repo_id``; refused when it is a link
    out of the cache (it need not exist)."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    if os.path.lexists(folder) and not _inside(os.path.realpath(folder), os.path.realpath(cache)):
        raise UserError(
            f"{where}: the Hub cache's folder {folder} leads to {os.path.realpath(folder)}, outside the cache "
            f"{cache} (expected a folder of the cache); {_FIX}"
        )
    return folder


def read_ref(folder: Path, revision: str, where: str) -> str | None:
    """The commit ``folder/refs/REVISION`` holds (``revision`` a branch or tag name, ``is_revision_name``), or None
    when there is no such ref (not cached). Refused: a ref that is not a regular file of ``refs/`` (a link, a FIFO,
    a folder), or one holding anything but exactly 40 hex characters."""
    ref = folder / "refs" / revision
    expected = f"expected 40 hex characters naming a folder of {folder / 'snapshots'}"
    try:
        kind = os.lstat(ref).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise UserError(f"{where}: the Hub cache's ref {ref} cannot be read ({err.strerror}); {expected}") from None
    if not stat.S_ISREG(kind):
        raise UserError(f"{where}: the Hub cache's ref {ref} is {_kind(ref, kind)}, not a file ({expected}); {_FIX}")
    if not _inside(target := os.path.realpath(ref), os.path.realpath(folder / "refs")):
        raise UserError(
            f"{where}: the Hub cache's ref {ref} leads to {target}, outside {folder / 'refs'} ({expected}); {_FIX}"
        )
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:  # non-blocking, no link followed: one swapped for a FIFO or a link since the look cannot hang or lead out
        descriptor = os.open(ref, flags)
    except OSError as err:
        raise UserError(f"{where}: the Hub cache's ref {ref} cannot be read ({err.strerror}); {expected}") from None
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise UserError(f"{where}: the Hub cache's ref {ref} is not a file ({expected}); {_FIX}")
        held = file.read(REF_BYTES_SHOWN + 1)
    text = held.decode("latin-1")
    if not COMMIT.fullmatch(text):
        raise UserError(f"{where}: the Hub cache's ref {ref} holds {_shown(text)}, not a commit ({expected}); {_FIX}")
    return text


def checked_snapshot(folder: Path, commit: str, where: str) -> Path | None:
    """``folder/snapshots/COMMIT`` (``commit`` 40 hex characters), or None when it is not there (not cached).
    Refused: a snapshot that is a link or no folder, or that holds anything resolving outside ``folder`` (its files
    link into ``folder/blobs/``)."""
    if not COMMIT.fullmatch(commit):
        raise UserError(f"{where}: {_shown(commit)} is not a commit (expected 40 hex characters); {_FIX}")
    snapshot = folder / "snapshots" / commit
    try:
        kind = os.lstat(snapshot).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    root = os.path.realpath(folder)
    if not stat.S_ISDIR(kind) or not _inside(os.path.realpath(snapshot), root):
        raise UserError(
            f"{where}: the Hub cache's snapshot {snapshot} is {_kind(snapshot, kind)} (expected a folder of "
            f"{folder / 'snapshots'}); {_FIX}"
        )
    for parent, folders, files in os.walk(snapshot):  # links are listed, not followed: each one is checked
        for name in (*folders, *files):
            path = os.path.join(parent, name)
            if not _inside(target := os.path.realpath(path), root):
                raise UserError(
                    f"{where}: the Hub cache's snapshot file {path} links to {target}, outside the repository's "
                    f"folder {folder} (expected a link into {folder / 'blobs'}); {_FIX}"
                )
    return snapshot


def check_in_snapshot(path: Path, folder: Path, where: str) -> None:
    """One file huggingface_hub just returned from the snapshot of the repository in ``folder``: it must resolve
    inside ``folder`` (a file already there is returned as it is, without a look at where it leads)."""
    if not _inside(target := os.path.realpath(path), os.path.realpath(folder)):
        raise UserError(
            f"{where}: the Hub cache's snapshot file {path} links to {target}, outside the repository's folder "
            f"{folder} (expected a link into {folder / 'blobs'}); {_FIX}"
        )


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _kind(path: Path, mode: int) -> str:
    if stat.S_ISLNK(mode):
        return f"a link to {os.path.realpath(path)}"
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def _shown(text: str) -> str:
    """``text`` quoted for one line, cut at ``REF_BYTES_SHOWN`` characters."""
    return repr(text[:REF_BYTES_SHOWN]) + ("..." if len(text) > REF_BYTES_SHOWN else "")
