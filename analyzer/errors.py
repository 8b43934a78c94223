"""The one error type users see: a single line saying what is wrong and what to do (exit 2)."""

import os


class DumpError(Exception):
    """Bad input or an unprovable comparison; ``str(err)`` is the whole message for the user."""


def show(path: str) -> str:
    """A path printable on any terminal, even with undecodable bytes in it."""
    return os.fsdecode(path).encode("utf-8", "backslashreplace").decode("utf-8")
