"""The analyzer's numeric environment variables, read and checked: a typo is one line, not a
traceback or a silently ignored setting."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import DumpError


def env_count(name: str) -> Optional[int]:
    """The whole number >= 0 in ``name``; None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise DumpError(f"{name}={raw!r}: give a whole number >= 0, or unset it for the default")
    return int(raw)
