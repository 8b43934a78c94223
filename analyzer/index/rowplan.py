"""Which rows of a stored tensor the index holds, and how they lie in its bytes.

A tensor's token dims are moved to the front and flattened into rows (one per token row of the
pass); rows of padding tokens are dropped; a tensor without token rows is one row. All of that
follows from the metadata and the shape alone, so a plan is made once per tensor shape and
reused for every decode step of the same structure (analyzer/index/smallpass.py).
"""

from __future__ import annotations

import collections
import math
import threading
from typing import List, Optional

import numpy as np

from ..dump.dtypes import DType
from ..dump.load import show
from ..errors import DumpError


def token_rows_of(tmeta: dict, meta: dict, n_rows: int) -> Optional[List[int]]:
    """Which token row each stored row of a tensor belongs to; None if it has no token rows."""
    if tmeta.get("token_dims") is None:
        return None
    if tmeta.get("selected"):
        return list(meta.get("kept_rows") or [])
    if tmeta.get("rows") == "last":
        return list(meta.get("last_rows") or [])
    return list(range(n_rows))


def stored_row_view(tensor: np.ndarray, tmeta: dict) -> np.ndarray:
    """The stored tensor as [rows, ...]: token dims moved to the front and flattened."""
    if tmeta.get("selected"):
        return tensor
    dims = tmeta["token_dims"]
    k = len(dims)
    # token dims lead (every HF and sglang activation): a reshape, no moveaxis
    moved = tensor if dims == list(range(k)) else np.moveaxis(tensor, dims, list(range(k)))
    return moved.reshape((math.prod(moved.shape[:k]),) + tuple(moved.shape[k:]))  # not -1: a size can be 0


def rows_lie_in_order(tmeta: dict) -> bool:
    """Whether a tensor's token rows are consecutive runs of its bytes: no token dims, rows
    already selected, or token dims that lead (no moveaxis)."""
    dims = tmeta.get("token_dims")
    return dims is None or bool(tmeta.get("selected")) or dims == list(range(len(dims)))


def _view_shape(shape: List[int], tmeta: dict) -> tuple:
    """stored_row_view's shape, from the tensor's shape alone."""
    if tmeta.get("selected"):
        return tuple(shape)
    dims = tmeta["token_dims"]
    rest = [s for d, s in enumerate(shape) if d not in dims]
    return (math.prod(shape[d] for d in dims),) + tuple(rest)


class RowPlan:
    """The kept rows of one tensor: ``rows(tensor)`` gives them as [kept, ...]."""

    def __init__(self, tmeta: dict, meta: dict, n_rows: int, valid: np.ndarray, shape: tuple) -> None:
        self.shape = shape
        self._view_meta = {
            "token_dims": tmeta.get("token_dims"),
            "selected": tmeta.get("selected"),
        }  # for stored_row_view
        token_rows = token_rows_of(tmeta, meta, n_rows)
        self.why = None
        if token_rows is not None:
            self.view_shape = _view_shape(shape, tmeta)
            if self.view_shape[0] != len(token_rows):
                token_rows, self.why = None, f"{self.view_shape[0]} rows where the pass has {len(token_rows)}"
        self.by_token = token_rows is not None  # False: the whole tensor is one row
        if not self.by_token:
            self.view_shape, token_rows = (1,) + self.shape, [-1]
        self.rest = tuple(s for s in self.view_shape[1:] if s != 1)  # a row's shape, unit dims left out
        rows_of = np.asarray(token_rows, dtype=np.int64)
        keep = (rows_of < 0) | valid[np.clip(rows_of, 0, None)] if len(valid) else rows_of < 0
        self.srow = np.nonzero(keep)[0]  # stored rows kept
        self.all_kept = bool(keep.all())
        self.kept_rows = rows_of[self.srow].astype(np.int32)  # their token rows (-1: no token rows)
        self.contiguous = not self.by_token or rows_lie_in_order(tmeta)

    def row_shape_text(self, kind: str) -> str:
        """The rows table's ``rowshape`` of these rows holding elements of type ``kind``."""
        return f"{kind}{list(self.rest)}"

    def rows(self, tensor: np.ndarray) -> np.ndarray:
        view = stored_row_view(tensor, self._view_meta) if self.by_token else tensor.reshape(self.view_shape)
        return view if self.all_kept else view[self.srow]

    def byte_runs(self, begin: int, dtype: DType) -> List[tuple]:
        """(first, end) byte ranges of the kept rows, in row order, for a tensor stored from byte
        ``begin``; rows that follow each other in the file are one range."""
        width = math.prod(self.view_shape[1:]) * dtype.size
        if self.all_kept:
            return [(begin, begin + len(self.srow) * width)]
        runs: List[list] = []
        for row in self.srow.tolist():
            first = begin + row * width
            if runs and runs[-1][1] == first:
                runs[-1][1] = first + width
            else:
                runs.append([first, first + width])
        return [tuple(run) for run in runs]

    def row_offsets(self, begin: Optional[int], dtype: DType) -> np.ndarray:
        """The file offset of each kept row's first byte, for a tensor stored from byte ``begin``;
        -1 where a row is not one byte range (token dims that do not lead) or ``begin`` is None.
        The index keeps them, so a reader slices rows out of plain reads without the header."""
        if begin is None or not self.contiguous:
            return np.full(len(self.srow), -1, dtype=np.int64)
        if not self.by_token:
            return np.full(len(self.srow), begin, dtype=np.int64)
        width = math.prod(self.view_shape[1:]) * dtype.size
        return begin + self.srow.astype(np.int64) * width

    def byte_index(self, begin: int, dtype: DType) -> np.ndarray:
        """The file offset of every byte of the kept rows, in row order (rows not contiguous)."""
        elements = np.arange(math.prod(self.shape), dtype=np.int64).reshape(self.shape)
        order = self.rows(elements).reshape(-1)
        return (begin + order[:, None] * dtype.size + np.arange(dtype.size)).reshape(-1)


class PassRows:
    """The token rows of a pass, and the row plans of its tensors: passes with the same token
    rows (the decode steps of a batch) share one, so a plan is made once per tensor shape."""

    def __init__(self, meta: dict, n_rows: int, valid: np.ndarray, key: tuple) -> None:
        self._meta, self._n_rows, self._valid = meta, n_rows, valid
        self.key = key  # what the token rows are: equal keys, equal plans
        self._plans = {}

    def plan(self, path: str, stored: str, tmeta: dict, shape) -> RowPlan:
        if list(shape) != list(tmeta["shape"]) and not tmeta.get("selected"):
            raise DumpError(
                f"{show(path)}: tensor {stored!r} has shape {list(shape)}, metadata says "
                f"{tmeta['shape']}; the file is damaged"
            )
        dims = tmeta.get("token_dims")
        key = (tuple(shape), None if dims is None else tuple(dims), tmeta.get("rows"), bool(tmeta.get("selected")))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = RowPlan(tmeta, self._meta, self._n_rows, self._valid, tuple(shape))
        return plan


_pass_rows: "collections.OrderedDict" = collections.OrderedDict()
_pass_rows_lock = threading.Lock()


def pass_rows(meta: dict, n_rows: int, valid: np.ndarray) -> PassRows:
    """The PassRows of a pass's token rows, shared with earlier passes that had the same."""
    key = (n_rows, valid.tobytes(), tuple(meta.get("last_rows") or ()), tuple(meta.get("kept_rows") or ()))
    with _pass_rows_lock:
        known = _pass_rows.get(key)
        if known is None:
            known = _pass_rows[key] = PassRows(meta, n_rows, valid, key)
            while len(_pass_rows) > 8:
                _pass_rows.popitem(last=False)
        return known


def row_columns(plan: RowPlan, view: np.ndarray, dtype: DType, stats, token_ids, begin: Optional[int]) -> tuple:
    """(row columns, why, is_ids) of one tensor from its kept rows and their row_stats; ``begin``:
    its first byte in the pass file (None: not known)."""
    fps, amax, nonfinite = stats  # fingerprints, max |x|, inf/nan
    if amax is None:
        amax = np.full(len(fps), np.nan)
    columns = {
        "row": plan.kept_rows,
        "fp": fps.view(np.int64),
        "rowshape": plan.row_shape_text(dtype.name),
        "amax": amax,
        "nonfinite": nonfinite,
        "srow": plan.srow.astype(np.int32),
        "offset": plan.row_offsets(begin, dtype),
    }
    return columns, plan.why, holds_token_ids(plan, view, dtype, token_ids)


def may_hold_token_ids(plan: RowPlan, dtype: DType) -> bool:
    """Whether the tensor could be the pass's token ids (an integer per token row), by shape alone."""
    return plan.why is None and plan.by_token and dtype.kind == "int" and len(plan.rest) == 0


def holds_token_ids(plan: RowPlan, view: np.ndarray, dtype: DType, token_ids) -> bool:
    """Whether the kept rows hold the pass's token ids: the token-ids tensor, under any name."""
    return bool(
        may_hold_token_ids(plan, dtype)
        and view.size == len(plan.kept_rows)
        and np.array_equal(view.reshape(-1).view(dtype.native).astype(np.int64), np.asarray(token_ids)[plan.kept_rows])
    )
