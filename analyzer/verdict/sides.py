"""One run of a comparison as a whole model: its ranks' tensors under the mapped names, with
tensor-parallel shards put back together.

A tensor that every rank holds bit for bit (an all-reduced output, the embedding, the norms) is
read from the first rank. One whose ranks hold different values is either a shard of each (q, k
and v of a column-parallel qkv_proj, the input of a row-parallel o_proj: laid side by side in
rank order, as the model without tensor parallelism holds them) or a partial sum (a row-parallel
o_proj or down_proj whose all-reduce comes after its hook: summed); the other run's width tells
which. A fused tensor is cut in its parts on each rank first, so rank 0's q, rank 1's q, ...
make the whole q."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..dump.dtypes import BY_NAME, to_float64
from ..dump.load import Dump, show
from ..errors import DumpError
from ..index.rows import reader_of
from ..index.table import Index
from .canon import Mapped, Piece, module_of

SizesOf = Callable[[Piece, "Side"], Tuple[int, ...]]  # (piece, its run) -> widths of its parts on one rank


class Side:
    def __init__(self, dump: Dump, indexes: Dict[int, Index], mapped: Dict[int, Mapped]) -> None:
        self.dump = dump
        self.ranks = sorted(indexes)
        self.indexes = indexes
        self.mapped = mapped
        self.joined: Dict[str, str] = {}  # name -> how its ranks' values were joined: "shards" or "sum"

    @property
    def first(self) -> Mapped:
        return self.mapped[self.ranks[0]]

    def names(self) -> Dict[str, Piece]:
        """Every mapped name of the first rank, with the tensor it comes from."""
        return self.first.pieces

    def read_broadly(self, pass_id: int) -> None:
        """Rows of many tensors of this pass are about to be read: a small pass file is read whole."""
        for rank in self.ranks:
            reader_of(self.indexes[rank]).read_broadly(pass_id)

    def done_with(self, pass_id: int) -> None:
        """No more rows of this pass will be read: its whole file leaves the cache."""
        for rank in self.ranks:
            reader_of(self.indexes[rank]).drop_whole(pass_id)

    def source_key(self, pass_id: int, name: str) -> Optional[tuple]:
        """What a mapped tensor's values in a pass are made from, per rank (the stored tensor and
        the part of it): names with equal keys have equal values. None where a rank or the pass
        does not hold it."""
        key = []
        for rank in self.ranks:
            piece = self.mapped[rank].pieces.get(name)
            stored = None if piece is None else reader_of(self.indexes[rank]).stored_of(pass_id, piece.tensor)
            if stored is None:
                return None
            cut = (piece.part, piece.parts, piece.sizes, module_of(piece.call)) if piece.part >= 0 else None
            key.append((stored, cut))
        return tuple(key)

    def values(self, pass_id: int, name: str, rows: List[int], sizes_of: SizesOf) -> Optional[Tuple[list, str]]:
        """([len(rows), width] float64 values per rank, element type) of a mapped tensor on these
        token rows of a pass, one array when every rank holds the same bits; None where the pass or
        a row does not hold it. ``join`` makes one tensor of them."""
        per_rank, dtype = [], None
        for rank in self.ranks:
            piece = self.mapped[rank].pieces.get(name)
            if piece is None:
                return None
            index = self.indexes[rank]
            reader = reader_of(index)
            srows = reader.srows(pass_id, piece.tensor)
            if any(int(r) not in srows for r in rows):
                return None
            bits, kind = reader.stored_bits(pass_id, piece.tensor, [srows[int(r)] for r in rows])
            values = to_float64(bits.reshape(len(rows), -1), kind)
            if piece.part >= 0:
                sizes = sizes_of(piece, self)
                if sum(sizes) != values.shape[1]:
                    fix = (
                        f"correct 'sizes' of {piece.rule} (the widths on one rank)"
                        if piece.sizes
                        else "give the widths on one rank with 'sizes' in a mapping file (--map)"
                    )
                    raise DumpError(
                        f"cannot cut {piece.tensor} of {show(self.dump.label)} (width {values.shape[1]} on one rank) "
                        f"into {len(sizes)} parts of widths {list(sizes)}: {fix}"
                    )
                start = sum(sizes[: piece.part])
                values = values[:, start : start + sizes[piece.part]]
            per_rank.append(values)
            dtype = kind.name
        first = per_rank[0]
        if all(v.shape == first.shape and np.array_equal(v, first, equal_nan=True) for v in per_rank[1:]):
            return [first], dtype
        return per_rank, dtype

    def join(self, name: str, per_rank: list, width: Optional[int]) -> np.ndarray:
        """One tensor of a rank's arrays: the one array every rank holds; else the shards side by
        side in rank order (a column-parallel output, a row-parallel input), or their sum where
        that gives the other run's width (a row-parallel output reduced after its hook: partial
        sums). ``width``: the other run's row width, None where it is sharded too (then the
        shards are compared shard by shard, side by side)."""
        if len(per_rank) == 1:
            return per_rank[0]
        how = "sum" if width is not None and width == per_rank[0].shape[1] else "shards"
        self.joined[name] = how
        return np.sum(per_rank, axis=0) if how == "sum" else np.concatenate(per_rank, axis=1)


def check_ranks_alike(index: Index, ranks: List[int], label: str) -> None:
    """Tensor-parallel ranks compute the same token rows: each rank's tokens table must be the
    first rank's (else a rank's passes are not the same steps, and no shards can be joined)."""
    first = None
    for rank in ranks:
        tokens = index.rank(rank).cols("tokens")
        order = np.lexsort((tokens["row"], tokens["pass"]))
        mine = [np.asarray(tokens[n])[order] for n in ("pass", "row", "id", "pos")]
        if first is None:
            first = mine
        elif not all(np.array_equal(x, y) for x, y in zip(mine, first)):
            raise DumpError(
                f"the ranks of {label} hold different token rows (rank {rank} against rank {ranks[0]}): a rank's "
                "dump is cut short or of other steps; dump every rank of the same run"
            )


def float_kind(name: str) -> bool:
    return name in BY_NAME and BY_NAME[name].floating
