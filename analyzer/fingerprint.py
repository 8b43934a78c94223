"""Exact, order-sensitive 64-bit fingerprints of tensor rows.

Each 8-byte word of a row goes through splitmix64 together with its position, and the mixed
words are summed modulo 2**64. Equal bytes give equal fingerprints; a changed bit, a swapped
pair of elements or a reordered row gives a different one except with probability ~2**-64.
(An XOR of elements would miss swaps.) Vectorized in numpy: no Python loop per element.

Speed: the index build hashes every byte of a dump, so it must keep up with the disk. The work
is cut into blocks of about a megabyte (rows x columns; the sum is associative, so a row may
span blocks) whose temporaries stay in the CPU cache, every ufunc writes in place, and blocks
are spread over a few threads (numpy releases the GIL inside its loops). ``row_stats`` also
takes each float row's largest finite magnitude and its count of non-finite values from the
same cached block, on the raw bits (|x| orders as its bits without the sign bit), so a row's
bytes are read from memory once.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Tuple

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
CHUNK_BYTES = 64 << 20  # bounds the temporary arrays of one call (kept for callers; see BLOCK_WORDS)
PARALLEL_MIN_BLOCKS = 4  # below this a tensor is hashed by the calling thread alone
THREADS = max(1, int(os.environ.get("DUMPDIFF_HASH_THREADS", "0") or 0) or min(os.cpu_count() or 1, 8))
# Words per block. Small blocks keep the temporaries in the L2 cache; large ones need fewer numpy
# calls per byte, so less time holding the GIL when many threads hash at once. Measured on a
# 16-core H200 host: 8 threads hashed 5.4 GB/s with 2 MiB blocks, 3.3 GB/s with 512 KiB blocks;
# on a 2-core machine 512 KiB blocks were the faster.
BLOCK_WORDS = int(os.environ.get("DUMPDIFF_HASH_BLOCK_WORDS", "0") or 0) or ((1 << 18) if THREADS >= 4 else (1 << 16))

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()
_local = threading.local()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="dumpdiff-hash")
        return _pool


def _splitmix(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def row_bytes(rows: torch.Tensor) -> np.ndarray:
    """[n, ...] tensor -> [n, row_bytes] uint8 array over the same bytes."""
    flat = rows.detach().contiguous().reshape(rows.shape[0], -1)
    return flat.view(torch.uint8).reshape(rows.shape[0], -1).numpy()


@functools.lru_cache(maxsize=None)
def _salt(width: int, dtype: torch.dtype) -> np.uint64:
    with np.errstate(over="ignore"):
        return np.uint64(width) * _GOLDEN + np.uint64(zlib.crc32(str(dtype).encode()))


def fingerprints(rows: torch.Tensor) -> np.ndarray:
    """One uint64 per row of an [n, ...] tensor; the dtype and row length are mixed in."""
    return row_stats(rows, magnitudes=False)[0]


@functools.lru_cache(maxsize=None)
def _magnitude_info(dtype: torch.dtype):
    """(unsigned int numpy type of the element, mask without the sign bit, bits of the largest
    finite value) for a float dtype: |x| <= max finite  <=>  (bits & mask) <= that."""
    size = torch.empty((), dtype=dtype).element_size()
    utype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype).view(itype).item()
    mask = (1 << (8 * size - 1)) - 1
    return utype, utype(mask), utype(top & mask), size


_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def _bits_to_float(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Magnitude bits (unsigned) -> their float values as float64."""
    if dtype in _NUMPY_FLOATS:
        return np.ascontiguousarray(bits).view(_NUMPY_FLOATS[dtype]).astype(np.float64)
    if dtype == torch.bfloat16:  # the top half of a float32
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.dtype.itemsize]
    signed = bits.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[bits.dtype.itemsize])
    return torch.from_numpy(np.ascontiguousarray(signed)).view(itype).view(dtype).double().numpy()


def row_stats(rows: torch.Tensor, magnitudes: bool = True, min_parallel_blocks: int = PARALLEL_MIN_BLOCKS
              ) -> Tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
    """(fingerprints uint64, largest finite |x| per row as float64 (None for non-float rows or
    when not asked), non-finite count per row int32) of an [n, ...] tensor, in one pass. A tensor
    of at least ``min_parallel_blocks`` blocks is spread over the hashing threads."""
    n = rows.shape[0]
    floating = magnitudes and rows.is_floating_point()
    if n == 0:
        return np.zeros(0, np.uint64), (np.zeros(0) if floating else None), np.zeros(0, np.int32)
    data = row_bytes(rows)
    width = data.shape[1] if data.ndim == 2 else 0
    pad = (-width) % 8
    n_words = (width + pad) // 8
    with np.errstate(over="ignore"):
        offsets = np.arange(n_words, dtype=np.uint64) * _GOLDEN + _salt(width, rows.dtype)
    fps = np.zeros(n, dtype=np.uint64)
    nonfinite = np.zeros(n, dtype=np.int32)
    if n == 0 or n_words == 0:
        return fps, (np.zeros(n) if floating else None), nonfinite
    mag = _magnitude_info(rows.dtype) if floating else None
    if pad:
        words = None  # padded per block below
    else:
        words = data.view(np.uint64)
        if n * n_words <= BLOCK_WORDS:  # small (a decode step's rows): one block, no machinery
            with np.errstate(over="ignore"):
                z = words + offsets
                z ^= z >> _S30
                z *= _M1
                z ^= z >> _S27
                z *= _M2
                z ^= z >> _S31
                fps = z.sum(axis=1, dtype=np.uint64)
            if not mag:
                return fps, None, nonfinite
            top = np.bitwise_and(words.view(mag[0]), mag[1]).max(axis=1)
            return (fps,) + _finish_magnitudes(top, data, mag, rows.dtype, nonfinite)
    col_block = min(n_words, BLOCK_WORDS)
    row_block = max(1, BLOCK_WORDS // col_block)
    items = [(r0, min(n, r0 + row_block), c0, min(n_words, c0 + col_block))
             for r0 in range(0, n, row_block) for c0 in range(0, n_words, col_block)]

    def run(part):
        acc = np.zeros(n, dtype=np.uint64)
        top = np.zeros(n, dtype=mag[0]) if mag else None
        buffers = getattr(_local, "buffers", None)
        if buffers is None or buffers[0].size < row_block * col_block:
            buffers = _local.buffers = (np.empty(row_block * col_block, np.uint64),
                                        np.empty(row_block * col_block, np.uint64),
                                        np.empty(row_block * col_block * 8, np.uint8))
        with np.errstate(over="ignore"):
            for r0, r1, c0, c1 in part:
                k, m = r1 - r0, c1 - c0
                if words is not None:
                    block = words[r0:r1, c0:c1]
                else:
                    raw = buffers[2][:k * m * 8].reshape(k, m * 8)
                    raw[:] = 0
                    lo, hi = c0 * 8, min(c1 * 8, width)
                    raw[:, :hi - lo] = data[r0:r1, lo:hi]
                    block = raw.view(np.uint64)
                z = buffers[0][:k * m].reshape(k, m)
                t = buffers[1][:k * m].reshape(k, m)
                np.add(block, offsets[c0:c1], out=z)
                np.right_shift(z, _S30, out=t)
                np.bitwise_xor(z, t, out=z)
                np.multiply(z, _M1, out=z)
                np.right_shift(z, _S27, out=t)
                np.bitwise_xor(z, t, out=z)
                np.multiply(z, _M2, out=z)
                np.right_shift(z, _S31, out=t)
                np.bitwise_xor(z, t, out=z)
                acc[r0:r1] += z.sum(axis=1, dtype=np.uint64)
                if mag:
                    elems = block.view(mag[0])  # the same bytes as elements (pad bytes are zeros)
                    bits = np.bitwise_and(elems, mag[1], out=t.view(mag[0]))  # t is free again
                    np.maximum(top[r0:r1], bits.max(axis=1), out=top[r0:r1])
        return acc, top

    if len(items) >= min_parallel_blocks and THREADS > 1:
        parts = [items[i::THREADS] for i in range(THREADS)]
        results = list(_executor().map(run, parts))
    else:
        results = [run(items)]
    with np.errstate(over="ignore"):
        for acc, _ in results:
            fps += acc
    if not mag:
        return fps, None, nonfinite
    top = results[0][1]
    for _, other in results[1:]:
        np.maximum(top, other, out=top)
    return (fps,) + _finish_magnitudes(top, data, mag, rows.dtype, nonfinite)


def _finish_magnitudes(top: np.ndarray, data: np.ndarray, mag, dtype: torch.dtype, nonfinite: np.ndarray):
    """(largest finite |x| per row, non-finite count per row) from each row's largest magnitude bits."""
    amax = _bits_to_float(top, dtype)
    bad = np.nonzero(top > mag[2])[0]
    if len(bad):  # rows holding inf or NaN: count them, and take the largest finite magnitude
        elems = np.ascontiguousarray(data[bad]).view(mag[0])
        bits = np.bitwise_and(elems, mag[1])
        finite = bits <= mag[2]
        nonfinite[bad] = (~finite).sum(axis=1)
        amax[bad] = _bits_to_float(np.where(finite, bits, 0).max(axis=1).astype(mag[0]), dtype)
    return amax, nonfinite


def as_signed(fp: np.ndarray) -> np.ndarray:
    """parquet and pandas handle int64 everywhere; the bits are the same."""
    return fp.view(np.int64)
