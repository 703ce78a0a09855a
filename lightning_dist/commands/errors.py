"""The error a ``lightning-dist`` tool raises for bad input."""

from __future__ import annotations


class CommandError(Exception):
    """Bad input to a tool (a missing file, a class path that does not import, malformed JSON): the console script
    prints ``lightning-dist <tool>: error: <message>`` and exits with status 2, without a traceback."""
