"""The calls, tensors and rows tables of one pass, from its metadata and each stored tensor's
row columns (rowplan.row_columns). Shared by the index build of large passes (tensor by tensor)
and of small ones (analyzer/index/smallpass.py, which builds them once per structure)."""

from __future__ import annotations

import functools
import json
from typing import Dict, List, Optional, Tuple

import numpy as np

from dumpdiff.dumper import format as fmt

from ..dump.load import PassFile, show
from ..errors import DumpError
from . import arrow as arrowbuild

# Text columns stored dictionary-encoded (the rows table's are built so): reading tens of
# thousands of tensor names of a long decode run back as strings one by one was most of a
# strict verdict's own time. The calls' and tensors' are encoded pass by pass (a structure's
# once, analyzer/index/smallpass.py), the tokens' when the tables are joined.
ENCODED = {
    "tokens": ("seq", "mode"),
    "calls": ("call", "module", "cls"),
    "tensors": ("tensor", "call", "io", "slot", "dtype", "shape", "token_dims", "stored"),
}


def stored_tensors(pf: PassFile) -> Tuple[Dict[str, dict], List[str]]:
    """(metadata of every tensor name, the stored tensors in call order): an alias names the
    tensor whose bytes it shares (a module's output that is the next one's input)."""
    tensor_metas = {name: tmeta for call in pf.meta["calls"] for name, tmeta in call["tensors"].items()}
    needed: Dict[str, None] = {}
    for call in pf.meta["calls"]:
        for name, tmeta in call["tensors"].items():
            stored = tmeta.get("alias") or name
            if stored not in tensor_metas:
                raise DumpError(
                    f"{show(pf.ref.path)}: {name!r} is an alias of {stored!r}, which the pass does not hold; "
                    "the file is damaged"
                )
            needed[stored] = None
    return tensor_metas, list(needed)


def pass_tables(calls: list, tensor_metas: dict, stored_rows: Dict[str, tuple]) -> Dict[str, dict]:
    """The calls, tensors and rows tables' columns; ``stored_rows``: stored name -> (row columns,
    why it has no token rows or None, whether it holds the pass's token ids)."""
    tables = {
        "calls": {
            "call": [c["call"] for c in calls],
            "module": [c["module"] for c in calls],
            "cls": [c["cls"] for c in calls],
            "pre": np.array([c["pre"] for c in calls], dtype=np.int64),
            "post": np.array(
                [c["post"] if c.get("post") is not None else -1 for c in calls], dtype=np.int64
            ),  # -1: never finished
            "skipped": [json.dumps(c["skipped"]) if c.get("skipped") else None for c in calls],
        }
    }
    keys = (
        "tensor",
        "call",
        "io",
        "slot",
        "dtype",
        "shape",
        "token_dims",
        "rows",
        "stored",
        "selected",
        "is_ids",
        "why",
    )
    tensors = {k: [] for k in keys}
    add = [tensors[k].append for k in keys]  # one loop step per tensor name: a decode pass has hundreds
    row_parts = []
    for call in calls:
        call_name = call["call"]
        for name, tmeta in call["tensors"].items():
            io, slot = _io_and_slot(name)
            stored = tmeta.get("alias") or name
            columns, row_why, is_ids = stored_rows[stored]
            for append, value in zip(
                add,
                (
                    name,
                    call_name,
                    io,
                    slot,
                    tmeta["dtype"],
                    json_ints(tmeta["shape"]),
                    json_ints(tmeta.get("token_dims")),
                    tmeta.get("rows"),
                    stored,
                    bool(tensor_metas[stored].get("selected", False)),
                    is_ids,
                    tmeta.get("why") or row_why,
                ),
            ):
                append(value)
            row_parts.append((name, columns))
    tensors["selected"], tensors["is_ids"] = (np.array(tensors[k], dtype=bool) for k in ("selected", "is_ids"))
    tables["tensors"] = tensors
    tables["rows"] = _rows_table(row_parts)
    for name in ("calls", "tensors"):
        for column in ENCODED[name]:
            tables[name][column] = arrowbuild.encoded(tables[name][column])
    return tables


@functools.lru_cache(maxsize=1 << 16)
def _io_and_slot(name: str) -> tuple:
    """("in"|"out"|"?", slot) of a tensor name; remembered: decode passes repeat the same names."""
    parsed = fmt.TENSOR_NAME_RE.match(name)
    return (parsed.group("io"), parsed.group("slot") or "") if parsed else ("?", name)


def json_ints(values: Optional[list]) -> str:
    """json.dumps of a list of ints (or None), remembered by value, like the names."""
    return _json_of(None if values is None else tuple(values))


@functools.lru_cache(maxsize=1 << 14)
def _json_of(values: Optional[tuple]) -> str:
    return json.dumps(None if values is None else list(values))


def _rows_table(parts: List[tuple]) -> dict:
    """The rows table's columns from every tensor's row columns, joined once (not per tensor)."""
    lengths = np.array([len(columns["row"]) for _, columns in parts], dtype=np.int64)

    def concat(key, dtype):
        return np.concatenate([c[key] for _, c in parts]).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    return {
        "row": concat("row", np.int32),
        "fp": concat("fp", np.int64),
        "rowshape": arrowbuild.dictionary([c["rowshape"] for _, c in parts], lengths),
        "amax": concat("amax", np.float64),
        "nonfinite": concat("nonfinite", np.int32),
        "srow": concat("srow", np.int32),
        "offset": concat("offset", np.int64),
        "tensor": arrowbuild.dictionary([name for name, _ in parts], lengths),
    }
