"""What a verdict says when a dump holds row fingerprints only (DUMPER_NON_INTRUSIVE_MODE=fingerprint).

The strict verdict needs nothing but fingerprints: alignment proof, culprit, rows and victims
are those of a full dump of the same run. Every figure made from values needs the tensors:
the culprit's error figures, the noise-aware verdict (state bug or batch-variance) and MoE
routing flips. They are not guessed; the verdict says they are missing and how to get them.
"""

from __future__ import annotations

from typing import List

from ..index.printkind import fingerprint_only

FOCUS_HINT = "'dumpdiff focus REF TEST' prints the DUMPER_* settings of a second run that dumps the tensors around it"


def missing_figures(labels: List[str]) -> str:
    return (
        f"{' and '.join(labels)} {'is a fingerprint dump' if len(labels) == 1 else 'are fingerprint dumps'} "
        "(no tensor bytes): no error figures, no noise-aware verdict (state bug or batch-variance), no routing "
        f"flips; {FOCUS_HINT}"
    )


def blind_figures(a, b):
    """The culprit's error figures when either index is of a fingerprint dump, else None."""
    labels = fingerprint_only(a.dump, b.dump)
    if not labels:
        return None
    return {"max_abs": None, "max_ulp": None, "rel": None, "dtype": None, "error_note": missing_figures(labels)}


def blind_summary(verdict: dict, labels: List[str]) -> str:
    culprit = verdict.get("culprit")
    first = (
        f"The first bit flips at {culprit['call']} ({culprit['cls']}): inputs identical, output not. "
        if culprit
        else ""
    )
    return first + "Whether it is float noise or a state bug is not judged: " + missing_figures(labels) + "."
