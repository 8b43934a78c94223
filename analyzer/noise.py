"""The noise-aware verdict: where a real error is introduced, seen through float noise.

Engines are rarely batch-invariant, so the first flipped bit usually sits in a layer-0 kernel
and every later call is a victim of it. A state bug deeper down (a corrupted cached key) still
shows: at its call the error jumps far beyond what came in. For each aligned row and call:

    in_err  = largest relative error of the call's token-aligned inputs  (0 when bit-identical)
    out_err = largest relative error of its outputs
    amplification = out_err / max(in_err, floor)

Relative error of a row is max|a - b| / max|a| over the row. The floor is the larger of the
output dtype's epsilon (an error below one ulp at the row's magnitude is not an error) and,
when a repeat dump of the reference is given (--noise A A2), the error that call shows between
two identical runs. Carried noise amplifies by ~1-10x; an introduced error by far more. The
threshold is derived from the run itself: a robust spread (median + k*MAD of log10
amplification over all calls that carry an error) with a lower bound, or the user's
--atol/--rtol, in which case a call whose inputs are all within tolerance and whose output is
not is named.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import pandas as pd

from .align import Alignment
from .compare import MAX_LISTED, RowTable, call_order
from .dtypes import BY_NAME, DType, eps, tiny, to_float64
from .index import Index

MIN_AMPLIFICATION = 30.0  # never call a 30x jump or less an introduced error
MAD_FACTOR = 8.0
MIN_ULPS = 8.0  # an introduced error must be at least this many epsilons of its row's magnitude
MAX_PAIRS = 512  # rows whose bytes are read for the noise-aware walk (sampled evenly beyond this)


def sample_pairs(pairs: pd.DataFrame, limit: int = MAX_PAIRS) -> pd.DataFrame:
    """Every row if few; else an even sample within each row kind, so each kind is represented."""
    if len(pairs) <= limit:
        return pairs
    share = max(1, limit // pairs["mode_b"].nunique())
    parts = [group.iloc[np.linspace(0, len(group) - 1, min(share, len(group))).astype(int)]
             for _, group in pairs.groupby("mode_b")]
    return pd.concat(parts).drop_duplicates("pair")


def row_errors(table: RowTable, a: Index, b: Index, pairs: pd.DataFrame, atol=None, rtol=None) -> pd.DataFrame:
    """Per (pair, tensor): relative error, absolute error and (with tolerances) 'exceeds'."""
    rows = table.frame(table["comparable"] & np.isin(table["pair"], pairs["pair"].to_numpy()))
    rows["rel"] = 0.0
    rows["abs"] = 0.0
    rows["exceeds"] = False
    rows["eps"] = np.nan
    differing = rows[rows["differ"]]
    if differing.empty:
        return rows
    reader_a, reader_b = a.reader(), b.reader()
    where, found = [], {"rel": [], "abs": [], "exceeds": [], "eps": []}
    for (pass_a, pass_b, tensor), group in differing.groupby(["pass_a", "pass_b", "tensor"], sort=False):
        ref, dtype = reader_a.bits(int(pass_a), tensor, group["row_a"].tolist())
        test, _ = reader_b.bits(int(pass_b), tensor, group["row_b"].tolist())
        rel, absolute, exceeds, epsilon = _compare_rows(ref, test, dtype, atol, rtol)
        where.append(group.index.to_numpy())
        for key, value in zip(found, (rel, absolute, exceeds, np.full(len(group), epsilon))):
            found[key].append(np.asarray(value))
    index = np.concatenate(where)  # one assignment per column: .loc per group was the slow part
    for key, values in found.items():
        rows.loc[index, key] = np.concatenate(values)
    return rows


def _compare_rows(ref: np.ndarray, test: np.ndarray, dtype: DType, atol, rtol):
    """Per row of two same-shaped arrays of elements held as bits (numpy: no torch start-up):
    relative error, absolute error, whether a tolerance is exceeded, and the dtype's epsilon."""
    n = ref.shape[0]
    if not dtype.floating:
        differ = (ref.reshape(n, -1) != test.reshape(n, -1)).any(axis=1)
        return differ.astype(float), differ.astype(float), differ, 0.0
    r, t = to_float64(ref.reshape(n, -1), dtype), to_float64(test.reshape(n, -1), dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(r) & np.isfinite(t)
        both_nan = np.isnan(r) & np.isnan(t)
        diff = np.where(finite, np.abs(r - t), np.where(both_nan | (r == t), 0.0, np.inf))
    scale = np.maximum(np.where(finite, np.abs(r), 0.0).max(axis=1, initial=0.0), tiny(dtype))
    absolute = diff.max(axis=1, initial=0.0)
    exceeds = np.zeros(n, dtype=bool)
    if atol is not None or rtol is not None:
        exceeds = (diff > (atol or 0.0) + (rtol or 0.0) * np.abs(r)).any(axis=1)
    return absolute / scale, absolute, exceeds, eps(dtype)


def noise_floor_by_call(errors: Optional[pd.DataFrame]) -> Dict[str, float]:
    """From a repeat of the same run: the largest output error each call shows anyway."""
    if errors is None or errors.empty:
        return {}
    outs = errors[errors["io"] == "out"]
    return outs.groupby("call")["rel"].max().to_dict()


def per_call_errors(errors: pd.DataFrame, floor_by_call: Dict[str, float]) -> pd.DataFrame:
    flags = errors.assign(in_rel=errors["rel"].where(errors["io"] == "in", 0.0),
                          out_rel=errors["rel"].where(errors["io"] == "out", 0.0),
                          in_exceeds=errors["exceeds"] & (errors["io"] == "in"),
                          out_exceeds=errors["exceeds"] & (errors["io"] == "out"),
                          out_eps=errors["eps"].where(errors["io"] == "out"))
    calls = flags.groupby(["pair", "pass_b", "call"]).agg(
        in_err=("in_rel", "max"), out_err=("out_rel", "max"), in_exceeds=("in_exceeds", "any"),
        out_exceeds=("out_exceeds", "any"), eps=("out_eps", "max")).reset_index()
    calls["eps"] = calls["eps"].fillna(eps(BY_NAME["float32"]))
    calls["floor"] = np.maximum(calls["eps"], calls["call"].map(floor_by_call).fillna(0.0))
    calls["amplification"] = calls["out_err"] / np.maximum(calls["in_err"], calls["floor"])
    return calls


def derive_threshold(calls: pd.DataFrame) -> dict:
    """Robust spread of log10 amplification over calls that carry or make an error."""
    active = calls[calls["out_err"] > 0]
    if active.empty:
        return {"amplification": MIN_AMPLIFICATION, "median": None, "mad": None, "samples": 0}
    logs = np.log10(active["amplification"].clip(lower=1e-12))
    median = float(np.median(logs))
    mad = float(np.median(np.abs(logs - median))) or 0.05
    threshold = max(MIN_AMPLIFICATION, 10 ** (median + MAD_FACTOR * mad))
    return {"amplification": threshold, "median": 10 ** median, "mad": mad, "samples": int(len(active))}


def noise_verdict(alignment: Alignment, a: Index, b: Index, table: RowTable, atol=None, rtol=None,
                  floor_by_call: Optional[Dict[str, float]] = None) -> dict:
    pairs = sample_pairs(alignment.pairs)
    errors = row_errors(table, a, b, pairs, atol, rtol)
    calls = per_call_errors(errors, floor_by_call or {})
    calls_b = b.calls[["pass", "call", "module", "cls", "post"]]
    calls = calls.merge(calls_b, left_on=["pass_b", "call"], right_on=["pass", "call"]).drop(columns=["pass"])
    tolerance_mode = atol is not None or rtol is not None
    if tolerance_mode:
        rule = {"atol": atol, "rtol": rtol}
        calls["introduced"] = calls["out_exceeds"] & ~calls["in_exceeds"]
    else:
        rule = derive_threshold(calls)
        rule["min_ulps"] = MIN_ULPS
        calls["introduced"] = (calls["amplification"] > rule["amplification"]) & (calls["out_err"] > MIN_ULPS * calls["eps"])
    rule["floor_from_repeat"] = bool(floor_by_call)
    firsts = calls[calls["introduced"]].sort_values(["pair", "post"]).drop_duplicates("pair")
    info = pairs.set_index("pair")[["seq", "pos", "mode_b"]]
    firsts = firsts.join(info, on="pair")
    order = call_order(b)
    verdict = {"rule": rule, "rows_examined": int(len(pairs)), "rows_total": int(len(alignment.pairs)),
               "culprits": [], "per_row": [], "bytes_read": None}
    for call, group in sorted(firsts.groupby("call"), key=lambda item: order.get(item[0], 0)):
        kinds = group["mode_b"].value_counts().to_dict()
        verdict["culprits"].append({
            "call": call, "module": group["module"].iloc[0], "cls": group["cls"].iloc[0], "rows": int(len(group)),
            "kinds": {k: int(v) for k, v in kinds.items()},
            "in_err": float(group["in_err"].max()), "out_err": float(group["out_err"].max()),
            "amplification": float(group["amplification"].min()),
            "sample_rows": [{"seq": r.seq, "pos": int(r.pos), "kind": r.mode_b} for r in group.head(6).itertuples()],
        })
    verdict["per_row"] = [{"seq": r.seq, "pos": int(r.pos), "kind": r.mode_b, "culprit": r.call,
                           "in_err": float(r.in_err), "out_err": float(r.out_err), "amplification": float(r.amplification)}
                          for r in firsts.sort_values(["seq", "pos"]).head(MAX_LISTED * 10).itertuples()]
    verdict["top_jumps"] = top_jumps(calls)
    return verdict


def top_jumps(calls: pd.DataFrame, limit: int = 8) -> list:
    """The largest amplifications seen, introduced or not: context for judging the threshold."""
    best = calls.sort_values("amplification", ascending=False).drop_duplicates("call").head(limit)
    return [{"call": r.call, "in_err": float(r.in_err), "out_err": float(r.out_err),
             "amplification": float(r.amplification)} for r in best.itertuples()]
