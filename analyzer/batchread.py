"""The rows of many batches (one tensor, many entries of a side's rows table), read pass by pass.

The noise-aware walk compares a row of nearly every tensor of every decode step. Tensor by
tensor, each small decode file would be opened once per tensor, or, when the files do not all
fit the row reader's cache, read whole again and again; pass by pass, each file is read whole
once and every batch's rows are sliced out of it. Batches are read in chunks of at most
CHUNK_BYTES of rows per side, so memory stays bounded whatever the number of steps.
"""

from __future__ import annotations

import json
import math
import re
from typing import List, Tuple

import numpy as np

from .dtypes import BY_NAME, DType, to_float64
from .index import Index
from .rowread import WHOLE_FILE_AFTER

CHUNK_BYTES = 128 << 20
_ROW_SHAPE = re.compile(r"^([a-z0-9_]+)(\[.*\])$")


def row_bytes(shape_text: str) -> int:
    """Bytes of one row from the rows table's row shape text ("float32[1024]"); 0 if unknown."""
    match = _ROW_SHAPE.match(str(shape_text))
    kind = BY_NAME.get(match.group(1)) if match else None
    try:
        return kind.size * math.prod(json.loads(match.group(2))) if kind else 0
    except (ValueError, TypeError):
        return 0


def chunks(sizes: List[int], limit: int = CHUNK_BYTES) -> List[List[int]]:
    """Consecutive batch numbers in groups of at most ``limit`` bytes (a larger batch alone)."""
    groups, current, held = [], [], 0
    for i, size in enumerate(sizes):
        if current and held + size > limit:
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += size
    return groups + [current] if current else groups


def read_batches(index: Index, tensors: List[str], entries: List[np.ndarray]) -> List[Tuple[np.ndarray, DType]]:
    """For each batch: its rows (elements as bits, in entry order) and their element type. Rows
    of one batch stored in different element types in different passes come as float64 values."""
    rows, reader = index.cols("rows"), index.reader()
    entry = np.concatenate(entries)
    batch_of = np.repeat(np.arange(len(entries)), [len(e) for e in entries])
    place = np.concatenate([np.arange(len(e)) for e in entries])
    passes, srows = rows["pass"][entry], rows["srow"][entry]
    order = np.lexsort((batch_of, passes))
    cell = passes[order].astype(np.int64) * len(entries) + batch_of[order]
    bounds = np.r_[0, np.nonzero(np.diff(cell))[0] + 1, len(order)]
    cell_pass = cell[bounds[:-1]] // len(entries)  # one per (pass, batch)
    pass_ids, batches_in_pass = np.unique(cell_pass, return_counts=True)
    broad = set(pass_ids[batches_in_pass >= WHOLE_FILE_AFTER].tolist())
    out: list = [None] * len(entries)
    types: list = [None] * len(entries)
    mixed = set()
    last_pass = None
    firsts = order[bounds[:-1]]
    for start, stop, pass_id, i in zip(bounds[:-1].tolist(), bounds[1:].tolist(), passes[firsts].tolist(),
                                       batch_of[firsts].tolist()):
        if pass_id != last_pass:
            if last_pass in broad:
                reader.drop_whole(last_pass)
            last_pass = pass_id
            if pass_id in broad:
                reader.read_broadly(pass_id)
        if i in mixed:
            continue
        mine = order[start:stop]
        block, dtype = reader.stored_bits(pass_id, tensors[i], srows[mine])
        if out[i] is None:
            out[i], types[i] = np.empty((len(entries[i]),) + block.shape[1:], block.dtype), dtype
        elif block.shape[1:] != out[i].shape[1:] or block.dtype != out[i].dtype or dtype != types[i]:
            mixed.add(i)
            continue
        out[i][place[mine]] = block
    if last_pass in broad:
        reader.drop_whole(last_pass)
    for i in mixed:
        out[i], types[i] = _mixed_rows(index, tensors[i], passes[batch_of == i], srows[batch_of == i])
    return list(zip(out, types))


def _mixed_rows(index: Index, tensor: str, passes: np.ndarray, srows: np.ndarray):
    """Rows of one tensor whose passes store it in different element types: as float64 values."""
    reader = index.reader()
    out = None
    by_pass = np.argsort(passes, kind="stable")
    pass_ids, starts = np.unique(passes[by_pass], return_index=True)
    for pass_id, mine in zip(pass_ids.tolist(), np.split(by_pass, starts[1:])):
        block, dtype = reader.stored_bits(pass_id, tensor, srows[mine])
        values = to_float64(block.reshape(len(mine), -1), dtype) if dtype.floating else block.reshape(len(mine), -1)
        if out is None:
            out = np.empty((len(passes), values.shape[1]), np.float64)
        out[mine] = values
    return out, BY_NAME["float64"]
