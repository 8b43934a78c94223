"""Which fingerprint an index holds (analyzer/index/prints.py says why there are two), decided from
the dumps' settings alone: every command asks, and this imports nothing."""

from __future__ import annotations

from typing import List

XXH3, ROWPRINT = "xxh3", "rowprint"


def holds_tensors(dump) -> bool:
    """Whether a dump holds tensor bytes (not a fingerprint dump)."""
    return dump.setting("non_intrusive_mode") != "fingerprint"


def carries_prints(dump) -> bool:
    """Whether a full dump was written with the row prints of every stored tensor."""
    setting = dump.setting("fingerprints")
    return setting == "1" or (setting == "auto" and str(dump.run.get("device", "")).startswith("cuda"))


def index_kind(dumps: List) -> str:
    """The one fingerprint kind the indexes of dumps compared together are built in."""
    if any(not holds_tensors(d) for d in dumps):
        return ROWPRINT
    return ROWPRINT if dumps and all(carries_prints(d) for d in dumps) else XXH3


def fingerprint_only(*dumps) -> List[str]:
    """Labels of the fingerprint dumps among ``dumps``."""
    return [d.label for d in dumps if not holds_tensors(d)]
