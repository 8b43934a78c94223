"""What the strict verdict needs of each (pair, call) cell of a row table, from dense matrices.

A cell is a token-row pair and a hooked call of B with a tensor row on that pair. Per pair: the
first call (by completion time in B's pass) whose input or output differs, and the first whose
inputs are clean and output is not. Per call: how many rows it has, with a differing input, a
differing output, and a difference that arises in it. Cells whose (pass, call) B's calls table
lacks are left out, as everywhere in the verdict.

Pairs are taken in chunks, each a few (pairs x calls) boolean matrices: one pass over the row
table's entries, then reductions along the calls, with no list of cells, no sort and no join of
half a million cells against B's calls table: those took 40-60 ms of a 0.35-0.42 s strict verdict
on an H200 host.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Dict, List

import numpy as np

from ..index.columns import Columns, distinct

CHUNK_CELLS = 1 << 20  # pairs x calls per chunk at most: a few MB of matrices per thread
DENSE_CELLS = 8 << 20  # pairs (or passes) x calls up to which the matrices are used whatever the row table's size
NO_POST = np.iinfo(np.int64).max  # a cell without the flag asked for: after every real completion time
ABSENT = np.iinfo(np.int64).min  # a cell B's calls table lacks (a real post may be -1: a call never finished)


@dataclasses.dataclass
class CallCells:
    first_dirty: Columns  # by pair, for pairs with a differing row: pair, ccode, in_differ, post
    first_origin: Columns  # by pair, for pairs where a call has clean inputs and a differing output: pair, ccode, post
    counts: Dict[str, np.ndarray]  # per call code: rows, rows_in_differ, rows_out_differ, rows_origin
    dirty_calls: np.ndarray  # per call code: some row's input or output differs


def call_cells(table, posts: np.ndarray, slot_of_pair: np.ndarray, threads: int) -> CallCells:
    """``posts``: (B's passes x call codes) completion times, ABSENT where B's calls table lacks
    the cell; ``slot_of_pair``: each pair's row in it (-1: a pass B's calls table lacks)."""
    n_calls = max(len(table.calls), 1)
    n_pairs = len(slot_of_pair)
    step = max(min(CHUNK_CELLS // n_calls, -(-n_pairs // max(threads, 1))), 1)  # a chunk per thread at least
    bounds = np.searchsorted(table["pair"], np.arange(0, n_pairs + step, step))  # the table is ordered by pair
    chunks = [
        (lo, min(lo + step, n_pairs), int(bounds[k]), int(bounds[k + 1]))
        for k, lo in enumerate(range(0, n_pairs, step))
    ]
    with concurrent.futures.ThreadPoolExecutor(
        max(min(threads, len(chunks)), 1), thread_name_prefix="dumpdiff-calls"
    ) as pool:
        parts = list(pool.map(lambda chunk: _chunk(table, posts, slot_of_pair, n_calls, *chunk), chunks))
    counts = {
        name: np.zeros(len(table.calls), np.int64)
        for name in ("rows", "rows_in_differ", "rows_out_differ", "rows_origin")
    }
    dirty_calls = np.zeros(len(table.calls), bool)
    for part in parts:
        for name in counts:
            counts[name] += part["counts"][name][: len(table.calls)]
        dirty_calls |= part["dirty_calls"][: len(table.calls)]
    return CallCells(
        _joined([p["first_dirty"] for p in parts], ("pair", "ccode", "in_differ", "post")),
        _joined([p["first_origin"] for p in parts], ("pair", "ccode", "post")),
        counts,
        dirty_calls,
    )


def _chunk(table, posts: np.ndarray, slot_of_pair: np.ndarray, n_calls: int, lo: int, hi: int, start: int, stop: int):
    """The cells of pairs [lo, hi), whose entries are [start, stop) of the row table."""
    shape = (hi - lo, n_calls)
    entries = slice(start, stop)
    key = (table["pair"][entries] - lo).astype(np.int64) * n_calls + table["ccode"][entries]
    differ = table["differ"][entries]
    present, in_differ, out_differ = (np.zeros(shape[0] * n_calls, bool) for _ in range(3))
    present[key] = True
    in_differ[key[differ & table["is_in"][entries]]] = True
    out_differ[key[differ & table["is_out"][entries]]] = True
    slots = slot_of_pair[lo:hi]
    post = np.where((slots >= 0)[:, None], posts[np.maximum(slots, 0)], ABSENT)  # (pairs, calls)
    present = present.reshape(shape) & (post != ABSENT)
    in_differ = in_differ.reshape(shape) & present
    out_differ = out_differ.reshape(shape) & present
    dirty = in_differ | out_differ
    origin = out_differ & ~in_differ
    first_dirty = _first(dirty, post, lo)
    first_dirty["in_differ"] = in_differ[first_dirty["pair"] - lo, first_dirty["ccode"]]
    return {
        "first_dirty": first_dirty,
        "first_origin": _first(origin, post, lo),
        "counts": {
            "rows": present.sum(axis=0),
            "rows_in_differ": in_differ.sum(axis=0),
            "rows_out_differ": out_differ.sum(axis=0),
            "rows_origin": origin.sum(axis=0),
        },
        "dirty_calls": dirty.any(axis=0),
    }


def _first(mask: np.ndarray, post: np.ndarray, lo: int) -> Dict[str, np.ndarray]:
    """Per pair (row) with a flagged cell: the flagged call that completed first (of equal times,
    the lowest call code)."""
    rows = np.nonzero(mask.any(axis=1))[0]
    times = np.where(mask[rows], post[rows], NO_POST)
    ccode = times.argmin(axis=1)
    return {"pair": rows + lo, "ccode": ccode, "post": times[np.arange(len(rows)), ccode]}


def _joined(parts: List[Dict[str, np.ndarray]], names) -> Columns:
    return Columns({n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in names})


def posts_of_b(calls_b: Columns, call_names: np.ndarray, pass_of_pair: np.ndarray, n_entries: int):
    """(B's completion times as (passes x call codes), ABSENT where B's calls table lacks the cell;
    each pair's row in it, -1 for a pass it lacks); None where the matrices would be far larger
    than the row table (an MoE with tens of thousands of hooked experts): the verdict then walks a
    list of cells (``from_cells``). A (pass, call) held twice counts once, at its first completion."""
    n_calls = max(len(call_names), 1)
    codes_b, known = codes_of_calls(calls_b, call_names)
    passes = distinct(calls_b["pass"][known].astype(np.int64))
    cells = max(len(pass_of_pair), len(passes)) * n_calls
    if cells > max(DENSE_CELLS, 4 * n_entries):
        return None
    posts = np.full((max(len(passes), 1), n_calls), NO_POST, np.int64)  # a row even for none
    np.minimum.at(
        posts,
        (np.searchsorted(passes, calls_b["pass"][known].astype(np.int64)), codes_b[known]),
        calls_b["post"][known].astype(np.int64),
    )
    posts[posts == NO_POST] = ABSENT
    pass_of_pair = np.asarray(pass_of_pair, np.int64)
    if not len(passes):
        return posts, np.full(len(pass_of_pair), -1, np.int64)
    slot = np.minimum(np.searchsorted(passes, pass_of_pair), len(passes) - 1)
    return posts, np.where(passes[slot] == pass_of_pair, slot, -1)


def codes_of_calls(calls_b: Columns, call_names: np.ndarray):
    """(each entry of B's calls table: its call's code in ``call_names``, -1 for a call not there;
    the entries that have one). Worked on the table's own codes: a long decode run has tens of
    thousands of entries, a few hundred names."""
    code_of = {c: i for i, c in enumerate(call_names.tolist())}
    codes, names = calls_b.codes("call")
    codes_b = np.array([code_of.get(c, -1) for c in names.tolist()] or [-1], dtype=np.int64)[codes]
    return codes_b, np.nonzero(codes_b >= 0)[0]


def from_cells(per_call: Columns, n_calls: int) -> CallCells:
    """The same summary from a list of (pair, call) cells (pair, ccode, in_differ, out_differ,
    post; ordered by pair), for when the matrices would be too large."""
    in_d, out_d = per_call["in_differ"], per_call["out_differ"]
    ccode = per_call["ccode"]
    dirty, origin = in_d | out_d, out_d & ~in_d
    counts = {
        "rows": np.bincount(ccode, minlength=n_calls),
        "rows_in_differ": np.bincount(ccode[in_d], minlength=n_calls),
        "rows_out_differ": np.bincount(ccode[out_d], minlength=n_calls),
        "rows_origin": np.bincount(ccode[origin], minlength=n_calls),
    }
    dirty_calls = np.zeros(n_calls, bool)
    dirty_calls[ccode[dirty]] = True
    first_dirty = _first_of_list(per_call, dirty)
    return CallCells(
        Columns({n: first_dirty[n] for n in ("pair", "ccode", "in_differ", "post")}),
        Columns({n: v for n, v in _first_of_list(per_call, origin).items() if n != "in_differ"}),
        {k: v[:n_calls].astype(np.int64) for k, v in counts.items()},
        dirty_calls,
    )


def _first_of_list(per_call: Columns, mask: np.ndarray) -> Dict[str, np.ndarray]:
    """Of the chosen cells, the earliest completed of each pair (of equal times, the first listed), by pair."""
    chosen = np.nonzero(mask)[0]
    chosen = chosen[np.lexsort((per_call["post"][chosen], per_call["pair"][chosen]))]
    pair = per_call["pair"][chosen]
    chosen = chosen[np.r_[True, pair[1:] != pair[:-1]]] if len(chosen) else chosen
    return {n: per_call[n][chosen] for n in ("pair", "ccode", "in_differ", "post")}
