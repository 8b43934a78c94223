"""What kind of divergence a first-divergence result is, in one word: for a CI gate (--fail-on),
the JSON key "kind" and every report's headline.

    none            no row differs
    batch-variance  rows differ, and the noise-aware verdict names no introduced error
    state-bug       the noise-aware verdict names a call or a gap (code not dumped)
    not-judged      rows differ and no noise-aware verdict was made (--strict-only)
"""

from __future__ import annotations

from typing import List, Optional, Tuple

NONE, BATCH_VARIANCE, STATE_BUG, NOT_JUDGED = "none", "batch-variance", "state-bug", "not-judged"
# Worst last. A rank not judged may hold a state bug, so it outranks batch-variance: a result
# is never called float noise on the strength of a rank nobody looked at.
SEVERITY = (NONE, BATCH_VARIANCE, NOT_JUDGED, STATE_BUG)


def rank_kind(verdict: dict) -> str:
    if not verdict["rows_differing"]:
        return NONE
    if verdict.get("noise") is None:
        return NOT_JUDGED
    return STATE_BUG if verdict["noise"]["culprits"] else BATCH_VARIANCE


def worst_kind(ranks: dict) -> str:
    """The kind of a result: the worst over its ranks."""
    return max((rank_kind(v) for v in ranks.values()), key=SEVERITY.index, default=NONE)


def kind_of(result: dict) -> str:
    """The result's kind as analyzer.diverge stored it (computed for a result made before it did)."""
    return result.get("kind") or worst_kind(result["ranks"])


def state_bug_place(culprit: dict) -> Tuple[str, str]:
    """(word, name) where a noise-aware culprit is: "at" a call, "in" the call holding a gap, or
    "before" the call whose input shows a gap no dumped call holds."""
    if not culprit.get("gap_before"):
        return "at", culprit["call"]
    return ("before" if culprit["gap_before"] == culprit["call"] else "in"), culprit["call"]


def kind_parts(kind: str, culprit: Optional[dict] = None) -> List[Tuple[str, bool]]:
    """The kind in words, as (text, is_name) pieces for a headline: "batch-variance", "state bug
    at X" (``culprit``: the noise-aware culprit to name; without one, "state bug"), "state bug not
    judged"; nothing for none."""
    if kind == STATE_BUG:
        if culprit is None:
            return [("state bug", False)]
        word, name = state_bug_place(culprit)
        return [(f"state bug {word} ", False), (name, True)]
    return {BATCH_VARIANCE: [("batch-variance", False)], NOT_JUDGED: [("state bug not judged", False)]}.get(kind, [])
