"""The KL check's result, typed: what `dumpdiff kl --format json` writes and every KL report reads.

Like the first-divergence result (verdict/result.py) it stays plain dicts; these TypedDicts name
its keys. The schema made from them (docs/schemas/kl.schema.json) requires the keys declared
here and leaves room for more: a helper keeps whatever its engine reports per prompt.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, TypedDict

from ..verdict.result import json_schema

# The JSON outputs' markers, said first: "format" (what the file holds; for the KL check and its
# calibration the result's "kind") and "version" (up when a key changes meaning or goes away).
JSON_VERSION = 1

HelperName = Literal["match", "prefill_cache_hit", "decode_cache_hit"]
VerdictKind = Literal["pass", "batch_invariance", "state_bug", "no_cache_only", "inconclusive", "over_threshold"]
HelperStatus = Literal["clean", "dirty", "n/a", "no_cache_hit", "empty"]


class Target(TypedDict):
    """What was checked: the server's or the in-process model's engine, model and layout."""

    engine: str
    model: Optional[str]


class PromptSet(TypedDict):
    source: str
    count: int
    min_len: int
    max_len: int


class Settings(TypedDict):
    max_samples: int
    max_new_tokens: int
    temperature: float
    seed: Optional[int]
    min_hit_rate: float
    helpers: List[str]


class Threshold(TypedDict):
    value: float  # the avg_kl_div above which a helper is dirty
    helpers: Dict[str, float]  # per-helper overrides
    source: str  # where the value came from (default, --threshold, a calibration file)


class PromptScore(TypedDict):
    """One prompt of one helper (scored only when it exercised the path the helper tests)."""

    hit: bool


class HelperSummary(TypedDict):
    helper: str
    description: str
    threshold: float
    prompts: int
    scored_prompts: int
    cache_hits: Optional[int]
    cache_hit_rate: Optional[float]
    notes: List[str]
    per_prompt: List[PromptScore]
    tokens: int
    avg_kl_div: Optional[float]
    max_kl: Optional[float]
    frac_over: Optional[float]
    bit_identical: int
    max_abs_logr: Optional[float]
    chunked_references: int
    chunked_prefill_size: Optional[int]
    status: HelperStatus
    worst: Optional[int]  # the index of the prompt with the largest mean KL


class LocalizeChoice(TypedDict):
    helper: str
    prompt: Optional[int]


class KLVerdict(TypedDict):
    kind: VerdictKind
    text: str
    dirty: List[str]
    clean: List[str]
    lacking: List[str]
    notes: List[str]
    chunked_references: Dict[str, int]
    localize: Optional[LocalizeChoice]  # the helper and prompt `dumpdiff localize` replays


class KLResult(TypedDict):
    """The whole check. ``format`` and ``version`` come first in the JSON report only."""

    kind: Literal["dumpdiff-kl"]
    target: Target
    prompts: PromptSet
    settings: Settings
    threshold: Threshold
    helpers: Dict[str, HelperSummary]
    timings: Dict[str, float]
    notes: List[str]
    verdict: KLVerdict


def kl_schema() -> dict:
    return json_schema(
        KLResult,
        "dumpdiff KL check report",
        header={"format": {"const": "dumpdiff-kl"}, "version": {"const": JSON_VERSION}},
        closed=False,
    )


if __name__ == "__main__":
    import json
    import sys

    json.dump(kl_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
