"""rowprint.row_stats of a block of rows in one GPU kernel launch, where Triton is available.

The torch form of a row's fingerprint and statistics takes about 25 kernel launches per block of
rows, each a few microseconds of host time, and on a GPU a decode step's host time is the step's
time. This kernel computes the same three numbers per row (fingerprint, largest finite |x| as
float64, NaN/inf count) in one launch: one program per row walks the row in chunks. Outside a
graph capture the blocks of one element type share a launch (grouped_row_stats_into). The
arithmetic is the one rowprint.py defines, on unsigned 64-bit words whose products and sums wrap
as torch's int64 ones do, so the results are bit for bit those of the torch form
(tests/test_rowkernel.py checks them against it: compiled on a GPU, and on CPU through
Triton's interpreter).

Inside a CUDA graph capture the kernel is launched only in a form already compiled and loaded
(a capture must not load code): ``load`` loads the forms a model needs before its graphs are
captured; any other capture takes the torch form. Triton compiles a form per constant, per
integer argument's type (chosen by its value) and per pointer alignment: the chunk size is
fixed, integers are not specialized by value and are passed below 2**31 (the 64-bit seed in
three pieces), and staging blocks are aligned, so one form per element type serves every row
count, width and column.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from . import rowprint

try:  # Triton comes with CUDA builds of torch; CPU builds may lack it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installed torch (absent, or broken)
    triton = None

log = logging.getLogger("dumper")
disabled: Optional[str] = None  # why this process stopped using the kernel (it failed once)

# The float types the kernel reads, and how their magnitude bits become a float64 value in it;
# their largest finite bits are rowprint's. Integer types are read as their bits alone.
_WIDEN = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
_INTS = {torch.int8, torch.uint8, torch.bool, torch.int16, torch.int32, torch.int64}
CHUNK = 1024  # elements a program reads at once (fewer in a shorter row: the rest masked off)


def available(device: torch.device) -> bool:
    """Whether blocks on ``device`` can take the kernel: a GPU, Triton, no earlier failure, and
    Triton not set to interpret (TRITON_INTERPRET, a Triton user's debugging switch, would run it
    in Python)."""
    return (
        triton is not None
        and device.type == "cuda"
        and disabled is None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    )


def disable(error: BaseException) -> None:
    """Stop using the kernel in this process after it failed (a Triton that cannot compile for
    this GPU, no C compiler for its launcher): the torch form gives the same numbers."""
    global disabled
    if disabled is None:
        disabled = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        log.warning("dumper: row prints fall back to torch kernels (slower on a GPU): %s", disabled)


def takes(rows: torch.Tensor) -> bool:
    """Whether the kernel takes these rows now (available() checked by the caller). Inside a
    capture only in the compiled form load() made: the element type loaded on this device,
    contiguous rows at a 16-byte aligned address (Triton compiles a form per pointer alignment),
    sizes below 2**31 (Triton types an integer argument by its value)."""
    if not _reads(rows.dtype):
        return False
    if not _capturing():
        return True
    n, width = rows.shape
    return (
        (rows.device, rows.dtype) in _loaded
        and rows.data_ptr() % 16 == 0
        and (width < 2 or rows.stride(1) == 1)
        and max(n, width, rows.stride(0)) < _SMALL
    )


def load(device: torch.device, dtypes) -> None:
    """Compile and load the kernel for these element types on ``device`` (one launch on one
    element each), so that a CUDA graph captured later can launch it; outside a capture only."""
    if not available(device) or _capturing():
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # a capture's rows are staging blocks: contiguous, aligned, with a table column offset
    # (first) and widths of any size, all i32 arguments like these
    for dtype in dtypes:
        if _reads(dtype) and (device, dtype) not in _loaded and disabled is None:
            table = torch.empty((3, 1), dtype=torch.int64, device=device)
            try:
                row_stats_into(torch.zeros((1, 1), dtype=dtype, device=device), table, 0)
            except Exception as exc:  # noqa: BLE001 - the dumper never makes a model fail
                disable(exc)


def _reads(dtype: torch.dtype) -> bool:
    return dtype in _WIDEN or dtype in _INTS


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_loaded = set()  # (device, element type) of the forms an eager launch has loaded


def row_stats_into(rows: torch.Tensor, table: torch.Tensor, first: int) -> None:
    """Write row_stats(rows) into columns first..first+n of ``table`` ([3, N] int64, contiguous,
    on rows' device). rows: [n, width] of a type ``takes`` accepts."""
    n, width = rows.shape
    if not n:
        return
    if width and rows.stride(1) != 1:
        rows = rows.contiguous()
    bits = rowprint.signed_bits(rows)
    seed = rowprint.seed(rows.dtype, width) & ((1 << 64) - 1)
    launch = _row_stats[(n,)]
    arguments = (
        bits,
        table,
        table.view(torch.float64),
        bits.stride(0) if width else 0,
        width,
        table.stride(0),
        first,
        # in three pieces below 2**31: Triton types an integer argument by its value (i32, i64 or
        # u64), and a new type is a new compiled form, which a graph capture could not load
        seed >> 42,
        (seed >> 21) & _PIECE,
        seed & _PIECE,
    )
    _launch(launch, arguments, rows.dtype, rows.device)
    if not _capturing():
        _loaded.add((rows.device, rows.dtype))


def _launch(launch, arguments: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Launch a kernel form on ``device`` with the constants of rows of ``dtype``."""
    is_float, size = dtype in _WIDEN, dtype.itemsize
    constants = dict(
        IS_FLOAT=is_float,
        MAG_MASK=(1 << (8 * size - 1)) - 1,  # every bit but the sign
        MAX_FINITE=rowprint.MAX_FINITE_BITS[dtype] if is_float else 0,
        WIDEN=_WIDEN.get(dtype, 0),
        BLOCK=CHUNK,
        num_warps=4,
    )
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device and its stream
            launch(*arguments, **constants)
    else:
        launch(*arguments, **constants)


def grouped_row_stats_into(blocks, table: torch.Tensor, firsts) -> bool:
    """row_stats of several blocks of rows on one device, each block's rows into columns
    firsts[i].. of ``table`` ([3, N] int64, contiguous, on their device), one launch per element
    type. blocks: contiguous [n_i, width_i] tensors (staging blocks). False, with nothing
    launched, where they cannot all go this way (another device, a type the kernel does not
    read, a graph capture, which needs the forms load() made): the caller launches per block.

    A pass stages its rows in one block per element type and row width, about 20 at a decode
    step, and a launch costs the host tens of microseconds. Each block is described by a row of
    a small table (where its elements start, counted from the first block's of its type, its
    width, rows and first column, its seed), copied to the device without waiting; program
    (i, p) works on rows p, p + P, ... of block i."""
    if not blocks or _capturing():
        return False
    device = blocks[0].device
    by_type: dict = {}
    for rows, first in zip(blocks, firsts):
        if rows.device != device or not _reads(rows.dtype) or not rows.is_contiguous():
            return False
        by_type.setdefault(rows.dtype, []).append((rows, first))
    launches = []
    for dtype, members in by_type.items():
        bits = rowprint.signed_bits(members[0][0])
        base, size = bits.data_ptr(), bits.element_size()
        described, most = [], 0
        for rows, first in members:
            offset = rows.data_ptr() - base
            if offset % size:
                return False
            n, width = rows.shape
            described.append((offset // size, width, n, first, rowprint.seed(dtype, width)))
            most = max(most, n)
        if most:
            launches.append((dtype, bits, described, most))
    on_gpu = device.type == "cuda"  # (else Triton's interpreter, in tests)
    for dtype, bits, described, most in launches:
        description = torch.tensor(described, dtype=torch.int64, pin_memory=on_gpu).to(device, non_blocking=True)
        launch = _grouped_row_stats[(len(described), min(most, _MOST_PROGRAMS))]
        _launch(launch, (bits, description, table, table.view(torch.float64), table.stride(0)), dtype, device)
    return True


_MOST_PROGRAMS = 65535  # a grid's second dimension: rows beyond it are looped over


_PIECE = (1 << 21) - 1
_SMALL = 1 << 31  # integer arguments below this are typed i32, as in the forms load() compiles


if triton is not None:

    @triton.jit
    def _mix64(x):
        x ^= x >> 30
        x *= 0xBF58476D1CE4E5B9
        x ^= x >> 27
        x *= 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _one_row(
        base,
        width,
        seed,
        column,
        out_ptr,
        out_f64_ptr,
        out_stride,
        IS_FLOAT: tl.constexpr,
        MAG_MASK: tl.constexpr,
        MAX_FINITE: tl.constexpr,
        WIDEN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row's three numbers (elements at ``base``, ``width`` of them) into ``column``."""
        sums = tl.zeros([BLOCK], dtype=tl.uint64)
        peak = tl.zeros([BLOCK], dtype=tl.int64)
        bad = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, width, BLOCK):
            j = start + tl.arange(0, BLOCK)
            inside = j < width
            raw = tl.load(base + j, mask=inside, other=0).to(tl.int64)  # sign-extended, as torch widens
            word = raw.to(tl.uint64, bitcast=True) + (j.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
            word *= 0xBF58476D1CE4E5B9
            word ^= word >> 32
            word *= 0x94D049BB133111EB
            sums += tl.where(inside, word, 0)
            if IS_FLOAT:
                magnitude = raw & MAG_MASK
                finite = magnitude <= MAX_FINITE
                peak = tl.maximum(peak, tl.where(inside & finite, magnitude, 0))
                bad += (inside & (magnitude > MAX_FINITE)).to(tl.int64)
        total = tl.sum(sums, axis=0) ^ seed
        tl.store(out_ptr + column, _mix64(total).to(tl.int64, bitcast=True))
        if IS_FLOAT:
            # widened before the reduction: magnitudes order as their values do
            if WIDEN == 0:  # bfloat16: the high half of a float32
                value = (peak.to(tl.int32) << 16).to(tl.float32, bitcast=True).to(tl.float64)
            elif WIDEN == 1:
                value = peak.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float64)
            elif WIDEN == 2:
                value = peak.to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64)
            else:
                value = peak.to(tl.float64, bitcast=True)
            tl.store(out_f64_ptr + out_stride + column, tl.max(value, axis=0))
            tl.store(out_ptr + 2 * out_stride + column, tl.sum(bad, axis=0))
        else:
            tl.store(out_ptr + out_stride + column, 0x7FF8000000000000)  # float64 NaN
            tl.store(out_ptr + 2 * out_stride + column, 0)

    @triton.jit(
        do_not_specialize=["row_stride", "width", "out_stride", "first", "seed_high", "seed_middle", "seed_low"]
    )
    def _row_stats(
        bits_ptr,
        out_ptr,
        out_f64_ptr,
        row_stride,
        width,
        out_stride,
        first,
        seed_high,
        seed_middle,
        seed_low,
        IS_FLOAT: tl.constexpr,
        MAG_MASK: tl.constexpr,
        MAX_FINITE: tl.constexpr,
        WIDEN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        seed = (seed_high.to(tl.uint64) << 42) | (seed_middle.to(tl.uint64) << 21) | seed_low.to(tl.uint64)
        _one_row(
            bits_ptr + row * row_stride,
            width,
            seed,
            first + row,
            out_ptr,
            out_f64_ptr,
            out_stride,
            IS_FLOAT,
            MAG_MASK,
            MAX_FINITE,
            WIDEN,
            BLOCK,
        )

    @triton.jit(do_not_specialize=["out_stride"])
    def _grouped_row_stats(
        bits_ptr,
        description_ptr,
        out_ptr,
        out_f64_ptr,
        out_stride,
        IS_FLOAT: tl.constexpr,
        MAG_MASK: tl.constexpr,
        MAX_FINITE: tl.constexpr,
        WIDEN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        described = description_ptr + tl.program_id(0).to(tl.int64) * 5
        start = tl.load(described)  # elements from bits_ptr to the block's first
        width = tl.load(described + 1)
        rows = tl.load(described + 2)
        first = tl.load(described + 3)
        seed = tl.load(described + 4).to(tl.uint64, bitcast=True)
        for row in range(tl.program_id(1).to(tl.int64), rows, tl.num_programs(1).to(tl.int64)):
            _one_row(
                bits_ptr + start + row * width,
                width,
                seed,
                first + row,
                out_ptr,
                out_f64_ptr,
                out_stride,
                IS_FLOAT,
                MAG_MASK,
                MAX_FINITE,
                WIDEN,
                BLOCK,
            )
