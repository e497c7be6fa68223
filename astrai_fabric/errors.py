"""The one exception type for mistakes a user can fix.

Bad input (a malformed recipe, a missing or corrupt file, a mismatched checkpoint) raises ``UserError`` with one
message that names the field or file and what was expected. The CLI prints that message without a traceback and
exits non-zero; library callers can catch it like any other exception. Internal invariants use ``assert``.
"""

from __future__ import annotations

import os
import reprlib
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path


class UserError(Exception):
    """Bad user input: the message says what is wrong, where, and what was expected."""


class ConfigError(UserError, ValueError):
    """A model ``config.json`` or a recipe value is missing, of the wrong type, or out of range."""


class CheckpointError(UserError):
    """A checkpoint or model directory is missing, unreadable, unsafe, or does not match the model."""


class TrainingError(Exception):
    """A run that cannot go on through no mistake in its input: it diverged, or lost one of its ranks. The CLI
    prints the message (which says what was saved and how to continue) and exits 1."""


def raised_on_every_rank(err: Exception, local_rank: int) -> Exception:
    """Mark ``err`` as raised by every rank together (a refusal rank 0 found and sent to the others, a verdict they
    reached together): the CLI prints it from local rank 0 only, once per machine rather than once per rank, and every
    rank still exits with its status. Returns ``err``."""
    err.quiet = local_rank != 0
    return err


def keep_traceback(text: str, directory: Path | None, kind: str, header: str) -> str:
    """Append a traceback ``text`` to ``directory/KIND-HOST-PID.log`` (under a timestamped ``header``), or print
    it on stderr where there is no such directory or it cannot be written; returns where it went (the log's path,
    or None for stderr), for the one error line to name."""
    if directory is not None and Path(directory).is_dir():
        log = Path(directory) / f"{kind}-{socket.gethostname()}-{os.getpid()}.log"
        try:
            with log.open("a") as file:  # appended, never overwritten
                file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {header}\n{text}")
            return str(log)
        except OSError:
            pass
    print(text, file=sys.stderr, end="")
    return None


def brief(value: object, chars: int = 60) -> str:
    """``value`` as a message shows it: its repr cut to about ``chars``, made from its first four items of its first
    two levels only (``reprlib``), so a value of gigabytes, or one that YAML aliases expand without end, costs no
    more to show than a small one. A message never formats a whole value read from outside."""
    shower = reprlib.Repr()
    shower.maxlevel = 2
    shower.maxdict = shower.maxlist = shower.maxtuple = shower.maxset = shower.maxfrozenset = shower.maxdeque = 4
    shower.maxstring = shower.maxlong = shower.maxother = chars
    shown = shower.repr(value)
    return shown if len(shown) <= chars else shown[:chars] + "..."


def listed(names: Iterable[object], most: int = 20) -> str:
    """``'a', 'b', ...`` for a message: the first ``most`` names (each cut short, ``brief``) and how many more;
    ``none`` where there are none."""
    names = list(names)
    shown = ", ".join(brief(str(name)) for name in names[:most])
    more = f" and {len(names) - most:,} more" if len(names) > most else ""
    return shown + more if shown else "none"
