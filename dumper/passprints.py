"""The row fingerprints of one pass, computed in batches where the tensors lie.

A decode step captures hundreds of small tensors; a fingerprint computed per tensor costs a
dozen kernel launches each, which on a GPU costs more than the step itself. Instead each
captured tensor's rows are copied (one kernel, no host copy) into a staging block shared with
every tensor of the same device, element type and row width; the fingerprints and statistics of
a whole block are computed together when the pass ends, or earlier when the staged bytes exceed
``stage_bytes`` (a long prefill). The copy is taken at hook time, so a kernel that later
rewrites the tensor in place cannot change what was captured. Results stay on the device until
the pass ends and come to the host as one [3, rows] int64 tensor (rowprint.row_stats) with one
copy. Contiguous rows are staged as raw byte copies (rawcopy.py). On a GPU with Triton the
blocks of one element type take one kernel launch together (rowkernel.py; inside a graph
capture one per block); otherwise a block takes a dozen kernels, and the fingerprints' final
mix, a dozen more, is taken once for all of the pass's rows (a decode step fills about 20
blocks, one per row width).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import rawcopy, rowprint

BLOCK_BYTES = 8 << 20  # a staging block holds at least this many bytes of rows (or one tensor's)


class _Block:
    __slots__ = ("rows", "used", "owners", "capacity", "address", "row_bytes")

    def __init__(self, rows: torch.Tensor):
        self.rows, self.used, self.capacity = rows, 0, rows.shape[0]
        self.address, self.row_bytes = rows.data_ptr(), rows.shape[1] * rows.element_size()
        self.owners: List[Tuple[dict, int, int]] = []  # (tensor metadata, first row, rows)


class PassPrints:
    def __init__(self, stage_bytes: int = 256 << 20, raw_copies: bool = True):
        self.stage_bytes = stage_bytes
        self.raw_copies = raw_copies  # contiguous rows staged by rawcopy.py (not in a graph capture)
        self._blocks: Dict[tuple, List[_Block]] = {}
        self._staged = 0
        # per block worked on, in order, on its device: its [3, n] stats table (rowkernel), or
        # (seeded sums [n], (largest |x| [n], NaN/inf counts [n])) to finish with the others
        self._pieces: list = []
        self._rows = 0  # rows worked on so far: where the next block's rows start
        self.on_cuda = False

    def add(self, meta: dict, rows: torch.Tensor, shape: Optional[Tuple[int, int]] = None):
        """Stage a tensor's [n, width] rows: ``rows`` itself, or with ``shape`` (n, width)
        ``rows.reshape(shape)`` (not made where the bytes are copied as they lie).
        ``meta["print"]`` becomes [first row, n] of the pass's fingerprint table when they are
        worked on. Returns the rows' (device, element type, width) and their count. Called once
        per captured tensor: kept short."""
        n, width = rows.shape if shape is None else shape
        key = (rows.device, rows.dtype, width)
        blocks = self._blocks.get(key)
        block = blocks[-1] if blocks else None  # only the last block of a key has room left
        if block is None or block.capacity - block.used < n:
            block = self._new_block(key, n)
        used, row_bytes = block.used, block.row_bytes  # the block's rows have the tensor's type
        nbytes = n * row_bytes
        # contiguous rows are their reshape's bytes in order: copied as raw bytes, no view made
        if not (self.raw_copies and rawcopy.copy_rows(block.address + used * row_bytes, rows, nbytes)):
            block.rows[used : used + n].copy_(rows if shape is None else rows.reshape(shape))
        block.owners.append((meta, used, n))
        block.used = used + n
        self._staged += nbytes
        if self._staged > self.stage_bytes:
            self._work()
        return key, n

    @property
    def staged_bytes(self) -> int:
        """Bytes of rows staged and not printed yet."""
        return self._staged

    @property
    def worked(self) -> bool:
        """Whether rows were printed before the pass's end (its staged bytes outgrew stage_bytes)."""
        return bool(self._pieces)

    def take_rows(self, sections: Dict[tuple, tuple], owners: Optional[dict] = None) -> None:
        """Rows staged elsewhere (passplan.py), before the rows this pass has staged itself: per
        (device, element type, width) key, a tensor whose first ``used`` rows hold them;
        ``owners``: per key, the (tensor metadata, first row, rows) whose prints are to be placed."""
        own, self._blocks = self._blocks, {}
        for key, (rows, used) in sections.items():
            block = _Block(rows)
            block.used = used
            if owners:
                block.owners = owners[key]
            self._blocks[key] = [block]
            self._staged += used * block.row_bytes
            self.on_cuda |= key[0].type == "cuda"
        for key, blocks in own.items():  # after all of those, under keys of their own
            self._blocks[("own",) + key] = blocks

    def _new_block(self, key: tuple, n: int) -> _Block:
        """A block for rows of ``key`` (device, element type, width) with room for ``n`` of them."""
        device, dtype, width = key
        size = max(n, BLOCK_BYTES // max(width * dtype.itemsize, 1), 1)
        block = _Block(torch.empty((size, width), dtype=dtype, device=device))
        self._blocks.setdefault(key, []).append(block)
        self.on_cuda |= device.type == "cuda"
        return block

    def _work(self):
        """Fingerprint every staged row; the blocks are then free for more."""
        kernel = _rowkernel() if self.on_cuda else None
        full = [block for blocks in self._blocks.values() for block in blocks if block.used or block.owners]
        if not (kernel is not None and self._work_grouped(kernel, full)):
            for block in full:
                if block.used:
                    rows = block.rows[: block.used]
                    table = _kernel_table(kernel, rows) if kernel is not None else None
                    if table is not None:
                        self._pieces.append(table)
                    else:
                        self._pieces.append((rowprint.seeded_sums(rows), rowprint.magnitudes(rows)))
        for block in full:
            for meta, first, n in block.owners:
                meta["print"] = (self._rows + first, n)
            self._rows += block.used
            block.used, block.owners = 0, []
        for blocks in self._blocks.values():  # emptied: the last block of each key is reused
            del blocks[:-1]
        self._staged = 0

    def _work_grouped(self, kernel, full: List[_Block]) -> bool:
        """The blocks' rows into one table, in the blocks' order, by one kernel launch per element
        type (rowkernel's grouped form); False, with nothing done, where they cannot all go that
        way."""
        full = [block for block in full if block.used]
        if not full or not kernel.available(full[0].rows.device):
            return False
        firsts, total = [], 0
        for block in full:
            firsts.append(total)
            total += block.used
        table = torch.empty((3, total), dtype=torch.int64, device=full[0].rows.device)
        try:
            if not kernel.grouped_row_stats_into([block.rows[: block.used] for block in full], table, firsts):
                return False
        except Exception as exc:  # noqa: BLE001 - the dumper never makes a model fail
            kernel.disable(exc)
            return False
        self._pieces.append(table)
        return True

    def finish(self, host: bool = True) -> Optional[torch.Tensor]:
        """The pass's [3, rows] table on the host (None if nothing was staged). From a GPU: copied
        without waiting into pinned memory; record a CUDA event after this and wait on it before
        reading. ``host=False``: left on its device (a pass captured into a CUDA graph, whose
        table is copied into a static slot; a model on one device)."""
        self._work()
        self._blocks.clear()
        pieces, self._pieces = self._pieces, []  # consumed by the tables (sums mixed in place)
        if not pieces:
            return None
        if len({_device(piece) for piece in pieces}) > 1:
            pieces = [_on_host(piece) for piece in pieces]  # a model spread over devices: rows keep their order
        tables = _tables(pieces)
        table = tables[0] if len(tables) == 1 else torch.cat(tables, dim=1)
        if not table.is_cuda or not host:
            return table
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        return host


def _kernel_table(kernel, rows: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows' [3, n] stats by the one-launch kernel, or None where it does not take them."""
    if not (kernel.available(rows.device) and kernel.takes(rows)):
        return None
    table = torch.empty((3, rows.shape[0]), dtype=torch.int64, device=rows.device)
    try:
        kernel.row_stats_into(rows, table, 0)
    except Exception as exc:  # noqa: BLE001 - the dumper never makes a model fail
        kernel.disable(exc)
        return None
    return table


def _device(piece) -> torch.device:
    return (piece if isinstance(piece, torch.Tensor) else piece[0]).device


def _on_host(piece):
    if isinstance(piece, torch.Tensor):
        return piece.cpu()
    sums, (largest, nonfinite) = piece
    return sums.cpu(), (largest.cpu(), nonfinite.cpu())


def _tables(pieces: list) -> List[torch.Tensor]:
    """The pieces, all on one device, as [3, n] tables in order; runs of unfinished blocks
    finished together (one final mix for all of them)."""
    tables, sums, magnitudes = [], [], []
    for piece in pieces + [None]:
        if isinstance(piece, tuple):
            sums.append(piece[0])
            magnitudes.append(piece[1])
            continue
        if sums:
            tables.append(rowprint.stats_table(sums, magnitudes))
            sums, magnitudes = [], []
        if piece is not None:
            tables.append(piece)
    return tables


_kernel_module = []


def _rowkernel():
    """dumper/rowkernel.py, imported on a pass's first GPU block (it imports Triton); None
    without Triton."""
    if not _kernel_module:
        from . import rowkernel

        _kernel_module.append(rowkernel if rowkernel.triton is not None else None)
    return _kernel_module[0]
