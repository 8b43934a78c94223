"""Indexing a small pass file: a decode step, hundreds of one-row tensors in a few MB.

Per-tensor Python work, not reading, is what such a pass costs. But the decode steps of a run
repeat one structure: the same calls, tensor names, shapes and byte offsets; only the token ids,
positions and tensor bytes change. What follows from the structure (each tensor's row plan,
where its kept rows lie in the file, which rows are hashed together, the index tables' columns
other than fingerprints and magnitudes) is a ``Structure``, made once and reused by every later
pass whose structure is equal (compared whole, never guessed from a hash). Such a pass then
costs one read of the file, one gather and one row_stats call per (dtype, row shape).
"""

from __future__ import annotations

import collections
import operator
import threading
from typing import Dict, Optional

import numpy as np

from .filelayout import FileLayout, layout_of_bytes, read_whole_file, usable_layout
from .fingerprint import row_stats
from .load import PassFile
from .passtables import pass_tables, stored_tensors
from .rowplan import holds_token_ids, may_hold_token_ids, pass_rows

REMEMBERED = 8  # structures kept: a run's prefill shapes, its decode step, other batch sizes
_known: "collections.deque" = collections.deque(maxlen=REMEMBERED)
_known_lock = threading.Lock()  # passes are indexed on two threads at once


def small_pass_tables(pf: PassFile, n_rows: int, valid: np.ndarray, on_bytes=None) -> Optional[Dict[str, dict]]:
    """The calls, tensors and rows tables of a small pass, or None when its header is not one
    this reader follows (then the caller reads it tensor by tensor, through safetensors)."""
    data = read_whole_file(pf.ref.path, pf.ref.nbytes)
    layout = layout_of_bytes(data)
    if layout is None:
        return None
    entries = layout.tensor_entries()
    meta = pf.meta
    key = (len(data), n_rows, valid.tobytes(), tuple(meta.get("last_rows") or ()), tuple(meta.get("kept_rows") or ()))
    structure = _recall(meta["calls"], key, entries)
    if structure is None:
        structure = Structure.of(pf, layout, n_rows, valid)
        if structure is None:
            return None
        structure.calls, structure.key, structure.entries = meta["calls"], key, entries
        with _known_lock:
            _known.append(structure)
    if on_bytes:
        on_bytes(structure.tensor_bytes)
    return structure.tables(data, meta["tokens"]["ids"])


def _recall(calls: list, key: tuple, entries: dict) -> Optional["Structure"]:
    # Each call is the very object of an earlier pass when load.meta_problem found it equal to
    # one: identity tests, then the cheap key, then the header entries, compared whole.
    with _known_lock:
        known = list(_known)
    return next((s for s in reversed(known) if len(s.calls) == len(calls) and all(map(operator.is_, s.calls, calls))
                 and s.key == key and s.entries == entries), None)


class Structure:
    """What indexing a pass of one structure needs besides the bytes."""

    calls: list
    key: tuple
    entries: dict

    @classmethod
    def of(cls, pf: PassFile, layout: FileLayout, n_rows: int, valid: np.ndarray) -> Optional["Structure"]:
        tensor_metas, stored_names = stored_tensors(pf)
        if usable_layout(pf, stored_names, layout) is None:
            return None
        return cls(pf, layout, tensor_metas, stored_names, n_rows, valid)

    def __init__(self, pf: PassFile, layout: FileLayout, tensor_metas: dict, stored_names: list, n_rows: int,
                 valid: np.ndarray):
        groups: Dict[tuple, dict] = {}  # (dtype, row shape) -> rows hashed together
        placed = {}  # stored name -> (its group, first row in the group, rows)
        self.tensor_bytes = 0
        self._id_candidates = []  # (stored name, plan, dtype, begin, end): may hold the token ids
        plans = {}
        row_plans = pass_rows(pf.meta, n_rows, valid)
        for stored in stored_names:
            dtype, shape, begin, end = layout.get(stored)
            plan = plans[stored] = row_plans.plan(pf.ref.path, stored, tensor_metas[stored], shape)
            self.tensor_bytes += end - begin
            group = groups.setdefault((dtype.name, plan.view_shape[1:]), {
                "dtype": dtype, "row_shape": plan.view_shape[1:], "pieces": [], "rows": 0})
            placed[stored] = (group, group["rows"], len(plan.srow))
            group["rows"] += len(plan.srow)
            if plan.contiguous:
                group["pieces"].extend(plan.byte_runs(begin, dtype))
            else:
                group["pieces"].append(plan.byte_index(begin, dtype))
            if may_hold_token_ids(plan, dtype):
                self._id_candidates.append((stored, plan, dtype, begin, end))
        self._groups = list(groups.values())
        first = 0
        for group in self._groups:  # rows are hashed group after group: each group's first row
            group["first"], first = first, first + group["rows"]
        # The tables, with each row's place in the hashed order where its fingerprint will go.
        stored_rows = {}
        for stored, (group, offset, count) in placed.items():
            plan = plans[stored]
            rest = tuple(s for s in plan.view_shape[1:] if s != 1)
            stored_rows[stored] = ({
                "row": plan.kept_rows, "fp": np.arange(count, dtype=np.int64) + group["first"] + offset,
                "rowshape": f"{group['dtype'].name}{list(rest)}", "amax": np.zeros(count),
                "nonfinite": np.zeros(count, np.int32), "srow": plan.srow.astype(np.int32)}, plan.why, False)
        self._tables = pass_tables(pf.meta["calls"], tensor_metas, stored_rows)
        self._order = self._tables["rows"]["fp"]  # the hashed row of each rows-table row
        stored_column = self._tables["tensors"]["stored"]
        self._id_rows = {name: [i for i, s in enumerate(stored_column) if s == name] for name, *_ in self._id_candidates}

    def tables(self, data: np.ndarray, token_ids: list) -> Dict[str, dict]:
        """This structure's tables for one pass file's bytes."""
        fps, amaxes, nonfinites = [], [], []
        for group in self._groups:
            dtype, row_shape, pieces = group["dtype"], group["row_shape"], group["pieces"]
            parts = [data[p[0]:p[1]] if type(p) is tuple else data[p] for p in pieces]
            joined = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
            rows = joined.view(dtype.bits).reshape((group["rows"],) + row_shape)
            fp, amax, nonfinite = row_stats(rows, dtype)
            fps.append(fp)
            amaxes.append(np.full(len(fp), np.nan) if amax is None else amax)
            nonfinites.append(nonfinite)
        order = self._order
        tables = {name: dict(columns) for name, columns in self._tables.items()}
        rows = tables["rows"]
        rows["fp"] = np.concatenate(fps).view(np.int64)[order] if fps else order
        rows["amax"] = np.concatenate(amaxes)[order] if amaxes else rows["amax"]
        rows["nonfinite"] = np.concatenate(nonfinites)[order] if nonfinites else rows["nonfinite"]
        is_ids = tables["tensors"]["is_ids"] = tables["tensors"]["is_ids"].copy()
        for stored, plan, dtype, begin, end in self._id_candidates:
            view = plan.rows(data[begin:end].view(dtype.bits).reshape(plan.shape))
            if holds_token_ids(plan, view, dtype, token_ids):
                is_ids[self._id_rows[stored]] = True
        return tables
