"""Words and numbers as every output of dumpdiff writes them: counts with their nouns, figures,
and names made safe to print on a terminal."""

from __future__ import annotations

import functools
import re

# Verbs whose singular is not the plural + "s".
_SINGULAR_VERBS = {"have": "has", "are": "is", "were": "was", "do": "does"}


def noun(count: int, word: str) -> str:
    """``word`` (singular; of a phrase, its last word) in the number ``count`` asks for: row/rows,
    pass/passes, entry/entries."""
    if count == 1:
        return word
    if re.search(r"(s|x|z|ch|sh)$", word):
        return word + "es"
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + "ies"
    return word + "s"


def plural(count: int, word: str, verb: str = None) -> str:
    """A count with its noun, and a verb given in its plural form, in the right number:
    "1 pass", "2 passes", "1 row differs", "3 rows differ". Reports never say "1 passes"."""
    text = f"{count} {noun(count, word)}"
    return f"{text} {agree(count, verb)}" if verb else text


def agree(count: int, verb: str) -> str:
    """``verb``, given in its plural form, in the number ``count`` asks for: have/has, differ/differs."""
    return verb if count != 1 else _SINGULAR_VERBS.get(verb, verb + "s")


def fmt_num(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


# Control characters in names (a module called "esc\x1b]0;title\x07") would drive the terminal
# they are printed on, and a line break would end a one-line message or a Markdown table row in
# the middle of a name: each is written as \xNN. A report's own line breaks stay (``keep``).
CONTROL_CHARS = "".join(map(chr, [*range(0, 32), 127, *range(0x80, 0xA0)]))
CONTROL = re.compile(f"[{re.escape(CONTROL_CHARS)}]")


@functools.lru_cache(maxsize=None)
def _escapes(keep: str) -> dict:
    return {ord(c): f"\\x{ord(c):02x}" for c in CONTROL_CHARS if c not in keep}


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every control character but those in ``keep`` written as \\xNN."""
    return text.translate(_escapes(keep))


def terminal_safe(text: str) -> str:
    """A multi-line report as printable text: its tabs and line breaks stay."""
    return escape_controls(text, keep="\t\n")
