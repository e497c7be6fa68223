"""The one exception type for mistakes a user can fix.

Bad input (a malformed recipe, a missing or corrupt file, a mismatched checkpoint) raises ``UserError`` with one
message that names the field or file and what was expected. The CLI prints that message without a traceback and
exits non-zero; library callers can catch it like any other exception. Internal invariants use ``assert``.
"""


class UserError(Exception):
    """Bad user input: the message says what is wrong, where, and what was expected."""


class ConfigError(UserError, ValueError):
    """A model ``config.json`` or a recipe value is missing, of the wrong type, or out of range."""


class CheckpointError(UserError):
    """A checkpoint or model directory is missing, unreadable, unsafe, or does not match the model."""


class TrainingError(Exception):
    """A run that cannot go on through no mistake in its input: it diverged, or lost one of its ranks. The CLI
    prints the message (which says what was saved and how to continue) and exits 1."""
