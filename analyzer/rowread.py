"""Read the bytes of chosen token rows from a dump, each stored tensor at most once.

The index says where every row lives (pass, stored tensor, row within the stored view); this
reader keeps pass files open and the last loaded tensors in a small byte-bounded cache, so a
walk over many rows of the same tensors does not reread files.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Dict, Tuple

import torch

from .index import Index, stored_row_view
from .load import PassFile

CACHE_BYTES = 512 << 20


class RowReader:
    def __init__(self, index: Index, cache_bytes: int = CACHE_BYTES):
        self.index = index
        rank_ids = index.tokens["rank"].unique()
        self._refs = {p.pass_id: p for r in rank_ids for p in index.dump.ranks[int(r)].passes}
        tensors = index.tensors
        self._meta: Dict[Tuple[int, str], tuple] = {
            (int(p), t): (s, json.loads(d), bool(sel))
            for p, t, s, d, sel in zip(tensors["pass"], tensors["tensor"], tensors["stored"], tensors["token_dims"], tensors["selected"])}
        rows = index.rows
        self._srow: Dict[Tuple[int, str, int], int] = {
            (int(p), t, int(r)): int(s) for p, t, r, s in zip(rows["pass"], rows["tensor"], rows["row"], rows["srow"])}
        self._files: Dict[int, PassFile] = {}
        self._views: "OrderedDict[Tuple[int, str], torch.Tensor]" = OrderedDict()
        self._cached = 0
        self._limit = cache_bytes
        self.bytes_read = 0

    def rows(self, pass_id: int, tensor: str, token_rows) -> torch.Tensor:
        """[len(token_rows), ...] for one tensor of one pass."""
        view = self._view(pass_id, tensor)
        picks = [self._srow[(pass_id, tensor, int(r))] for r in token_rows]
        return view[torch.tensor(picks, dtype=torch.long)]

    def _view(self, pass_id: int, tensor: str) -> torch.Tensor:
        stored, dims, selected = self._meta[(pass_id, tensor)]
        key = (pass_id, stored)
        if key in self._views:
            self._views.move_to_end(key)
            return self._views[key]
        pass_file = self._files.get(pass_id)
        if pass_file is None:
            pass_file = self._files[pass_id] = PassFile(self._refs[pass_id])
        data = pass_file.tensor(stored)
        self.bytes_read += data.numel() * data.element_size()
        view = stored_row_view(data, {"token_dims": dims, "selected": selected}) if dims is not None \
            else data.reshape((1,) + tuple(data.shape))
        self._views[key] = view
        self._cached += data.numel() * data.element_size()
        while self._cached > self._limit and len(self._views) > 1:
            _, old = self._views.popitem(last=False)
            self._cached -= old.numel() * old.element_size()
        return view
