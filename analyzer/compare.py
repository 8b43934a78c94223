"""The strict verdict: the first call whose aligned input rows are bit-identical and whose output
rows are not.

For each aligned token row, hooked calls are walked in completion (post-hook) order, so a deep
module wins over the parents that contain it. A call whose inputs already differ is a victim.
If the first difference shows up in a call's *input*, the code that made it is not hooked; the
walk then reaches the enclosing call (clean inputs, dirty output), which is named, with a note
saying the difference arose in its own code before that child. Tensors without alignable token
rows (MoE dispatch buffers, padded buffers) are not comparable; they are listed with the reason
and the walk goes on.
"""

from __future__ import annotations

from typing import Dict, List

import pandas as pd
import torch

from .align import Alignment
from .index import Index

MAX_LISTED = 20


def row_table(alignment: Alignment, a: Index, b: Index) -> pd.DataFrame:
    """One row per (pair, tensor) present on both sides, with both fingerprints."""
    pairs = alignment.pairs[["pair", "pass_a", "row_a", "pass_b", "row_b"]]
    cols = ["pass", "tensor", "row", "fp", "rowshape", "nonfinite"]
    side_a = pairs.merge(a.rows[cols], left_on=["pass_a", "row_a"], right_on=["pass", "row"]).drop(columns=["pass", "row"])
    side_b = pairs[["pair"]].merge(
        pairs.merge(b.rows[cols], left_on=["pass_b", "row_b"], right_on=["pass", "row"]).drop(columns=["pass", "row"]),
        on="pair")[["pair", "tensor", "fp", "rowshape", "nonfinite"]]
    table = side_a.merge(side_b, on=["pair", "tensor"], suffixes=("_a", "_b"))
    info = b.tensors[["pass", "tensor", "call", "io"]]
    table = table.merge(info, left_on=["pass_b", "tensor"], right_on=["pass", "tensor"]).drop(columns=["pass"])
    table["comparable"] = table["rowshape_a"] == table["rowshape_b"]
    table["differ"] = table["comparable"] & (table["fp_a"] != table["fp_b"])
    return table


def call_order(index: Index) -> Dict[str, int]:
    """Canonical completion order of call names (the same structure repeats in every pass)."""
    calls = index.calls.copy()
    calls["rank_in_pass"] = calls.groupby("pass")["post"].rank(method="first")
    return calls.groupby("call")["rank_in_pass"].min().sort_values().rank(method="first").astype(int).to_dict()


def strict_verdict(alignment: Alignment, a: Index, b: Index, table: pd.DataFrame = None) -> dict:
    table = row_table(alignment, a, b) if table is None else table
    pairs = alignment.pairs.set_index("pair")
    calls_b = b.calls[["pass", "call", "module", "cls", "pre", "post"]]
    flags = table.assign(in_differ=table["differ"] & (table["io"] == "in"),
                         out_differ=table["differ"] & (table["io"] == "out"))
    per_call = flags.groupby(["pair", "pass_b", "call"])[["in_differ", "out_differ"]].any().reset_index()
    per_call = per_call.merge(calls_b, left_on=["pass_b", "call"], right_on=["pass", "call"]).drop(columns=["pass"])
    order = call_order(b)
    per_call["order"] = per_call["call"].map(order)
    culprits = per_call[per_call["out_differ"] & ~per_call["in_differ"]].sort_values(["pair", "post"])
    row_culprit = culprits.drop_duplicates("pair", keep="first")
    dirty = per_call[per_call["out_differ"] | per_call["in_differ"]].sort_values(["pair", "post"])
    first_dirty = dirty.drop_duplicates("pair", keep="first").set_index("pair")

    verdict = {"rows_compared": int(len(pairs)), "rows_differing": int(dirty["pair"].nunique()),
               "not_comparable": not_comparable(table, a, b), "nonfinite": nonfinite(table),
               "culprit": None, "per_row": [], "groups": []}
    verdict.update(calls_timeline(per_call))
    if row_culprit.empty:
        if len(dirty):
            verdict["note"] = "rows differ but no hooked call has clean inputs and a dirty output; widen DUMPER_FILTER"
        return verdict
    rows = row_culprit.merge(pairs[["seq", "pos", "id", "mode_a", "mode_b", "pass_a", "row_a"]], left_on="pair", right_index=True)
    verdict["per_row"] = [
        {"seq": r.seq, "pos": int(r.pos), "id": int(r.id), "kind": r.mode_b, "ref_kind": r.mode_a, "culprit": r.call}
        for r in rows.sort_values(["seq", "pos"]).itertuples()]
    groups = rows.groupby("call").agg(rows=("pair", "size"), order=("order", "min"), module=("module", "first"),
                                      cls=("cls", "first")).sort_values("order")
    verdict["groups"] = [{"call": call, "module": g.module, "cls": g.cls, "rows": int(g.rows)} for call, g in groups.iterrows()]
    first = groups.index[0]
    mine = rows[rows["call"] == first]
    culprit = {"call": first, "module": groups.loc[first, "module"], "cls": groups.loc[first, "cls"],
               "rows": [{"seq": r.seq, "pos": int(r.pos), "kind": r.mode_b} for r in mine.itertuples()][:MAX_LISTED],
               "n_rows": int(len(mine))}
    culprit["note"] = _own_code_note(mine, first_dirty, per_call)
    later = per_call[(per_call["order"] > order[first]) & (per_call["in_differ"] | per_call["out_differ"])]
    culprit["victims"] = int(later["call"].nunique())
    culprit.update(_error_figures(first, mine, table, a, b))
    verdict["culprit"] = culprit
    return verdict


MAX_TIMELINE = 5000  # calls kept in the timeline; an MoE with hooked experts can have tens of thousands


def calls_timeline(per_call: pd.DataFrame) -> dict:
    """Per hooked call, in execution order: rows compared, rows whose inputs / outputs differ, and
    rows where a difference arises in it (clean inputs, dirty output). Only fingerprints are used,
    no tensor bytes, so it stays cheap on huge dumps; the reports plot it."""
    flags = per_call.assign(origin=per_call["out_differ"] & ~per_call["in_differ"])
    calls = flags.groupby("call").agg(cls=("cls", "first"), order=("order", "min"), rows=("pair", "size"),
                                      rows_in_differ=("in_differ", "sum"), rows_out_differ=("out_differ", "sum"),
                                      rows_origin=("origin", "sum")).sort_values("order")
    timeline = [{"call": call, "cls": c.cls, "order": int(c.order), "rows": int(c.rows),
                 "rows_in_differ": int(c.rows_in_differ), "rows_out_differ": int(c.rows_out_differ),
                 "rows_origin": int(c.rows_origin)} for call, c in calls.head(MAX_TIMELINE).iterrows()]
    return {"calls_timeline": timeline, "calls_timeline_total": int(len(calls))}


def _own_code_note(mine: pd.DataFrame, first_dirty: pd.DataFrame, per_call: pd.DataFrame):
    """Say so when the first difference appeared at a child's input, i.e. in the culprit's own code."""
    sample = mine.iloc[0]
    first = first_dirty.loc[sample["pair"]]
    if first["call"] == sample["call"] or not first["in_differ"]:
        return None
    return (f"its hooked children ran clean up to {first['call']}, whose input already differs: the difference "
            f"arises in {sample['call'].split('#')[0]}'s own code (not a hooked submodule) before that call")


def _error_figures(call: str, mine: pd.DataFrame, table: pd.DataFrame, a: Index, b: Index) -> dict:
    outs = table[(table["call"] == call) & (table["io"] == "out") & table["differ"] & table["pair"].isin(mine["pair"])]
    tensor = outs["tensor"].iloc[0]
    chosen = outs[outs["tensor"] == tensor].merge(mine[["pair", "pass_a", "row_a"]], on="pair", suffixes=("", "_m"))
    chosen = chosen.iloc[: 512]  # bounded read: enough rows for the figures
    reader_a, reader_b = a.reader(), b.reader()
    ref = torch.cat([reader_a.rows(int(p), tensor, [int(r)]) for p, r in zip(chosen["pass_a"], chosen["row_a"])])
    test = torch.cat([reader_b.rows(int(p), tensor, [int(r)]) for p, r in zip(chosen["pass_b"], chosen["row_b"])])
    figures = error_stats(ref, test)
    figures["tensor"] = tensor
    figures["shapes"] = _shapes(call, chosen, a, b)
    return figures


def _shapes(call: str, chosen: pd.DataFrame, a: Index, b: Index) -> dict:
    pass_a, pass_b = int(chosen["pass_a"].iloc[0]), int(chosen["pass_b"].iloc[0])
    out = {}
    for side, index, pass_id in (("a", a, pass_a), ("b", b, pass_b)):
        tensors = index.tensors[(index.tensors["pass"] == pass_id) & (index.tensors["call"] == call)]
        tokens = index.tokens[(index.tokens["pass"] == pass_id) & index.tokens["valid"]]
        out[side] = {"pass": pass_id, "M": int(len(tokens)),
                     "tensors": {t[len(call) + 1:]: s for t, s in zip(tensors["tensor"], tensors["shape"])}}
    return out


def error_stats(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """max abs diff, max ulp diff and relative diff between two same-shaped float tensors."""
    if not ref.is_floating_point():
        differ = int((ref != test).sum())
        return {"max_abs": float((ref.long() - test.long()).abs().max()), "max_ulp": None, "rel": None,
                "elements_differ": differ, "dtype": str(ref.dtype)[6:]}
    r64, t64 = ref.double(), test.double()
    finite = torch.isfinite(r64) & torch.isfinite(t64)
    diff = (r64 - t64).abs()[finite]
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(r64[finite].abs().max()) if finite.any() else 0.0
    return {"max_abs": max_abs, "max_ulp": ulp_distance(ref, test), "rel": max_abs / scale if scale else None,
            "elements_differ": int((ref.view(_int_type(ref)) != test.view(_int_type(test))).sum()),
            "elements": int(ref.numel()), "dtype": str(ref.dtype)[6:], "ref_absmax": scale}


def _int_type(t: torch.Tensor):
    return {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[t.element_size()]


def ulp_distance(ref: torch.Tensor, test: torch.Tensor) -> int:
    """Largest number of representable floats between paired elements (NaN/Inf ignored)."""
    def ordered(t):
        bits = t.contiguous().view(_int_type(t)).long()
        sign_mask = 1 << (t.element_size() * 8 - 1)
        return torch.where(bits < 0, -(bits & (sign_mask - 1)), bits)
    finite = torch.isfinite(ref) & torch.isfinite(test)
    if not finite.any():
        return 0
    return int((ordered(ref) - ordered(test)).abs()[finite].max())


def not_comparable(table: pd.DataFrame, a: Index, b: Index) -> List[dict]:
    """Calls with tensors that cannot be compared row by row, and why."""
    found = {}
    shape_mismatch = table[~table["comparable"]].drop_duplicates("tensor")
    for r in shape_mismatch.itertuples():
        found.setdefault(r.call, f"{r.tensor}: row shape {r.rowshape_a} vs {r.rowshape_b}")
    for index in (b, a):
        no_rows = index.tensors[index.tensors["why"].notna()].drop_duplicates("tensor")
        for r in no_rows.itertuples():
            found.setdefault(r.call, f"{r.tensor}: {r.why}")
    return [{"call": c, "why": w} for c, w in list(found.items())[:MAX_LISTED * 5]]


def nonfinite(table: pd.DataFrame) -> List[dict]:
    bad = table[(table["nonfinite_a"] > 0) | (table["nonfinite_b"] > 0)]
    summary = bad.groupby("tensor").agg(rows=("pair", "size"), a=("nonfinite_a", "sum"), b=("nonfinite_b", "sum"))
    return [{"tensor": t, "rows": int(r.rows), "nonfinite_a": int(r.a), "nonfinite_b": int(r.b)}
            for t, r in summary.head(MAX_LISTED).iterrows()]
