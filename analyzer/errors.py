"""The one error type users see: a single line saying what is wrong and what to do (exit 2)."""


class DumpError(Exception):
    """Bad input or an unprovable comparison; ``str(err)`` is the whole message for the user."""
