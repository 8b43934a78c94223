"""Indexing a small pass file: a decode step, hundreds of one-row tensors in a few MB.

Per-tensor Python work, not reading, is what such a pass costs. But the decode steps of a run
repeat one structure: the same calls, tensor names, dtypes and shapes; only token ids,
positions, tensor bytes and (as the metadata's length changes) byte offsets differ. What
follows from the structure (each tensor's row plan, where its kept rows lie relative to the
tensor, which rows are hashed together, the index tables' columns other than fingerprints and
magnitudes) is a ``Structure``, made once and reused by every later pass whose structure is
equal (compared call by call and tensor by tensor, never guessed from a hash). Such a pass then
costs one read, one gather and one row_stats call per (dtype, row shape).

A few tensors may change shape every step (an attention mask that grows by one column): once
seen changing, they become the structure's *volatile* tensors, planned and hashed pass by pass,
while the rest keeps the shared plan.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Dict, List, Optional, Set

import numpy as np

from ..dump.layout import FileLayout, layout_of_bytes, read_whole_file, usable_layout
from ..dump.load import PassFile
from . import arrow as arrowbuild
from .fingerprint import row_stats
from .passtables import json_ints, pass_tables, stored_tensors
from .rowplan import PassRows, holds_token_ids, may_hold_token_ids, pass_rows, rows_lie_in_order

REMEMBERED = 8  # structures kept: a run's prefill shapes, its decode step, other batch sizes
MAX_VOLATILE = 16  # more tensors than this changing shape: not one structure
_known: "collections.deque" = collections.deque(maxlen=REMEMBERED)
_known_lock = threading.Lock()  # passes are indexed on two threads at once


def small_pass_tables(pf: PassFile, n_rows: int, valid: np.ndarray, on_bytes=None) -> Optional[Dict[str, dict]]:
    """The calls, tensors and rows tables of a small pass, or None when its header is not one
    this reader follows (then the caller reads it tensor by tensor, through safetensors)."""
    data = pf.data if pf.data is not None else read_whole_file(pf.ref.path, pf.ref.nbytes)
    layout = pf.layout or layout_of_bytes(data)
    if layout is None:
        return None
    row_plans = pass_rows(pf.meta, n_rows, valid)
    found = None
    structure, changed = _recall(pf.meta["calls"], row_plans.key, layout)
    if structure is not None and not changed:
        found = structure.tables(data, layout, pf, row_plans)  # None: a volatile tensor's rows changed too
    if found is None:
        volatile = structure.volatile | changed if structure is not None else frozenset()
        structure = Structure.of(pf, layout, row_plans, volatile if len(volatile) <= MAX_VOLATILE else frozenset())
        if structure is None:
            return None
        with _known_lock:
            _known.append(structure)
        found = structure.tables(data, layout, pf, row_plans)
    tables, tensor_bytes = found
    if on_bytes:
        on_bytes(tensor_bytes)
    return tables


def _recall(calls: list, key: tuple, layout: FileLayout):
    """(a remembered structure this pass has, the stored tensors whose shape differs from it
    and are not yet volatile in it), or (None, None)."""
    with _known_lock:
        known = list(_known)
    for structure in reversed(known):
        if structure.key == key and len(structure.calls) == len(calls):
            changed = structure.changed_tensors(calls, layout)
            if changed is not None:
                return structure, changed - structure.volatile
    return None, None


def _shape_changes(old: dict, new: dict) -> Optional[Set[str]]:
    """Names of the tensors whose shape alone differs between two calls; None when anything
    else does. A call whose text repeats an earlier pass's is that pass's very object
    (analyzer/dump/meta.py), so most calls are skipped by an identity test."""
    if old.keys() != new.keys() or any(old[k] != new[k] for k in old if k != "tensors"):
        return None
    before, after = old["tensors"], new["tensors"]
    if list(before) != list(after):
        return None
    changed = set()
    for name, tmeta in before.items():
        other = after[name]
        if tmeta != other:
            if tmeta.keys() != other.keys() or any(tmeta[k] != other[k] for k in tmeta if k != "shape"):
                return None
            changed.add(name)
    return changed


class Structure:
    """What indexing a pass of one structure needs besides the bytes."""

    @classmethod
    def of(
        cls, pf: PassFile, layout: FileLayout, row_plans: PassRows, volatile: frozenset = frozenset()
    ) -> Optional["Structure"]:
        tensor_metas, stored_names = stored_tensors(pf)
        if usable_layout(pf, stored_names, layout) is None or any(
            _large_and_scattered(layout, name, tensor_metas[name]) for name in stored_names
        ):
            return None
        return cls(pf, layout, tensor_metas, stored_names, row_plans, volatile)

    def __init__(
        self,
        pf: PassFile,
        layout: FileLayout,
        tensor_metas: dict,
        stored_names: list,
        row_plans: PassRows,
        volatile: frozenset,
    ) -> None:
        self.calls = pf.meta["calls"]
        self.key = row_plans.key
        self._header = layout.header  # a later file whose entries text repeats this one's shares it
        self._offsets = None  # each stored tensor's first byte from the data start, once checked
        self.volatile = volatile & set(stored_names)
        self._stored = stored_names
        self._facts = []  # per stored tensor: (header dtype code, header shape, bytes); shape None if volatile
        groups: Dict[tuple, dict] = {}  # (dtype, row shape) -> rows hashed together
        placed = {}  # stored name -> (first row in the hashed order, or its group and the first row in it)
        self._volatile = []  # (stored number, name, rows, why, by_token): planned and hashed per pass
        self._id_candidates = []  # (stored number, plan, dtype): may hold the token ids
        plans = {}
        for j, stored in enumerate(stored_names):
            dtype, shape, begin, end = layout.get(stored)
            entry = layout.header[stored]
            plan = plans[stored] = row_plans.plan(pf.ref.path, stored, tensor_metas[stored], shape)
            if stored in self.volatile:
                self._facts.append((entry["dtype"], None, None))
                self._volatile.append((j, stored, len(plan.srow), plan.why, plan.by_token))
                continue
            self._facts.append((entry["dtype"], entry["shape"], end - begin))
            group = groups.setdefault(
                (dtype.name, plan.view_shape[1:]),
                {"dtype": dtype, "row_shape": plan.view_shape[1:], "pieces": [], "rows": 0},
            )
            placed[stored] = (group, group["rows"])
            group["rows"] += len(plan.srow)
            # where the kept rows lie, from the tensor's first byte
            if plan.contiguous:
                group["pieces"].extend((j, a, b) for a, b in plan.byte_runs(0, dtype))
            else:
                group["pieces"].append((j, plan.byte_index(0, dtype)))
            if may_hold_token_ids(plan, dtype):
                self._id_candidates.append((j, plan, dtype))
        self._groups = list(groups.values())
        self._fixed_bytes = sum(size for _, _, size in self._facts if size is not None)
        first = 0
        for group in self._groups:  # rows are hashed group after group, then the volatile tensors
            group["first"], first = first, first + group["rows"]
        stored_rows = {}
        for stored, plan in plans.items():
            if stored in placed:
                group, offset = placed[stored]
                start, kind = group["first"] + offset, group["dtype"].name
                within = plan.row_offsets(0, group["dtype"])  # from the tensor's first byte, in every pass
            else:  # volatile: its rows' width may change from pass to pass (set per pass)
                start, kind, first = first, layout.get(stored)[0].name, first + len(plan.srow)
                within = plan.row_offsets(None, layout.get(stored)[0])
            count = len(plan.srow)
            stored_rows[stored] = (
                {
                    "row": plan.kept_rows,
                    "fp": np.arange(count, dtype=np.int64) + start,
                    "rowshape": plan.row_shape_text(kind),
                    "amax": np.zeros(count),
                    "nonfinite": np.zeros(count, np.int32),
                    "srow": plan.srow.astype(np.int32),
                    "offset": within,
                },
                plan.why,
                False,
            )
        self._tables = pass_tables(self.calls, tensor_metas, stored_rows)
        self._order = self._tables["rows"]["fp"]  # the hashed row of each rows-table row
        # Per tensors-table row (one per tensor name; the rows table's parts, in the same order):
        # its name and stored tensor.
        tensors = self._tables["tensors"]
        names, stored_of = arrowbuild.decoded(tensors["tensor"]), arrowbuild.decoded(tensors["stored"])
        self._rows_of = collections.defaultdict(list)  # stored name -> its tensors-table positions
        for i, stored in enumerate(stored_of):
            self._rows_of[stored].append(i)
        self._shape_texts = arrowbuild.decoded(tensors["shape"])
        self._volatile_names = [
            (i, name) for i, (name, stored) in enumerate(zip(names, stored_of)) if stored in self.volatile
        ]
        self._part_shapes = [stored_rows[stored][0]["rowshape"] for stored in stored_of]
        self._part_lengths = np.array([len(stored_rows[stored][0]["row"]) for stored in stored_of], dtype=np.int64)
        number = {stored: j for j, stored in enumerate(stored_names)}
        # Per rows-table row: its stored tensor's number and where the row lies from that tensor's first byte
        self._row_stored = np.repeat(np.array([number[s] for s in stored_of], dtype=np.int64), self._part_lengths)
        self._row_within = self._tables["rows"]["offset"]
        self._part_starts = np.cumsum(self._part_lengths) - self._part_lengths

    def changed_tensors(self, calls: list, layout: FileLayout) -> Optional[Set[str]]:
        """The stored tensors whose shape differs in a pass with these calls and header, or None
        when the pass's structure differs in anything else."""
        changed_names: Set[str] = set()
        for old, new in zip(self.calls, calls):
            if old is not new:
                names = _shape_changes(old, new)
                if names is None:
                    return None
                changed_names |= names
        changed = set()
        if changed_names:
            stored_of = {name: tmeta.get("alias") or name for call in calls for name, tmeta in call["tensors"].items()}
            changed = {stored_of[name] for name in changed_names}
        header = layout.header
        if header is self._header:  # the very entries this structure was made from
            return changed
        for stored, (code, shape, _) in zip(self._stored, self._facts):
            entry = header.get(stored)
            if type(entry) is not dict or entry.get("dtype") != code:
                return None
            if shape is not None and entry.get("shape") != shape and stored not in changed:
                return None  # the header disagrees with the metadata: the full build says so
        return changed

    def tables(self, data: np.ndarray, layout: FileLayout, pf: PassFile, row_plans: PassRows):
        """(this structure's tables for one pass file, its tensor bytes), or None when its header
        does not place the tensors where this structure needs them (then a full build checks
        the file)."""
        meta = pf.meta
        begins = self._begins(layout)
        if begins is None:
            return None
        tensor_metas = (
            {name: tmeta for call in meta["calls"] for name, tmeta in call["tensors"].items()} if self._volatile else {}
        )
        volatile = self._volatile_rows(data, layout, pf.ref.path, tensor_metas, row_plans, begins)
        if volatile is None:
            return None
        fps, amaxes, nonfinites = [], [], []
        for group in self._groups:
            dtype, row_shape = group["dtype"], group["row_shape"]
            parts = [
                data[begins[p[0]] + p[1] : begins[p[0]] + p[2]] if len(p) == 3 else data[begins[p[0]] + p[1]]
                for p in group["pieces"]
            ]
            joined = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
            _add_stats(
                row_stats(joined.view(dtype.bits).reshape((group["rows"],) + row_shape), dtype), fps, amaxes, nonfinites
            )
        for stats in volatile["stats"]:
            _add_stats(stats, fps, amaxes, nonfinites)
        order = self._order
        tables = {name: dict(columns) for name, columns in self._tables.items()}
        rows, tensors = tables["rows"], tables["tensors"]
        rows["fp"] = np.concatenate(fps).view(np.int64)[order] if fps else order
        rows["amax"] = np.concatenate(amaxes)[order] if amaxes else rows["amax"]
        rows["nonfinite"] = np.concatenate(nonfinites)[order] if nonfinites else rows["nonfinite"]
        within = self._row_within
        rows["offset"] = np.where(within >= 0, np.asarray(begins, dtype=np.int64)[self._row_stored] + within, -1)
        for stored, offsets in volatile["offsets"].items():
            for i in self._rows_of[stored]:
                rows["offset"][self._part_starts[i] : self._part_starts[i] + len(offsets)] = offsets
        is_ids = tensors["is_ids"] = tensors["is_ids"].copy()
        token_ids = meta["tokens"]["ids"]
        for j, plan, dtype in self._id_candidates + volatile["id_candidates"]:
            begin = begins[j]
            view = plan.rows(
                data[begin : begin + math.prod(plan.shape) * dtype.size].view(dtype.bits).reshape(plan.shape)
            )
            if holds_token_ids(plan, view, dtype, token_ids):
                is_ids[self._rows_of[self._stored[j]]] = True
        if self._volatile_names:
            shapes = self._shape_texts.copy()
            for i, name in self._volatile_names:
                shapes[i] = json_ints(tensor_metas[name]["shape"])
            tensors["shape"] = arrowbuild.encoded(shapes)
            part_shapes = list(self._part_shapes)
            for i, text in volatile["row_shapes"].items():
                part_shapes[i] = text
            rows["rowshape"] = arrowbuild.dictionary(part_shapes, self._part_lengths)
        return tables, volatile["bytes"] + self._fixed_bytes

    def _begins(self, layout: FileLayout) -> Optional[List[int]]:
        """Each stored tensor's first byte in this file; None where the header places one where
        it does not fit the structure or the file."""
        header = layout.header
        if header is self._header and self._offsets is not None:
            return (self._offsets + (layout.file_size - layout.data_size)).tolist()
        try:
            offsets = np.array([header[name]["data_offsets"] for name in self._stored], dtype=np.int64).reshape(-1, 2)
        except (KeyError, TypeError, ValueError, OverflowError):
            return None
        sizes = np.array([b if b is not None else -1 for _, _, b in self._facts], dtype=np.int64)
        fixed = sizes >= 0
        if not (
            (offsets[:, 0] >= 0).all()
            and (offsets[fixed, 1] - offsets[fixed, 0] == sizes[fixed]).all()
            and (offsets[:, 1] >= offsets[:, 0]).all()
            and (offsets[:, 1] <= layout.data_size).all()
        ):
            return None
        if header is self._header:
            self._offsets = offsets[:, 0]
        return (offsets[:, 0] + (layout.file_size - layout.data_size)).tolist()

    def _volatile_rows(
        self,
        data: np.ndarray,
        layout: FileLayout,
        path: str,
        tensor_metas: dict,
        row_plans: PassRows,
        begins: List[int],
    ) -> Optional[dict]:
        """Row stats, row shape texts, token-id candidates and bytes of the volatile tensors, or
        None when one of them no longer has the rows the structure planned for."""
        found = {"stats": [], "row_shapes": {}, "id_candidates": [], "bytes": 0, "offsets": {}}
        for j, stored, count, why, by_token in self._volatile:
            entry = layout.get(stored)
            if entry is None or entry[2] != begins[j]:
                return None
            dtype, shape, begin, end = entry
            plan = row_plans.plan(path, stored, tensor_metas[stored], shape)
            if len(plan.srow) != count or plan.why != why or plan.by_token != by_token:
                return None
            view = plan.rows(data[begin:end].view(dtype.bits).reshape(shape))
            found["stats"].append(row_stats(view, dtype))
            found["offsets"][stored] = plan.row_offsets(begin, dtype)
            text = plan.row_shape_text(dtype.name)
            for i in self._rows_of[stored]:
                found["row_shapes"][i] = text
            if may_hold_token_ids(plan, dtype):
                found["id_candidates"].append((j, plan, dtype))
            found["bytes"] += end - begin
        return found


SCATTERED_BYTES = 1 << 20


def _large_and_scattered(layout: FileLayout, name: str, tmeta: dict) -> bool:
    """A tensor whose token dims do not lead ([B, heads, S, D]) is gathered byte by byte through
    an index 8x its size, kept with the structure: above SCATTERED_BYTES its pass is read
    tensor by tensor instead (a prefill, never repeated)."""
    dtype, shape, begin, end = layout.get(name)
    return not rows_lie_in_order(tmeta) and end - begin > SCATTERED_BYTES


def _add_stats(stats, fps: list, amaxes: list, nonfinites: list) -> None:
    fp, amax, nonfinite = stats
    fps.append(fp)
    amaxes.append(np.full(len(fp), np.nan) if amax is None else amax)
    nonfinites.append(nonfinite)
