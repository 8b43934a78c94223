"""KL consistency check: score the same token twice and classify the disagreement.

Every helper (see helpers.py, inprocess.py) produces, per prompt, the logprobs of the
generated tokens as the decode run gave them and as a later reference prefill of
prompt+output gave them. Per token

    logr = prefill_lp - decode_lp
    k3   = exp(logr) - 1 - logr          (>= 0; sglang's KL estimator, computed with expm1)

A helper's avg_kl_div is the mean over prompts of the per-prompt mean k3, exactly as sglang's
``compare_kl_divergence``; it is dirty when avg_kl_div > threshold.

The verdict compares the helpers (two conditions):

    match dirty, no cache-hit helper clean
                                    -> batch_invariance: prefill and decode kernels disagree
                                       everywhere; localize the first flipping op with the dumper
    match dirty, a cache-hit helper clean
                                    -> no_cache_only: not a cache bug; batch-variance near the threshold
    match clean, a cache-hit helper dirty
                                    -> state_bug: the no-cache path agrees, so the cache-restore
                                       path (radix prefix restore, decode-cache restore) corrupts state
    a helper dirty, match not run   -> over_threshold: the two conditions cannot be told apart
      (or its references chunked)
    nothing dirty                   -> pass
    a cache-hit helper without hits -> inconclusive (it tested nothing), unless another helper is dirty

A reference prefill longer than the server's chunked-prefill size is chunked: its later chunks
read the earlier ones back from the KV cache, so it is not cache-free and a cache bug runs in it
too. A dirty `match` with such references is then over_threshold (cannot tell) unless its
prompts with unchunked references are dirty on their own, and a clean check with them anywhere
is inconclusive (a cache bug on both sides can cancel out), not pass.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..wording import plural

HELPERS = ("match", "prefill_cache_hit", "decode_cache_hit")
CACHE_HELPERS = ("prefill_cache_hit", "decode_cache_hit")
DESCRIPTIONS = {
    "match": "no cache: generate, flush, prefill prompt+output",
    "prefill_cache_hit": "prompt restored from the prefix cache, then decode",
    "decode_cache_hit": "second turn restores the first turn's prompt+output from cache",
}

# Verdict kinds, and the exit status each maps to (diff(1) style).
PASS, BATCH, STATE, MIXED, INCONCLUSIVE = "pass", "batch_invariance", "state_bug", "no_cache_only", "inconclusive"
UNCLASSIFIED = "over_threshold"  # dirty, but match cannot decide (not run, or its references chunked)

# A cache-hit helper this many times dirtier than `match` is reported as a likely state bug
# on top of batch-variance (a clean engine's helpers stay within a small factor of each other).
STATE_ON_TOP_FACTOR = 100.0


def token_kl(prefill_lp: Sequence[float], decode_lp: Sequence[float]) -> np.ndarray:
    """k3 per token, float64. expm1 keeps 1-ulp differences (logr ~ 1e-7) exact instead of
    drowning them in the rounding of exp(logr) - 1."""
    logr = np.asarray(prefill_lp, dtype=np.float64) - np.asarray(decode_lp, dtype=np.float64)
    return np.expm1(logr) - logr


def score_prompt(prefill_lp: Sequence[float], decode_lp: Sequence[float], threshold: float) -> dict:
    """Per-prompt figures: mean/max k3, tokens over the threshold, bit-identical tokens."""
    if len(prefill_lp) != len(decode_lp):
        raise ValueError(f"{len(prefill_lp)} prefill logprobs vs {len(decode_lp)} decode logprobs")
    if not len(decode_lp):
        return {
            "tokens": 0,
            "mean_kl": 0.0,
            "max_kl": 0.0,
            "max_pos": None,
            "over": 0,
            "first_over": None,
            "bit_identical": 0,
            "max_abs_logr": 0.0,
        }
    k3 = token_kl(prefill_lp, decode_lp)
    same = np.asarray(prefill_lp, dtype=np.float64) == np.asarray(decode_lp, dtype=np.float64)
    over = np.flatnonzero(k3 > threshold)
    logr = np.abs(np.asarray(prefill_lp, dtype=np.float64) - np.asarray(decode_lp, dtype=np.float64))
    return {
        "tokens": int(k3.size),
        "mean_kl": float(k3.mean()),
        "max_kl": float(k3.max()),
        "max_pos": int(k3.argmax()),
        "over": int(over.size),
        "first_over": int(over[0]) if over.size else None,
        "bit_identical": int(same.sum()),
        "max_abs_logr": float(logr.max()),
    }


def summarize_helper(
    name: str,
    prompts: list,
    threshold: float,
    *,
    cache_applicable: bool = True,
    min_hit_rate: float = 0.5,
    notes: Optional[list] = None,
    chunk_size: Optional[int] = None,
) -> dict:
    """Aggregate one helper over its prompts.

    prompts: one dict per prompt with at least ``prefill_lp``, ``decode_lp`` (equal length
    lists) and ``hit`` (bool: the cache state this helper tests was really restored; always
    True for `match`); anything else (index, ids, cached_tokens) is kept. Prompts without a hit
    are not scored, as in sglang's helpers: they did not exercise the cache path. A scored
    prompt with ``ref_chunked`` True had its reference prefill chunked (``chunk_size``: the
    server's chunked-prefill size): counted in ``chunked_references``, which the verdict reads.
    """
    rows, scored = [], []
    for p in prompts:
        row = {k: v for k, v in p.items() if k not in ("prefill_lp", "decode_lp")}
        if p.get("hit", True):
            row.update(score_prompt(p["prefill_lp"], p["decode_lp"], threshold))
            scored.append(row)
        rows.append(row)
    hits = sum(1 for p in prompts if p.get("hit", True))
    result = {
        "helper": name,
        "description": DESCRIPTIONS.get(name, ""),
        "threshold": threshold,
        "prompts": len(prompts),
        "scored_prompts": len(scored),
        "cache_hits": hits if name in CACHE_HELPERS else None,
        "cache_hit_rate": (hits / len(prompts) if prompts else 0.0) if name in CACHE_HELPERS else None,
        "notes": list(notes or []),
        "per_prompt": rows,
    }
    tokens = sum(r["tokens"] for r in scored)
    result.update(
        {
            "tokens": tokens,
            "avg_kl_div": float(np.mean([r["mean_kl"] for r in scored])) if scored else None,
            "max_kl": max((r["max_kl"] for r in scored), default=None),
            "frac_over": (sum(r["over"] for r in scored) / tokens) if tokens else None,
            "bit_identical": sum(r["bit_identical"] for r in scored),
            "max_abs_logr": max((r["max_abs_logr"] for r in scored), default=None),
            "chunked_references": sum(1 for r in scored if r.get("ref_chunked")),
            "chunked_prefill_size": chunk_size,
        }
    )
    free = [r["mean_kl"] for r in scored if not r.get("ref_chunked")]
    if result["chunked_references"]:  # the prompts whose references were cache-free, on their own
        result["avg_kl_div_unchunked"] = float(np.mean(free)) if free else None
    if name in CACHE_HELPERS and not cache_applicable:
        result["status"] = "n/a"
        result["notes"].append(
            "the server runs without a radix cache (disable_radix_cache): this path does not exist there"
        )
    elif name in CACHE_HELPERS and (not prompts or hits / len(prompts) <= min_hit_rate or not scored):
        result["status"] = "no_cache_hit"
        result["notes"].append(
            f"cache hits on {hits} of {plural(len(prompts), 'prompt')} "
            f"(need more than {min_hit_rate:.0%}): "
            "this helper did not test the cache path, so it cannot pass"
        )
    elif not scored or not tokens:
        result["status"] = "empty"
        result["notes"].append("no generated tokens to score")
    else:
        result["status"] = "dirty" if result["avg_kl_div"] > threshold else "clean"
    worst = max(scored, key=lambda r: r["mean_kl"], default=None)
    result["worst"] = worst["index"] if worst is not None and "index" in worst else None
    return result


def classify(helpers: dict, uncalibrated: bool = False) -> dict:
    """The two-condition verdict over helper summaries keyed by name. ``uncalibrated``: the
    threshold is the default, not one measured on this server: a cache-hit helper far dirtier
    than match, yet under it, is then no pass."""
    status = {name: h["status"] for name, h in helpers.items()}
    dirty = [n for n in HELPERS if status.get(n) == "dirty"]
    clean = [n for n in HELPERS if status.get(n) == "clean"]
    lacking = [n for n in HELPERS if status.get(n) in ("no_cache_hit", "empty")]
    chunked = {
        n: helpers[n]["chunked_references"]
        for n in HELPERS
        if status.get(n) in ("clean", "dirty") and helpers[n].get("chunked_references")
    }
    suspects = _dirtier_than_match(helpers) if uncalibrated else {}
    notes = []
    if not dirty:
        if lacking:
            kind = INCONCLUSIVE
            text = (
                f"no helper is over its threshold, but {', '.join(lacking)} scored nothing (no cache hits, or "
                "no tokens): the check is incomplete"
            )
        elif not clean:
            kind, text = INCONCLUSIVE, "no helper ran"
        elif chunked:  # both sides of those prompts ran on the cache: a cache bug there can cancel out
            kind = INCONCLUSIVE
            text = "every helper that ran is within its threshold, but " + _chunked_text(
                helpers, chunked, "a cache bug runs in the reference as in the decode run, and the two can cancel out"
            )
        elif suspects:
            kind = INCONCLUSIVE  # a state bug under a threshold nobody measured: a real one passed here
            text = (
                "every helper is within the default threshold, which was not calibrated for this server, but "
                + "; ".join(f"{name} is {ratio:.3g}x dirtier than match (no cache)" for name, ratio in suspects.items())
                + ": a state bug in that cache path is likely; calibrate on a known-good build (`dumpdiff kl "
                "calibrate`) or pass --threshold, and rerun"
            )
        else:
            kind, text = PASS, f"every helper that ran is within its threshold ({', '.join(clean)})"
    elif status.get("match") not in ("clean", "dirty"):
        kind = UNCLASSIFIED
        text = (
            f"{', '.join(dirty)} over the threshold, but match (no cache) did not run, so batch-variance cannot "
            "be told from a state bug: run match too"
        )
    elif "match" in dirty and "match" in chunked and not _dirty_unchunked(helpers["match"]):
        kind = UNCLASSIFIED  # match is not the cache-free path here
        text = (
            f"{', '.join(dirty)} over the threshold, but batch-variance cannot be told from a state bug: "
            + _chunked_text(helpers, chunked, "a cache bug dirties match too")
        )
    elif "match" in dirty:
        if not any(n in clean for n in CACHE_HELPERS):
            kind = BATCH
            text = (
                "match (no cache) is dirty and no cache-hit helper is clean: prefill and decode compute the "
                "same token differently (batch-variance, e.g. a kernel chosen by the number of token rows). "
                "Localize it with `dumpdiff localize`: an op that adds an error beyond float noise (noise-aware "
                "culprit) first, else the first op whose bits flip (strict culprit)."
            )
            if not all(n in dirty for n in CACHE_HELPERS):
                notes.append(
                    "the cache-hit helpers did not all run ("
                    + ", ".join(f"{n} {status.get(n) or 'not run'}" for n in CACHE_HELPERS if n not in dirty)
                    + ")"
                )
        else:
            kind = MIXED
            text = (
                f"only the no-cache helper (match) is dirty while {', '.join(n for n in clean if n != 'match')} "
                "is clean: prefill and decode disagree without any cache, so this is not a cache-restore bug; "
                "treat it as batch-variance near the threshold (rerun, or recalibrate)."
            )
        notes += _state_on_top(helpers, dirty)
    else:
        kind = STATE
        text = (
            f"only the cache-hit helper(s) {', '.join(dirty)} are dirty; the no-cache path (match) is clean: "
            "a state bug in the cache-restore path ("
            + "; ".join(_path_of(n) for n in dirty)
            + "). Localize it with `dumpdiff localize` (noise-aware culprit)."
        )
    if chunked and kind not in (INCONCLUSIVE, UNCLASSIFIED):
        notes.append(_chunked_text(helpers, chunked, "a cache bug runs in those references too"))
    chosen = dirty or (list(suspects) if kind == INCONCLUSIVE else [])
    return {
        "kind": kind,
        "text": text,
        "dirty": dirty,
        "clean": clean,
        "lacking": lacking,
        "notes": notes,
        "chunked_references": chunked,
        "localize": _localize_choice(kind, helpers, chosen),
    }


def _dirtier_than_match(helpers: dict) -> dict:
    """Cache-hit helpers STATE_ON_TOP_FACTOR or more times match's avg_kl_div: name -> ratio. A
    match of 0 (every token bit-identical) counts as 1e-15, calibrate's floor: below it, float32
    stray ulps averaged over many tokens."""
    if helpers.get("match", {}).get("avg_kl_div") is None:
        return {}
    base = max(helpers["match"]["avg_kl_div"], 1e-15)
    ratios = {name: (helpers.get(name, {}).get("avg_kl_div") or 0.0) / base for name in CACHE_HELPERS}
    return {name: ratio for name, ratio in ratios.items() if ratio >= STATE_ON_TOP_FACTOR}


def _dirty_unchunked(helper: dict) -> bool:
    """The prompts whose references were not chunked are dirty on their own: cache-free evidence."""
    value = helper.get("avg_kl_div_unchunked")
    return value is not None and value > helper["threshold"]


def _chunked_text(helpers: dict, chunked: dict, consequence: str) -> str:
    size = next(
        (helpers[n].get("chunked_prefill_size") for n in chunked if helpers[n].get("chunked_prefill_size")), None
    )
    counts = ", ".join(f"{n} {c} of {helpers[n].get('scored_prompts')}" for n, c in chunked.items())
    return (
        f"reference prefills longer than --chunked-prefill-size {size or '?'} were chunked ({counts}): they read "
        f"the KV cache, so {consequence}; restart the server with --chunked-prefill-size larger "
        "than prompt+output (or -1), or use shorter --prompt-len/--max-new-tokens"
    )


def _path_of(name: str) -> str:
    return {
        "prefill_cache_hit": "prompt restored from the radix/prefix cache",
        "decode_cache_hit": "a previous turn's prompt+output restored from the cache",
    }.get(name, name)


def _state_on_top(helpers: dict, dirty: list) -> list:
    return [
        f"{name} is {ratio:.3g}x dirtier than match: beyond batch-variance, a state bug in its cache path is "
        f"likely too (localize with --helper {name})"
        for name, ratio in _dirtier_than_match(helpers).items()
        if name in dirty
    ]


def _localize_choice(kind: str, helpers: dict, dirty: list) -> Optional[dict]:
    """Which helper and prompt `dumpdiff localize` should replay."""
    if kind == STATE:
        candidates = [n for n in CACHE_HELPERS if n in dirty]
    elif kind in (BATCH, MIXED):
        candidates = ["match"]
    elif kind in (UNCLASSIFIED, INCONCLUSIVE) and dirty:
        candidates = dirty  # over the threshold, or suspects under an uncalibrated one
    else:
        return None
    name = max(candidates, key=lambda n: helpers[n].get("avg_kl_div") or 0.0)
    return {"helper": name, "prompt": helpers[name].get("worst")}


EXIT_FOR_KIND = {PASS: 0, BATCH: 1, STATE: 1, MIXED: 1, UNCLASSIFIED: 1, INCONCLUSIVE: 2}


def exit_status(verdict: dict) -> int:
    return EXIT_FOR_KIND[verdict["kind"]]
