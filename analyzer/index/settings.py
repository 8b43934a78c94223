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


# Worker processes that index small passes (decode steps: per-tensor Python work, little reading)
# and hash large ones in pieces, when a build has work enough for them (workers.py: they
# never import the caller's main module, so a library caller gets them too). None: as
# index_processes() says; a number overrides it (tests).
INDEX_PROCESSES: Optional[int] = None


def index_processes() -> int:
    """How many worker processes an index build may start: DUMPDIFF_INDEX_PROCESSES (0 turns them
    off), else the CPU count less one, at most 8. Raises DumpError for a bad setting."""
    if INDEX_PROCESSES is not None:
        return INDEX_PROCESSES
    setting = env_count("DUMPDIFF_INDEX_PROCESSES")
    return setting if setting is not None else min(max((os.cpu_count() or 1) - 1, 0), 8)


def hash_threads() -> int:
    """Tensors hashed at once by an index build: DUMPDIFF_HASH_THREADS, else the CPU count, at most
    8. Read when a build starts (not at import), so a setting made later is seen."""
    return max(1, env_count("DUMPDIFF_HASH_THREADS") or min(os.cpu_count() or 1, 8))
