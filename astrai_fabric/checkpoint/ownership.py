"""Who may write into a ``ckpt_dir``: a directory this process can write (``check_writable``), one run at a time
(an advisory lock), and only over files a run wrote (a manifest). Self-contained: it knows nothing of training;
rank 0 of a run calls it and tells the other ranks (``train/outputs.py``). Two hidden files in ``ckpt_dir``::

    .astrai_fabric.lock   exists while a run writes here: flock(2)-locked by it, recording its host, pid and
                          start time; removed on release. One found unlocked was left by a run that was killed
                          (flock locks end with their process): it is taken over, with a warning
    .astrai_fabric.json   {"written_by": "astrai-fabric", "names": [...]}: the top-level names runs write here
                          (recipe.yaml, plot.png, logs); anything else by those names belongs to someone else

Checkpoint directories (``epoch_E_step_S``) are not listed: ``train.common.refuse_to_overwrite`` guards them
(``directory.py`` finds and prunes them).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path

from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.json_files import MAX_JSON_BYTES
from astrai_fabric.regular_files import open_regular_file, read_regular_file

LOCK_FILE = ".astrai_fabric.lock"
MANIFEST_FILE = ".astrai_fabric.json"
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN)  # flock's answer when another open file holds the lock


def check_writable(ckpt_dir: str | Path) -> None:
    """``ckpt_dir`` is a directory this process may write into, or can be created as one (checked when the run's
    inputs are read, not at the first save). Reads only."""
    path = Path(ckpt_dir)
    try:
        existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    except OSError as err:  # e.g. a name longer than the filesystem allows
        raise CheckpointError(_unwritable(path, err)) from None
    if not existing.is_dir():
        raise CheckpointError(f"ckpt_dir {path}: {existing} is a file, not a directory; choose another --ckpt_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"ckpt_dir {path}: {existing} is not writable here; choose another --ckpt_dir")


def _unwritable(root: Path, err: OSError) -> str:
    return f"ckpt_dir {root}: cannot be created or written ({err.strerror or err})"


# --- the lock ----------------------------------------------------------------------------------------------------


class DirLock:
    """The lock on one ``ckpt_dir``, held until ``release()`` (or the end of this process). ``locked`` is False
    where the filesystem cannot lock (the run goes on unprotected, with a warning)."""

    def __init__(self, path: Path, fd: int | None, created: list[Path]) -> None:
        self.path = path
        self._fd = fd
        self._created = created

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and unlock (in that order: whoever locks the removed file sees that it is gone and
        tries again). Directories the lock created are removed too while empty (a run refused at its start leaves
        nothing behind)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if _same_file(fd, self.path):
                    self.path.unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)  # also where forked children (data loader workers) share the file
            except OSError:
                pass
            finally:
                os.close(fd)
        for directory in self._created:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break
        self._created = []

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_ckpt_dir(ckpt_dir: str | Path) -> DirLock:
    """Create ``ckpt_dir`` if needed and lock it for this process, or raise ``CheckpointError`` naming the run that
    holds it. A lock record left by a run that died is taken over with a warning; a filesystem that cannot lock
    (ENOLCK, EOPNOTSUPP, EINVAL, ... on some NFS and Lustre mounts) gets one warning and no lock."""
    root = Path(ckpt_dir)
    path = root / LOCK_FILE
    created = [d for d in (root, *root.parents) if not os.path.lexists(d)]
    fd = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            existed = os.path.lexists(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read_holder(fd)
                os.close(fd)
                fd = None
                if err.errno in _HELD:
                    DirLock(path, None, created).release()
                    raise CheckpointError(in_use_message(root, holder)) from None
                warnings.warn(
                    f"ckpt_dir {root}: this filesystem cannot lock files ({errno.errorcode.get(err.errno, err.errno)}"
                    f": {err.strerror}); continuing without the lock that keeps a second run out of this directory",
                    stacklevel=2,
                )
                if not existed:
                    path.unlink(missing_ok=True)
                return DirLock(path, None, created)
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
            fd = None
        previous = _read_holder(fd)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
    except OSError as err:
        DirLock(path, fd, created).release()
        raise CheckpointError(_unwritable(root, err)) from None
    if previous is not None:
        gone = previous.get("host") == socket.gethostname() and not _pid_exists(previous.get("pid"))
        warnings.warn(
            f"ckpt_dir {root}: taking over the lock left by {describe_holder(previous)}, which "
            + ("no longer exists" if gone else "ended without releasing it"),
            stacklevel=2,
        )
    return DirLock(path, fd, created)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def lock_holder(ckpt_dir: str | Path) -> str | None:
    """Who holds the lock on ``ckpt_dir`` (as ``describe_holder`` says it), or None when nobody does or the
    filesystem cannot tell. For the dry run: the lock is probed for an instant (shared, never kept), nothing is
    created or written."""
    path = Path(ckpt_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return describe_holder(_read_holder(fd)) if err.errno in _HELD else None
    else:
        return None
    finally:
        os.close(fd)


def in_use_message(root: Path, holder: dict | str | None) -> str:
    described = holder if isinstance(holder, str) else describe_holder(holder)
    return f"ckpt_dir {root}: in use by another run ({described}); wait for it to end, or choose another --ckpt_dir"


def describe_holder(holder: dict | None) -> str:
    if not holder:
        return "its host and pid are not recorded yet"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"


def _read_holder(fd: int) -> dict | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError, RecursionError):  # not a record this package wrote: the holder is unknown
        return None
    return record if isinstance(record, dict) else None


def _pid_exists(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# --- the manifest ------------------------------------------------------------------------------------------------


def unowned(ckpt_dir: str | Path, names: Iterable[str], legacy: tuple[str, str] | None = None) -> list[str]:
    """Those of ``names`` that exist in ``ckpt_dir`` but are not in its manifest (so a run did not write them).

    ``legacy = (file, header)``: a ``ckpt_dir`` without a manifest whose ``file`` begins with ``header`` was
    written by a run from before the manifest existed; its files count as ours."""
    root = Path(ckpt_dir)
    names = list(names)
    owned = _manifest_names(root)
    if owned is None:
        owned = set(names) if legacy is not None and _starts_with(root / legacy[0], legacy[1]) else set()
    return [name for name in names if name not in owned and os.path.lexists(root / name)]


def check_owned(ckpt_dir: str | Path, names: Iterable[str], legacy: tuple[str, str] | None = None) -> None:
    """Raise ``CheckpointError`` naming every one of ``names`` that exists in ``ckpt_dir`` but was not written by a
    run (see ``unowned``). Reads only."""
    foreign = unowned(ckpt_dir, names, legacy)
    if foreign:
        raise CheckpointError(not_ours_message(Path(ckpt_dir), foreign))


def record_written(ckpt_dir: str | Path, names: Iterable[str]) -> None:
    """Add ``names`` to the manifest (atomically), before a run writes them."""
    root = Path(ckpt_dir)
    listed = _manifest_names(root) or set()
    if listed.issuperset(names):
        return
    manifest = {"written_by": "astrai-fabric", "names": sorted(listed.union(names))}
    staging = root / f"{MANIFEST_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(staging, "w", encoding="utf-8") as file:
            file.write(json.dumps(manifest, indent=2) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, root / MANIFEST_FILE)
    except OSError as err:
        staging.unlink(missing_ok=True)
        raise CheckpointError(_unwritable(root, err)) from None


def not_ours_message(root: Path, names: list[str]) -> str:
    those = ", ".join(names)
    return (
        f"ckpt_dir {root}: {those} {'is' if len(names) == 1 else 'are'} not written by astrai-fabric (not listed in "
        f"{MANIFEST_FILE}) and this run would overwrite {'it' if len(names) == 1 else 'them'}; move "
        f"{'it' if len(names) == 1 else 'them'} away, or choose another --ckpt_dir"
    )


def _manifest_names(root: Path) -> set[str] | None:
    """The names the manifest lists, or None when there is no manifest."""
    path = root / MANIFEST_FILE
    if not os.path.lexists(path):
        return None
    try:
        # A FIFO or a device there is refused by name (reading one would wait, or never end).
        manifest = json.loads(
            read_regular_file(path, max_bytes=MAX_JSON_BYTES, what="astrai-fabric's manifest", error=CheckpointError)
        )
        names = manifest["names"]
        if manifest.get("written_by") != "astrai-fabric" or not all(isinstance(n, str) for n in names):
            raise ValueError("not written by astrai-fabric")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        raise CheckpointError(
            f"{path}: is not astrai-fabric's manifest of the files it wrote in this ckpt_dir ({err}); choose another "
            "--ckpt_dir, or remove it if it is damaged and every other file there is yours to lose"
        ) from None
    return set(names)


def _starts_with(path: Path, header: str) -> bool:
    try:
        with open_regular_file(path) as opened:  # a FIFO there would block a plain open
            return opened.file.read(len(header.encode())) == header.encode()
    except (OSError, UserError):
        return False
