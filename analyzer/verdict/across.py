"""`dumpdiff compare`: two runs of one model with the same prompts, in other engines,
tensor-parallel sizes or dtypes. Open both dumps, index them, pair token rows by their token ids,
prove the pairing (crossproof.py), map each run's tensors onto the other's names (mapping.py,
canon.py), join tensor-parallel shards (sides.py), and judge each op by the error it adds beyond
its precision (precision.py). Returns the result every report format renders (across_result.py)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..dump.dtypes import BY_NAME, eps, tiny
from ..dump.load import open_dump, show
from ..errors import DumpError
from ..index.printkind import fingerprint_only
from ..index.store import load_indexes
from ..wording import agree, plural
from .align import align, embedding_call, prove
from .canon import Piece, call_of, dumped_by, io_of, map_rank, module_of
from .crossflips import excused, routing_flips
from .crossproof import prove_embeddings
from .diverge import describe, differing_key
from .mapping import load_rules
from .noise import sample_pairs
from .precision import adds_most, judge, judge_gaps
from .sides import Side, check_ranks_alike, float_kind

MAX_ROWS = 512  # token row pairs whose values are read (an even sample per row kind beyond this)
MAX_LISTED = 8
IDENTITY_KEYS = ("model_type", "num_layers")


def compare(
    path_a: str,
    path_b: str,
    mapping: Optional[str] = None,
    trust_alignment: bool = False,
    allow_mismatch: bool = False,
    progress: bool = True,
    rebuild_index: bool = False,
    max_rows: int = MAX_ROWS,
) -> dict:
    rules = load_rules(mapping)
    dump_a, dump_b = open_dump(path_a), open_dump(path_b)
    differ = differing_key(dump_a, dump_b, IDENTITY_KEYS)
    if differ and not allow_mismatch:
        raise DumpError(
            f"the dumps differ in {differ}: compare runs of one model, or pass --allow-mismatch with a mapping file "
            "(--map) if that is intended"
        )
    _check_ranks_held(dump_a, dump_b)
    blind = fingerprint_only(dump_a, dump_b)
    if blind:
        raise DumpError(
            f"{' and '.join(show(label) for label in blind)} {agree(len(blind), 'hold')} row fingerprints only "
            "(DUMPER_NON_INTRUSIVE_MODE=fingerprint), and compare reads tensor values: dump both runs with "
            "DUMPER_NON_INTRUSIVE_MODE=all (a DUMPER_FILTER keeps it small)"
        )
    index_a, index_b = load_indexes([dump_a, dump_b], rebuild=rebuild_index, progress=progress)
    ranks_a, ranks_b = sorted(dump_a.ranks), sorted(dump_b.ranks)
    check_ranks_alike(index_a, ranks_a, dump_a.label)
    check_ranks_alike(index_b, ranks_b, dump_b.label)
    ia, ib = index_a.rank(ranks_a[0]), index_b.rank(ranks_b[0])
    alignment = align(ia, ib)
    unpaired_cached = alignment.cached_unpaired_b  # two runs may generate other tokens: not a bad reference
    alignment.cached_b = alignment.cached_unpaired_b = 0
    if not len(alignment.cols) and not alignment.history_notes_b:
        raise DumpError(
            f"no token row of {show(dump_b.label)} matches a row of {show(dump_a.label)} (same token ids from position "
            "0): dump both runs with the same prompts (token ids)"
        )
    alignment = prove(alignment, ia, ib, dump_a.label, dump_b.label, trust=True)
    alignment.proof.pop()  # "embedding check skipped": the check across runs follows
    scaled_embedding = False  # one run scales its looked-up rows after the embedding module
    if trust_alignment:
        alignment.proof.append("embedding check skipped (--trust-alignment)")
    else:
        line, scaled_embedding = prove_embeddings(alignment, ia, ib, dump_a.label, dump_b.label)
        alignment.proof.append(line)
    engine_a, engine_b = dump_a.run.get("engine") or "", dump_b.run.get("engine") or ""
    sides = []
    for dump, index, ranks, which, engine, other in (
        (dump_a, index_a, ranks_a, "reference", engine_a, engine_b),
        (dump_b, index_b, ranks_b, "test", engine_b, engine_a),
    ):
        indexes = {r: index.rank(r) for r in ranks}
        sides.append(Side(dump, indexes, {r: map_rank(indexes[r], rules, which, engine, other) for r in ranks}))
    side_a, side_b = sides
    compared, unmapped, renamed, filtered = pair_names(side_a, side_b)
    if unmapped:
        raise DumpError(unmapped)
    if scaled_embedding:  # the lookup of one, the scaled rows of the other: compared as the first layer's input
        compared = [entry for entry in compared if call_of(entry[0]) != embedding_call(ia)[1].split(".out.")[0]]
    if not compared:
        raise DumpError(
            "no tensor of the two runs could be paired: are they dumps of one model? write a mapping file (--map)"
        )
    pick = sample_pairs(alignment.cols, max_rows)
    pairs = alignment.cols.take(pick)
    sizes_of = _sizes_resolver(side_a, side_b)
    errors, not_comparable, dtypes = _tensor_errors(compared, pairs, side_a, side_b, sizes_of, progress)
    calls, in_err, out_err, eps_of, wide, int_only = _call_errors(compared, errors, dtypes, side_a, side_b)
    in_err = _fill_missing_inputs(in_err, out_err, int_only)
    flips, flipped_by_block = routing_flips(side_a, side_b, pairs)
    routers = {flip["router"] for flip in flips}
    excuse = excused(calls, module_of, flipped_by_block, len(pairs), routers) if flips else None
    judged = judge(calls, in_err, out_err, eps_of, wide, excuse)
    gap_judged = judge_gaps(calls, in_err, out_err, eps_of, wide, excuse)
    info = {name: _describe_call(name, side_a, side_b) for name in calls}
    rows = _row_refs(pairs)
    ops = [_op(j, info[j["call"]], rows, compared) for j in judged]
    gaps = [_op(j, info[j["call"]], rows, compared, "gap") for j in gap_judged if j["over"]]
    order = {call: at for at, call in enumerate(calls)}  # code before a call's input comes before the call
    named = sorted([op for op in ops if op["over"]] + gaps, key=lambda op: (order[op["call"]], op["kind"] == "op"))
    most = adds_most(judged)
    same_types = dump_a.run.get("dtype") == dump_b.run.get("dtype")
    first_difference = _first_difference(calls, in_err, out_err, info, rows) if same_types else None
    result = {
        "a": describe(dump_a),
        "b": describe(dump_b),
        "kind": "beyond-precision" if named else "within-precision",
        "divergence": bool(named),
        "alignment": {
            "proof": alignment.proof,
            "rows_b": alignment.rows_b,
            "paired": len(alignment.cols),
            "unaligned_b": alignment.unaligned_b,
            "unkeyed_b": alignment.unkeyed_b,
            "embedding": embedding_call(ib)[0] if embedding_call(ib) else None,
        },
        "rows_compared": len(pairs),
        "precision": {"reference": dump_a.run.get("dtype"), "test": dump_b.run.get("dtype")},
        "mapping": {
            "rules": side_a.first.rules_used + [r for r in side_b.first.rules_used if r not in side_a.first.rules_used],
            "tensors": len(compared),
            "renamed": renamed,
            "not_comparable": not_comparable,
            "shards": _shard_notes(side_a) + _shard_notes(side_b),
            "joined": {"reference": dict(sorted(side_a.joined.items())), "test": dict(sorted(side_b.joined.items()))},
        },
        "ops": ops,
        "gaps": gaps,
        "culprits": [_place(op) for op in named],
        "first": named[0] if named else None,
        "adds_most": next((op for op in ops if most and op["call"] == most["call"]), None),
        "first_difference": first_difference,
        "routing_flips": [_flip(entry, rows) for entry in flips],
        "warnings": _same_dump(dump_a, dump_b)
        + dump_a.warnings()
        + dump_b.warnings()
        + filtered
        + _row_warnings(alignment, unpaired_cached, ia, dump_a.label, dump_b.label),
    }
    result["summary"] = summarize(result)
    return result


def pair_names(side_a: Side, side_b: Side) -> Tuple[List[tuple], Optional[str], Dict[str, str], List[str]]:
    """The tensors both runs hold under one name, as (name, name on the test side, call, io); the
    error naming the modules that have no counterpart (None if every one has); the test side's
    tensors paired by role where their slot names differ (its name -> the reference's); and
    warnings on the modules one run has and the other's DUMPER_FILTER left out."""
    names_a, names_b = side_a.names(), side_b.names()
    by_call_a, by_call_b = _by_call(names_a), _by_call(names_b)
    renamed: Dict[str, str] = {}
    for call in sorted(set(by_call_a) & set(by_call_b)):
        for io in ("in", "out"):
            only_a = [
                n for n in by_call_a[call] if io_of(n) == io and n not in names_b and float_kind(names_a[n].dtype)
            ]
            only_b = [
                n for n in by_call_b[call] if io_of(n) == io and n not in names_a and float_kind(names_b[n].dtype)
            ]
            if len(only_a) == 1 and len(only_b) == 1:  # one float input (output) each: the same role
                renamed[only_b[0]] = only_a[0]
    compared = []
    for name, piece in names_a.items():
        partner = name if name in names_b else next((b for b, a in renamed.items() if a == name), None)
        if partner is not None and float_kind(piece.dtype) and float_kind(names_b[partner].dtype):
            compared.append((name, partner, call_of(name), io_of(name)))
    compared.sort(
        key=lambda c: (side_a.first.calls[c[2]].post if c[2] in side_a.first.calls else 0, c[3] == "out", c[0])
    )
    missing, filtered = [], []
    for side, other_side, other, label in (
        (side_a, side_b, by_call_b, "REFERENCE"),
        (side_b, side_a, by_call_a, "TEST"),
    ):
        mine = _by_call(side.names())
        hooked = dumped_by(other_side.dump.setting("filter"))
        left_out = []
        for call in sorted(set(mine) - set(other)):
            if call in side.first.leaves and any(float_kind(side.names()[n].dtype) for n in mine[call]):
                info = side.first.calls[call]
                if hooked(info.module):
                    missing.append(f"{info.source} [{info.cls}] of {label} ({show(side.dump.label)})")
                else:  # the other run's DUMPER_FILTER left it out: not a module without counterpart
                    left_out.append(info.source)
        if left_out:
            filtered.append(
                f"{plural(len(left_out), 'module')} of {show(side.dump.label)} ({_listed(left_out)}) left out of "
                f"{show(other_side.dump.label)} by its DUMPER_FILTER={other_side.dump.setting('filter')!r}: only the "
                "modules both runs dumped are compared"
            )
    if not missing:
        return compared, None, renamed, filtered
    return (
        compared,
        f"{plural(len(missing), 'module')} without counterpart in the other run: {_listed(missing)}; write a mapping file (--map "
        "FILE: rules that rename, split or ignore tensors, docs/compare.md)",
        renamed,
        filtered,
    )


def _listed(names: List[str]) -> str:
    return ", ".join(names[:MAX_LISTED]) + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def _by_call(names: Dict[str, Piece]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for name in names:
        out.setdefault(call_of(name), []).append(name)
    return out


def _sizes_resolver(side_a: Side, side_b: Side):
    """Widths of a fused tensor's parts on one rank: the rule's sizes, else those the dump
    recorded for its module (run.json "parts"), else the other run's widths of the same parts
    (held unfused, or fused with widths given or recorded), in proportion to this tensor's width."""
    cache: Dict[tuple, Tuple[int, ...]] = {}

    def given(piece: Piece, side: Side) -> Optional[Tuple[int, ...]]:
        recorded = (side.dump.run.get("parts") or {}).get(module_of(piece.call))
        return piece.sizes or (tuple(recorded) if recorded else None)

    def width_of(name: str, other_side: Side) -> Optional[int]:
        piece = other_side.names().get(name)
        if piece is None:
            return None
        if piece.part < 0:
            return piece.width
        sizes = given(piece, other_side)
        return sizes[piece.part] if sizes and len(sizes) == piece.parts else None

    def sizes_of(piece: Piece, side: Side) -> Tuple[int, ...]:
        if given(piece, side):
            return given(piece, side)
        key = (piece.tensor, piece.width)
        if key not in cache:
            parts = _parts_of(piece, side)
            other_side = side_b if side is side_a else side_a
            widths = [width_of(p, other_side) for p in parts]
            if None in widths or any(piece.width * w % sum(widths) for w in widths):
                raise DumpError(
                    f"cannot cut {piece.tensor} into {', '.join(parts)}: neither its dump's run.json records the widths "
                    "of its parts nor does the other run hold them unfused; give the widths on one rank with 'sizes' in a "
                    "mapping file (--map)"
                )
            cache[key] = tuple(piece.width * w // sum(widths) for w in widths)
        return cache[key]

    return sizes_of


def _parts_of(piece: Piece, side: Side) -> List[str]:
    """The names a fused tensor is cut into, in order."""
    return [n for _, n in sorted((p.part, n) for n, p in side.first.pieces.items() if p.tensor == piece.tensor)]


def _tensor_errors(compared, pairs, side_a: Side, side_b: Side, sizes_of, progress: bool):
    """Per compared tensor and sampled pair: (max |a - b|, max |a|) of the row, NaN where either
    run did not store it; the tensors that could not be compared, with why; their element types."""
    n = len(pairs)
    errors = np.full((len(compared), n, 2), np.nan)
    not_comparable, dtypes = [], {}
    groups: Dict[tuple, List[int]] = {}
    for i, key in enumerate(zip(pairs["pass_a"].tolist(), pairs["pass_b"].tolist())):
        groups.setdefault(key, []).append(i)
    row_a, row_b = pairs["row_a"], pairs["row_b"]
    uses = Counter(key for keys in groups for key in ((0, keys[0]), (1, keys[1])))
    whys: Dict[int, str] = {}
    for (pass_a, pass_b), at in sorted(groups.items()):  # pass by pass: a pass file is read once for all its tensors
        side_a.read_broadly(int(pass_a))
        side_b.read_broadly(int(pass_b))
        rows_a, rows_b = [int(row_a[i]) for i in at], [int(row_b[i]) for i in at]
        done: Dict[tuple, int] = {}  # what a tensor is read from on both sides -> the first compared so
        for t, (name, name_b, _, _) in enumerate(compared):
            if t in whys:
                continue
            source = (side_a.source_key(int(pass_a), name), side_b.source_key(int(pass_b), name_b))
            if None in source:
                continue
            if source in done:  # an alias (a call's output that is the next one's input): the same bits
                _same_as(t, done[source], at, compared, errors, dtypes, whys, side_a, side_b)
                continue
            done[source] = t
            got_a = side_a.values(int(pass_a), name, rows_a, sizes_of)
            got_b = side_b.values(int(pass_b), name_b, rows_b, sizes_of)
            if got_a is None or got_b is None:
                continue
            (ranks_a, type_a), (ranks_b, type_b) = got_a, got_b
            dtypes[name] = (type_a, type_b)
            va = side_a.join(name, ranks_a, ranks_b[0].shape[1] if len(ranks_b) == 1 else None)
            vb = side_b.join(name, ranks_b, ranks_a[0].shape[1] if len(ranks_a) == 1 else None)
            if va.shape != vb.shape:
                whys[t] = f"row widths differ ({va.shape[1]} and {vb.shape[1]})"
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.abs(va - vb)
                both = np.isfinite(va) & np.isfinite(vb)
                diff = np.where(both, diff, np.where(np.isnan(va) & np.isnan(vb) | (va == vb), 0.0, np.inf))
                errors[t, at, 0] = diff.max(axis=1, initial=0.0)
                errors[t, at, 1] = np.where(np.isfinite(va), np.abs(va), 0.0).max(axis=1, initial=0.0)
        for which, side, pass_id in ((0, side_a, pass_a), (1, side_b, pass_b)):
            uses[(which, pass_id)] -= 1
            if not uses[(which, pass_id)]:  # no group left that reads it: its file leaves the cache
                side.done_with(int(pass_id))
    for t, why in sorted(whys.items()):
        errors[t] = np.nan
        not_comparable.append({"tensor": compared[t][0], "why": why})
    return errors, not_comparable, dtypes


def _same_as(t: int, first: int, at, compared, errors, dtypes, whys, side_a: Side, side_b: Side) -> None:
    """Tensor ``t`` is read from what ``first`` was, on these rows: its figures are those."""
    name, first_name = compared[t][0], compared[first][0]
    if first in whys:
        whys[t] = whys[first]
        return
    if first_name in dtypes:
        errors[t, at] = errors[first, at]
        dtypes[name] = dtypes[first_name]
    for side in (side_a, side_b):
        if first_name in side.joined:
            side.joined[name] = side.joined[first_name]


def _call_errors(compared, errors, dtypes, side_a: Side, side_b: Side):
    """Per call (reference order): relative input and output errors [calls, rows], the epsilon
    of its precision, whether its output is a 4-byte float, and whether it takes integers only."""
    at_call: Dict[str, int] = {}
    for _, _, call, _ in compared:
        at_call.setdefault(call, len(at_call))
    calls = list(at_call)
    n = errors.shape[1]
    in_err, out_err = np.full((len(calls), n), np.nan), np.full((len(calls), n), np.nan)
    eps_of, wide = np.full(len(calls), eps(BY_NAME["float32"])), np.zeros(len(calls), bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        for t, (name, _, call, io) in enumerate(compared):
            if name not in dtypes or np.isnan(errors[t, :, 0]).all():
                continue
            c = at_call[call]
            absolute, magnitude = errors[t, :, 0], errors[t, :, 1]
            types = [BY_NAME[d] for d in dtypes[name]]
            typical = np.nanmedian(magnitude) if np.isfinite(magnitude).any() else 0.0
            rel = absolute / np.maximum(np.fmax(magnitude, typical), max(tiny(d) for d in types))
            rel = np.where(absolute == 0, 0.0, rel)
            target = in_err if io == "in" else out_err
            target[c] = np.fmax(target[c], rel)
            if io == "out":
                eps_of[c] = max(eps_of[c], *(eps(d) for d in types))
                wide[c] = all(d.size >= 4 for d in types)
    integer_only = _integer_input_calls(side_a)
    int_only = np.array([call in integer_only for call in calls], dtype=bool)
    keep = ~np.isnan(out_err).all(axis=1)
    kept = [c for c, k in zip(calls, keep) if k]
    return kept, in_err[keep], out_err[keep], eps_of[keep], wide[keep], int_only[keep]


def _integer_input_calls(side: Side) -> set:
    """The calls whose inputs on this side are all integers (token ids, positions)."""
    floats: Dict[str, bool] = {}
    for name, piece in side.names().items():
        if io_of(name) == "in":
            call = call_of(name)
            floats[call] = floats.get(call, False) or float_kind(piece.dtype)
    return {call for call, any_float in floats.items() if not any_float}


def _fill_missing_inputs(in_err: np.ndarray, out_err: np.ndarray, int_only: np.ndarray) -> np.ndarray:
    """A call whose inputs were not compared, or are integers only (token ids, positions: the
    proof checked them), is judged against the largest error of any call before it on the row
    (0 for the first: the embedding)."""
    filled = in_err.copy()
    before = np.zeros(out_err.shape[1])
    for c in range(len(in_err)):
        missing = (np.isnan(in_err[c]) | int_only[c]) & np.isfinite(out_err[c])
        filled[c] = np.where(missing, before, in_err[c])
        before = np.fmax(before, np.nan_to_num(out_err[c], nan=0.0))
    return filled


def _describe_call(call: str, side_a: Side, side_b: Side) -> dict:
    info_a, info_b = side_a.first.calls.get(call), side_b.first.calls.get(call)
    return {
        "module": (info_a or info_b).module,
        "cls": info_a.cls if info_a else "",
        "cls_b": info_b.cls if info_b else "",
        "source_b": info_b.source if info_b else call,
    }


def _row_refs(pairs) -> List[dict]:
    return [
        {"seq": str(seq), "pos": int(pos), "kind": str(mode)}
        for seq, pos, mode in zip(pairs["seq"].tolist(), pairs["pos"].tolist(), pairs["mode_b"].tolist())
    ]


def _op(judged: dict, info: dict, rows: List[dict], compared, kind: str = "op") -> dict:
    outputs = [name_b for name, name_b, call, io in compared if call == judged["call"] and io == "out"]
    return {
        "kind": kind,
        "call": judged["call"],
        "after": judged.get("after"),
        "module": info["module"],
        "cls": info["cls"],
        "cls_b": info["cls_b"],
        "source_b": info["source_b"],
        "outputs_b": outputs,
        "rows": judged["rows"],
        "rows_over": judged["rows_over"],
        "over": judged["over"],
        "row": rows[judged["worst"]],
        "jump": judged["jump"],
        "line": judged["line"],
        "line_from": judged["line_from"],
        "in_eps": judged["in_eps"],
        "out_eps": judged["out_eps"],
        "max_out_eps": judged["max_out_eps"],
        "eps": judged["eps"],
    }


def _flip(entry: dict, rows: List[dict]) -> dict:
    examples = [
        {**rows[e["pair"]], "experts_a": e["experts_a"], "experts_b": e["experts_b"]} for e in entry["examples"]
    ]
    return {**{k: v for k, v in entry.items() if k != "examples"}, "examples": examples}


def _place(op: dict) -> str:
    """An op's call, or where code not compared sits: 'code not compared between A and B'."""
    if op["kind"] == "op":
        return op["call"]
    return f"code not compared between {op['after']} and {op['call']}" if op["after"] else f"code before {op['call']}"


def _first_difference(calls, in_err, out_err, info, rows) -> Optional[dict]:
    """Where both runs hold one element type: the first call whose compared inputs are
    bit-identical on a row and whose output is not (where the two runs' kernels first differ)."""
    for c, call in enumerate(calls):
        hit = np.nonzero((in_err[c] == 0) & (out_err[c] > 0))[0]
        if len(hit):
            return {
                "call": call,
                "cls": info[call]["cls"],
                "cls_b": info[call]["cls_b"],
                "rows": int(len(hit)),
                "row": rows[int(hit[0])],
            }
    return None


def _shard_notes(side: Side) -> List[str]:
    if len(side.ranks) < 2:
        return []
    notes = []
    for how, said in (("shards", "joined from their shards in rank order"), ("sum", "summed from partial sums")):
        names = sorted(n for n, h in side.joined.items() if h == how)
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            notes.append(f"{plural(len(names), 'tensor')} {said} ({shown})")
    return [
        f"{show(side.dump.label)}: {len(side.ranks)} ranks; "
        + "; ".join(notes + [f"the others held whole by every rank (read from rank {side.ranks[0]})"])
    ]


def _check_ranks_held(dump_a, dump_b) -> None:
    """A tensor-parallel run's shards are joined from every rank: a dump that lacks some of its
    ranks (a folder lost in a copy) would pass a shard off as the whole tensor, a partial sum
    as the sum. Runs of one tp size holding the same ranks are compared rank by rank: exact."""
    for dump, other in ((dump_a, dump_b), (dump_b, dump_a)):
        tp, held = dump.run.get("tp_size"), sorted(dump.ranks)
        alike = tp == other.run.get("tp_size") and held == sorted(other.ranks)
        if isinstance(tp, int) and len(held) < tp and not alike:
            raise DumpError(
                f"{show(dump.label)} was dumped at tp_size {tp} but holds {plural(len(held), 'rank')} {held}: its shards "
                f"cannot be joined; copy every rank's folder (rank0 .. rank{tp - 1}) of the run"
            )


def _same_dump(dump_a, dump_b) -> List[str]:
    if os.path.realpath(dump_a.path) != os.path.realpath(dump_b.path):
        return []
    return [f"both arguments are the same dump ({show(dump_a.label)}): it is compared with itself"]


def _row_warnings(alignment, unpaired_cached: int, ia, label_a: str, label_b: str) -> List[str]:
    """The token rows of either run the other has no partner for, in words."""
    notes = []
    if alignment.unaligned_b:
        notes.append(
            f"{plural(alignment.unaligned_b, 'token row')} of {show(label_b)} without partner in the reference"
            + (f" ({unpaired_cached} of them decode or extend rows)" if unpaired_cached else "")
            + ": the runs generated other tokens from there on, or the reference lacks those prompts; they are not "
            "compared (dump both runs as one prefill of the same token ids to compare every row)"
        )
    tokens = ia.cols("tokens")
    rows_a = int(np.count_nonzero(tokens["valid"]))
    paired_a = len(set(zip(alignment.cols["pass_a"].tolist(), alignment.cols["row_a"].tolist())))
    if rows_a > paired_a:
        notes.append(
            f"{plural(rows_a - paired_a, 'token row')} of {show(label_a)} (the reference) without partner in "
            f"{show(label_b)}: its prompts are longer or other, or it generated other or more tokens; they are not "
            "compared"
        )
    return notes


def summarize(result: dict) -> str:
    precision = result["precision"]
    kinds = (
        f"{precision['test']} against {precision['reference']}"
        if precision["test"] != precision["reference"]
        else f"both {precision['test']}"
    )
    most = result["adds_most"]
    most_text = (
        f"the op that adds the most is {most['call']} ({_fmt(most['jump'])}x what came in, {_fmt(most['out_eps'])} "
        f"epsilons; its line {_fmt(most['line'])}x)"
        if most
        else "no op adds an error"
    )
    flips = sum(flip["rows_flipped"] for flip in result["routing_flips"])
    flip_text = (
        f" MoE routers chose other experts on {plural(flips, 'row')}: those rows of their blocks are not judged."
        if flips
        else ""
    )
    if result["first"]:
        first = result["first"]
        what = (
            f"{first['call']} ({first['cls'] or first['cls_b']}) strays beyond its precision"
            if first["kind"] == "op"
            else f"An error beyond precision is introduced in {_place(first)}"
        )
        return (
            f"{what} ({kinds}): it adds {_fmt(first['jump'])}x the error it was given, over its line of "
            f"{_fmt(first['line'])}x ({first['line_from']}), {_fmt(first['out_eps'])} epsilons on {first['rows_over']} "
            f"of {first['rows']} rows. It is the first of {len(result['culprits'])} such places: look there for a wrong "
            f"port, a planted bug or a kernel that loses precision. {most_text[0].upper()}{most_text[1:]}.{flip_text}"
        )
    return (
        f"No op strays beyond its precision ({kinds}): every op's error is what its inputs' error and its own "
        f"rounding explain; {most_text}.{flip_text}"
    )


def _fmt(value) -> str:
    if value is None:
        return "inf"
    return f"{value:.3g}"
