"""One dump's index as the verdict reads it: its five tables, as numpy columns or pandas frames
made on first use, whole or for one rank."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..dump.load import Dump
from .columns import Columns
from .saved import LazyParquet


class Index:
    """The five tables of one dump (or of one rank of it). ``index.tokens`` etc. are pandas frames,
    made on first use; ``index.cols("tokens")`` is the same table as numpy columns, which the
    strict verdict reads (it never imports pandas)."""

    def __init__(self, dump: Dump, tables: dict, where: str, rank: Optional[int] = None, shared: dict = None) -> None:
        self.dump = dump
        self.where = where
        self._tables = tables  # name -> pyarrow Table (read from disk or just built)
        self._rank = rank
        self._shared = {} if shared is None else shared  # whole-dump conversions, kept for every rank
        self._frames: Dict[str, object] = {}
        self._cols: Dict[str, Columns] = {}
        self.row_reader = None  # its RowReader, made on first use by rows.reader_of

    def frame(self, name: str):
        if name not in self._frames:
            whole = self._shared.get(("frame", name))
            if whole is None:
                from .passtables import ENCODED

                frame = self._tables[name].to_pandas(use_threads=False)  # a LazyParquet or a pyarrow Table
                whole = self._shared[("frame", name)] = _plain_text(frame, ENCODED.get(name, ()))
            self._frames[name] = (
                whole if self._rank is None or "rank" not in whole else whole[whole["rank"] == self._rank]
            )
        return self._frames[name]

    def cols(self, name: str) -> Columns:
        if name not in self._cols:
            whole = self._shared.get(("cols", name))
            if whole is None:
                whole = self._shared[("cols", name)] = Columns.from_arrow(self._tables[name])
            one_rank = self._rank is None or len(self.dump.ranks) == 1 or "rank" not in whole
            self._cols[name] = whole if one_rank else _rows_of_rank(whole, self._rank)
        return self._cols[name]

    tokens = property(lambda self: self.frame("tokens"))
    seqs = property(lambda self: self.frame("seqs"))
    calls = property(lambda self: self.frame("calls"))
    tensors = property(lambda self: self.frame("tensors"))
    rows = property(lambda self: self.frame("rows"))

    def prefetch(self, table: str, names) -> None:
        """Read these columns of a table saved on disk in the background (no-op for one in memory)."""
        if isinstance(self._tables[table], LazyParquet):
            self._tables[table].prefetch(names)

    def rank(self, rank: int) -> "Index":
        return Index(self.dump, self._tables, self.where, rank, self._shared)


def _plain_text(frame, names):
    """The encoded text columns as plain strings (object), as the pandas consumers expect."""
    for name in names:
        if name in frame and str(frame[name].dtype) == "category":
            frame[name] = frame[name].astype(object)
    return frame


def _rows_of_rank(table: Columns, rank: int) -> Columns:
    """A rank's entries; a view when they lie together (tables are built rank by rank), not a copy."""
    at = np.nonzero(table["rank"] == rank)[0]
    if len(at) == len(table):
        return table
    if len(at) and at[-1] - at[0] + 1 == len(at):
        return table.take(slice(int(at[0]), int(at[-1]) + 1))
    return table.take(at)
