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
import os
import re
from typing import List, Tuple

import numpy as np

from .dtypes import BY_NAME, DType, to_float64
from .errors import DumpError, show
from .index import Index
from .rowread import WHOLE_FILE_AFTER, WHOLE_FILE_BYTES, read_exactly

CHUNK_BYTES = 128 << 20
GROUP_BYTES = 64 << 20  # small pass files read whole at once by _from_small_files
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


def in_file_order(index: Index, entries: np.ndarray, batches: List[np.ndarray]) -> List[np.ndarray]:
    """The batches (arrays of positions in ``entries``, a side's rows-table entries) ordered by
    where their rows typically lie in their pass files: a chunk of consecutive batches then
    reads one slice of each decode step's file (read_batches), not scattered bits of all of it."""
    rows = index.cols("rows")
    if "offset" not in rows or len(batches) < 2:
        return batches
    offsets = rows["offset"][entries]
    typical = [float(np.median(offsets[batch])) if len(batch) else 0.0 for batch in batches]
    return [batches[i] for i in np.argsort(typical, kind="stable").tolist()]


def read_batches(index: Index, tensors: List[str], entries: List[np.ndarray]) -> List[Tuple[np.ndarray, DType]]:
    """For each batch: its rows (elements as bits, in entry order) and their element type. Rows
    of one batch stored in different element types in different passes come as float64 values."""
    rows, reader = index.cols("rows"), index.reader()
    entry = np.concatenate(entries)
    batch_of = np.repeat(np.arange(len(entries)), [len(e) for e in entries])
    place = np.concatenate([np.arange(len(e)) for e in entries])
    passes, srows = rows["pass"][entry], rows["srow"][entry]
    out: list = [None] * len(entries)
    types: list = [None] * len(entries)
    sliced = _from_small_files(index, entry, batch_of, place, passes, len(entries), out, types)
    if sliced.all():
        return list(zip(out, types))
    every = (batch_of, passes, srows)
    rest = np.nonzero(~sliced)[0]  # the cells left, read through the row reader
    batch_of, place, passes, srows = batch_of[rest], place[rest], passes[rest], srows[rest]
    order = np.lexsort((batch_of, passes))
    cell = passes[order].astype(np.int64) * len(entries) + batch_of[order]
    bounds = np.r_[0, np.nonzero(np.diff(cell))[0] + 1, len(order)]
    cell_pass = cell[bounds[:-1]] // len(entries)  # one per (pass, batch)
    pass_ids, batches_in_pass = np.unique(cell_pass, return_counts=True)
    broad = set(pass_ids[batches_in_pass >= WHOLE_FILE_AFTER].tolist())
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
        elif block.dtype != out[i].dtype or dtype != types[i] or block[0].size != out[i][0].size:
            mixed.add(i)
            continue
        # Rows are compared flat: [1, D] from one pass and [D] from another (unit dims) are alike.
        out[i][place[mine]] = block.reshape((len(mine),) + out[i].shape[1:])
    if last_pass in broad:
        reader.drop_whole(last_pass)
    batch_of, passes, srows = every
    for i in mixed:  # all its rows again, as float64 values
        out[i], types[i] = _mixed_rows(index, tensors[i], passes[batch_of == i], srows[batch_of == i])
    return list(zip(out, types))


def _from_small_files(index: Index, entry: np.ndarray, batch_of: np.ndarray, place: np.ndarray, passes: np.ndarray,
                      n_batches: int, out: list, types: list) -> np.ndarray:
    """Fill the batches whose every row lies in a small pass file that many batches read from
    (decode steps), at the byte offset the index holds: those files are read whole, a group at a
    time, and each batch's rows are sliced out of a group in one gather (no per-row or per-file
    Python step). Returns which entries were filled; the others are left to the row reader."""
    rows, refs = index.cols("rows"), index.reader().refs
    done = np.zeros(len(entry), dtype=bool)
    if "offset" not in rows or not len(entry):
        return done
    offsets = rows["offset"][entry]
    shape_codes, shape_texts = rows.codes("rowshape")
    shape_codes = shape_codes[entry]
    pass_ids, pass_of, batches_in_pass = _passes_and_batches(passes, batch_of, n_batches)
    sizes = np.array([refs[p].nbytes for p in pass_ids.tolist()], dtype=np.int64)
    small = (sizes <= WHOLE_FILE_BYTES) & (batches_in_pass >= WHOLE_FILE_AFTER)
    fits = small[pass_of] & (offsets >= 0)
    # A batch's rows in the row shape (element type and size) of its first such row are sliced.
    counts = np.bincount(batch_of, minlength=n_batches)
    first_fit = np.full(n_batches, -1, dtype=np.int64)
    at = np.nonzero(fits)[0]
    fit_batches, firsts = np.unique(batch_of[at], return_index=True)  # batch_of ascends
    first_fit[fit_batches] = shape_codes[at[firsts]]
    usable = np.zeros(n_batches, dtype=bool)
    widths, kinds = np.zeros(n_batches, dtype=np.int64), {}
    for b in fit_batches.tolist():
        text = str(shape_texts[first_fit[b]])
        match = _ROW_SHAPE.match(text)
        kind, width = (BY_NAME.get(match.group(1)) if match else None), row_bytes(text)
        if kind is not None and width > 0:
            usable[b], widths[b], kinds[b] = True, width, kind
            out[b] = np.empty((int(counts[b]),) + tuple(json.loads(match.group(2))), kind.bits)
            types[b] = kind
    cells = np.nonzero(fits & usable[batch_of] & (shape_codes == first_fit[batch_of]))[0]
    if not len(cells):
        return done
    # Of each file, the span that holds these rows (callers ask for batches in file order, so a
    # chunk's span is a slice of the file); spans are read in groups of at most GROUP_BYTES into
    # one buffer, then sliced batch by batch.
    if (offsets[cells] + widths[batch_of[cells]] > sizes[pass_of[cells]]).any():
        raise DumpError(f"the index of {show(index.dump.path)} places rows past the end of their pass files; "
                        "rebuild it: dumpdiff index --rebuild")
    needed = np.unique(pass_of[cells])
    lows, highs = np.full(len(pass_ids), np.iinfo(np.int64).max), np.zeros(len(pass_ids), dtype=np.int64)
    np.minimum.at(lows, pass_of[cells], offsets[cells])
    np.maximum.at(highs, pass_of[cells], offsets[cells] + widths[batch_of[cells]])
    group_of_pass = np.full(len(pass_ids), -1, dtype=np.int64)
    group_of_pass[needed] = np.cumsum(highs[needed] - lows[needed]) // GROUP_BYTES
    order = cells[np.lexsort((batch_of[cells], group_of_pass[pass_of[cells]]))]
    key = group_of_pass[pass_of[order]] * n_batches + batch_of[order]
    bounds = np.r_[0, np.nonzero(np.diff(key))[0] + 1, len(order)]
    buffer, base = None, None
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        mine = order[start:stop]
        group = int(group_of_pass[pass_of[mine[0]]])
        if buffer is None or group != buffer[0]:
            buffer = (group, *_read_spans(index, pass_ids, lows, highs, np.nonzero(group_of_pass == group)[0]))
        _, data, base = buffer
        b = int(batch_of[mine[0]])
        width = int(widths[b])
        begin = base[pass_of[mine]] + offsets[mine]
        windows = np.lib.stride_tricks.as_strided(data, (len(data) - width + 1, width), (1, 1), writeable=False)
        out[b][place[mine]] = windows[begin].view(out[b].dtype).reshape((len(mine),) + out[b].shape[1:])
        done[mine] = True
    return done


def _passes_and_batches(passes: np.ndarray, batch_of: np.ndarray, n_batches: int):
    """(the distinct passes, each entry's number among them, how many batches read each)."""
    pass_ids, pass_of = np.unique(passes, return_inverse=True)
    pass_of = pass_of.reshape(-1)
    pairs = np.unique(pass_of.astype(np.int64) * n_batches + batch_of)
    return pass_ids, pass_of, np.bincount(pairs // n_batches, minlength=len(pass_ids))


def _read_spans(index: Index, pass_ids: np.ndarray, lows: np.ndarray, highs: np.ndarray, members: np.ndarray):
    """(the spans [low, high) of the member pass files read into one buffer, per pass the place
    in it of the file's byte 0)."""
    reader = index.reader()
    lengths = highs[members] - lows[members]
    starts = np.cumsum(lengths) - lengths
    base = np.zeros(len(pass_ids), dtype=np.int64)
    base[members] = starts - lows[members]
    data = np.empty(int(lengths.sum()), dtype=np.uint8)
    for member, start, length in zip(members.tolist(), starts.tolist(), lengths.tolist()):
        path = reader.refs[int(pass_ids[member])].path
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                read_exactly(fd, data[start:start + length], int(lows[member]))
            finally:
                os.close(fd)
        except OSError as exc:
            raise DumpError(f"{show(path)}: cannot read ({exc}); the file is damaged or was changed") from None
        reader.bytes_read += length
    return data, base


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
