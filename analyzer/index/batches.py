"""The rows of many batches (one tensor, many entries of a side's rows table), read at the byte
offsets the index holds.

The noise-aware walk compares a row of nearly every tensor of every decode step: tens of
thousands of rows, each a Python call through the row reader (and a header to parse per file).
Instead, each row's offset comes from the index; of each decode step's file the span holding a
chunk's rows is read (batches come in file order, so that span is a slice of the file), spans go
into one reused buffer, and each batch's rows are gathered out of it in one numpy step
(``_from_spans``). Rows in files read sparsely, and rows that are not one byte range, still go
through the row reader. Batches are read in chunks of at most CHUNK_BYTES of rows per side, spans
in groups of at most GROUP_BYTES, so memory stays bounded whatever the number of steps.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import List, Tuple

import numpy as np

from ..dump.dtypes import BY_NAME, DType, to_float64
from ..errors import DumpError, show
from .columns import distinct
from .rows import WHOLE_FILE_AFTER, WHOLE_FILE_BYTES, read_exactly, reader_of
from .table import Index

CHUNK_BYTES = 128 << 20
GROUP_BYTES = 64 << 20  # spans of pass files read at once by _from_spans
MAX_SPAN_BYTES = 64 << 20  # a longer span is left to the row reader: memory stays bounded
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
    lengths = np.array([len(batch) for batch in batches], dtype=np.int64)
    batch_of = np.repeat(np.arange(len(batches)), lengths)
    offsets = rows["offset"][entries[np.concatenate(batches)]] if lengths.sum() else np.zeros(0, np.int64)
    by_place = offsets[np.lexsort((offsets, batch_of))]  # each batch's offsets ascending, batch after batch
    middle = np.minimum(np.cumsum(lengths) - lengths + lengths // 2, max(len(by_place) - 1, 0))
    typical = np.where(lengths > 0, by_place[middle] if len(by_place) else 0, 0)  # a median of each batch
    return [batches[i] for i in np.argsort(typical, kind="stable").tolist()]


def read_batches(index: Index, tensors: List[str], entries: List[np.ndarray]) -> List[Tuple[np.ndarray, DType]]:
    """For each batch: its rows (elements as bits, in entry order) and their element type. Rows
    of one batch stored in different element types in different passes come as float64 values."""
    rows, reader = index.cols("rows"), reader_of(index)
    entry = np.concatenate(entries)
    batch_of = np.repeat(np.arange(len(entries)), [len(e) for e in entries])
    place = np.concatenate([np.arange(len(e)) for e in entries])
    passes, srows = rows["pass"][entry], rows["srow"][entry]
    out: list = [None] * len(entries)
    types: list = [None] * len(entries)
    sliced = _from_spans(index, entry, batch_of, place, passes, len(entries), out, types)
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
    for start, stop, pass_id, i in zip(
        bounds[:-1].tolist(), bounds[1:].tolist(), passes[firsts].tolist(), batch_of[firsts].tolist()
    ):
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


def _from_spans(
    index: Index,
    entry: np.ndarray,
    batch_of: np.ndarray,
    place: np.ndarray,
    passes: np.ndarray,
    n_batches: int,
    out: list,
    types: list,
) -> np.ndarray:
    """Fill rows straight from the byte offsets the index holds, reading spans of files: of a
    small pass file that many batches read from (a decode step), the span that holds all of
    them (callers ask for batches in file order, so a chunk's span is a slice of the file); of
    a larger one, each batch's span when its rows are at least half of it (a prefill whose rows
    are all compared). Spans are read a group of at most GROUP_BYTES at a time into one reused
    buffer, and each batch's rows are gathered out of a group in one numpy step: no Python step
    per row or per file. Returns which entries were filled; the row reader reads the others
    (sparse rows, token dims that do not lead)."""
    rows, reader = index.cols("rows"), reader_of(index)
    done = np.zeros(len(entry), dtype=bool)
    if "offset" not in rows or not len(entry):
        return done
    offsets = rows["offset"][entry]
    widths, shapes, cells = _sliceable(rows, entry, offsets, batch_of, n_batches)
    pass_ids, pass_of, batches_in_pass = _passes_and_batches(passes, batch_of, n_batches)
    sizes = np.array([reader.refs[p].nbytes for p in pass_ids.tolist()], dtype=np.int64)
    width_of = widths[batch_of[cells]]
    if (
        offsets[cells] > sizes[pass_of[cells]] - width_of
    ).any():  # not offset + width: a damaged index's huge offset wraps
        raise DumpError(
            f"the index of {show(index.dump.path)} places rows past the end of their pass files; "
            "rebuild it: dumpdiff index --rebuild"
        )
    broad = (sizes <= WHOLE_FILE_BYTES) & (batches_in_pass >= WHOLE_FILE_AFTER)
    cells, piece_of, piece_pass, lows, spans, group_of = _pieces(
        cells, offsets, width_of, pass_of, batch_of, broad, n_batches
    )
    if not len(cells):
        return done
    counts = np.bincount(batch_of, minlength=n_batches)
    for b in distinct(batch_of[cells]).tolist():
        kind, row_shape = shapes[b]
        out[b], types[b] = np.empty((int(counts[b]),) + row_shape, kind.bits), kind
    sorter = np.lexsort((batch_of[cells], group_of[piece_of]))  # group by group, batch by batch
    order, order_piece = cells[sorter], piece_of[sorter]
    step = group_of[order_piece] * n_batches + batch_of[order]
    bounds = np.r_[0, np.nonzero(np.diff(step))[0] + 1, len(order)]
    group, data, base = None, None, np.zeros(len(lows), dtype=np.int64)
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        mine, mine_piece = order[start:stop], order_piece[start:stop]
        if group_of[mine_piece[0]] != group:
            group = group_of[mine_piece[0]]
            members = np.nonzero(group_of == group)[0]
            data, base[members] = _read_spans(reader, pass_ids[piece_pass[members]], lows[members], spans[members])
        b = int(batch_of[mine[0]])
        width = int(widths[b])
        windows = np.lib.stride_tricks.as_strided(data, (len(data) - width + 1, width), (1, 1), writeable=False)
        begin = base[mine_piece] - lows[mine_piece] + offsets[mine]
        out[b][place[mine]] = windows[begin].view(out[b].dtype).reshape((len(mine),) + out[b].shape[1:])
        done[mine] = True
    return done


def _sliceable(rows, entry: np.ndarray, offsets: np.ndarray, batch_of: np.ndarray, n_batches: int):
    """(row bytes per batch, (element type, row shape) per batch, the entries that can be sliced):
    those with an offset, in the row shape of their batch's first such entry (the rows table's
    row shape names both), when that shape says its element type and size."""
    shape_codes, shape_texts = rows.codes("rowshape")
    shape_codes = shape_codes[entry]
    first_fit = np.full(n_batches, -1, dtype=np.int64)
    at = np.nonzero(offsets >= 0)[0]
    fit_batches, firsts = np.unique(batch_of[at], return_index=True)  # batch_of ascends
    first_fit[fit_batches] = shape_codes[at[firsts]]
    usable = np.zeros(n_batches, dtype=bool)
    widths = np.zeros(n_batches, dtype=np.int64)
    shapes = {}
    for b in fit_batches.tolist():
        text = str(shape_texts[first_fit[b]])
        match = _ROW_SHAPE.match(text)
        kind, width = (BY_NAME.get(match.group(1)) if match else None), row_bytes(text)
        if kind is not None and width > 0:
            usable[b], widths[b], shapes[b] = True, width, (kind, tuple(json.loads(match.group(2))))
    cells = np.nonzero((offsets >= 0) & usable[batch_of] & (shape_codes == first_fit[batch_of]))[0]
    return widths, shapes, cells


def _pieces(cells, offsets, width_of, pass_of, batch_of, broad, n_batches: int):
    """The spans to read: a broadly read (small) file's rows are one piece, a larger file's one per
    batch, kept when dense (rows at least half the span) or broad, and at most MAX_SPAN_BYTES.
    Returns the cells kept, each one's piece, per piece its pass number, first byte, length and
    group (pieces in file order, GROUP_BYTES of spans per group)."""
    key = pass_of[cells].astype(np.int64) * (n_batches + 1) + np.where(
        broad[pass_of[cells]], n_batches, batch_of[cells]
    )
    pieces, piece_of = np.unique(key, return_inverse=True)
    piece_of = piece_of.reshape(-1)
    lows = np.full(len(pieces), np.iinfo(np.int64).max)
    highs = np.zeros(len(pieces), dtype=np.int64)
    np.minimum.at(lows, piece_of, offsets[cells])
    np.maximum.at(highs, piece_of, offsets[cells] + width_of)
    spans = highs - lows
    dense = np.bincount(piece_of, weights=width_of, minlength=len(pieces)) * 2 >= spans
    piece_pass = pieces // (n_batches + 1)
    kept = (broad[piece_pass] | dense) & (spans <= MAX_SPAN_BYTES)
    group_of = np.where(kept, np.cumsum(np.where(kept, spans, 0)) // GROUP_BYTES, -1)
    keep = kept[piece_of]
    return cells[keep], piece_of[keep], piece_pass, lows, spans, group_of


def _passes_and_batches(passes: np.ndarray, batch_of: np.ndarray, n_batches: int):
    """(the distinct passes, each entry's number among them, how many batches read each)."""
    pass_ids, pass_of = np.unique(passes, return_inverse=True)
    pass_of = pass_of.reshape(-1)
    pairs = distinct(pass_of.astype(np.int64) * n_batches + batch_of)
    return pass_ids, pass_of, np.bincount(pairs // n_batches, minlength=len(pass_ids))


def _read_spans(reader, pass_ids: np.ndarray, lows: np.ndarray, lengths: np.ndarray):
    """(spans [low, low + length) of pass files read one after another into the reader's span
    buffer, where each starts in it). The buffer is kept and reused: fresh memory for every
    group would cost a page fault per 4 KB read."""
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    if reader.span_buffer is None or len(reader.span_buffer) < total:
        reader.span_buffer = np.empty(max(total, 1), dtype=np.uint8)
    data = reader.span_buffer[:total]
    fd, open_pass = None, None  # one file open at a time: a group can span hundreds of decode steps
    try:
        for pass_id, low, start, length in zip(pass_ids.tolist(), lows.tolist(), starts.tolist(), lengths.tolist()):
            path = reader.refs[pass_id].path
            try:
                if pass_id != open_pass:
                    if fd is not None:
                        os.close(fd)
                        fd = None
                    fd, open_pass = os.open(path, os.O_RDONLY), pass_id
                read_exactly(fd, data[start : start + length], low)
            except OSError as exc:
                raise DumpError(f"{show(path)}: cannot read ({exc}); the file is damaged or was changed") from None
            reader.bytes_read += length
    finally:
        if fd is not None:
            os.close(fd)
    return data, starts


def _mixed_rows(index: Index, tensor: str, passes: np.ndarray, srows: np.ndarray):
    """Rows of one tensor whose passes store it in different element types: as float64 values."""
    reader = reader_of(index)
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
