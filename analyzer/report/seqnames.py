"""Long sequence names, shortened for reading. sglang names a sequence by its request id (32 hex
characters), so a culprit's list of six decode rows ran past 400 characters. The text, markdown
and html reports show each long name by its shortest prefix (at least MIN_PREFIX characters) that
no other long name in the report starts with, and say so; JSON keeps every name whole."""

from __future__ import annotations

import copy
from typing import Iterator, Optional, Tuple

LONG_NAME = 16  # names at least this long are shortened
MIN_PREFIX = 8
MARK = ".."  # ASCII: a report may go to a terminal or a file in any encoding


def _rows(node) -> Iterator[dict]:
    """Every token-row dict ({"seq": ..., "pos": ...}) anywhere in a result."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("seq"), str) and "pos" in item:
                yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def prefix_length(long, names) -> int:
    """The shortest length >= MIN_PREFIX at which no name of ``names`` but itself starts with a
    ``long`` name's prefix."""
    n = MIN_PREFIX
    while any(sum(other.startswith(name[:n]) for other in names) > 1 for name in long):
        n += 1
    return n


def for_reading(result: dict) -> Tuple[dict, Optional[str]]:
    """(the result with its long sequence names shortened, a note saying so), or (the result
    itself, None) when no name is long enough to gain from it."""
    names = {row["seq"] for row in _rows(result)}
    long = {name for name in names if len(name) >= LONG_NAME}
    n = prefix_length(long, names) if long else 0
    shortened = {name for name in long if n + len(MARK) < len(name)}
    if not shortened:
        return result, None
    shown = copy.deepcopy(result)
    for row in _rows(shown):
        if row["seq"] in shortened:
            row["seq"] = row["seq"][:n] + MARK
    return shown, (
        f"sequence names over {LONG_NAME - 1} characters (request ids) are shown by their first {n}, "
        f"which no other name here starts with; --format json gives them whole"
    )
