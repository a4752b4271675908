"""Errors of the run's environment that the command line reports as one line, without a traceback.

User mistakes are ``ValueError``/``FileNotFoundError`` (see cli.py). A fault of the machine or of
another process -- a checkpoint that could not be written, an output directory another run holds --
is a ``RunError``: the message already says what happened, where, and what to do, and the process
exits non-zero.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A fault outside the user's config, described completely by its one-line message."""
