"""The one error type users see: a single line saying what is wrong and what to do (exit 2)."""

import os


class DumpError(Exception):
    """Bad input or an unprovable comparison; ``str(err)`` is the whole message for the user."""


def show(path: str) -> str:
    """A path printable on any terminal, even with undecodable bytes in it."""
    return os.fsdecode(path).encode("utf-8", "backslashreplace").decode("utf-8")


def require_torch(command: str) -> None:
    """Analysing dumps needs no torch; the commands that write or read torch files do. Without it,
    one line saying so (DumpError), not an ImportError deep inside."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise DumpError(
            f"dumpdiff {command} needs torch, which is not installed here; install it "
            "(pip install torch: the CPU build is enough) or run it where the engine runs"
        ) from None
