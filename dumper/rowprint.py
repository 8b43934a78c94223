"""Row fingerprints computed where a tensor lies: exact, order-sensitive, the same on every device.

A row's fingerprint is a sum, modulo 2**64, of one mixed word per element, finished by a full
mix with the element type and the row length:

    word_j = m(bits_j + (j + 1) * K)      bits_j: element j's raw bits as a signed integer of its width
    m(z)   = xorshift32(z * C1) * C2      (C1, C2 odd: each step is a bijection of 64-bit words)
    fp     = mix(sum_j word_j  XOR  seed(dtype, row length))      mix: splitmix64's finalizer

Everything is integer arithmetic on int64 tensors, whose products and sums wrap modulo 2**64 in
torch on CPU and CUDA alike, and a modular sum does not depend on the order a kernel adds in:
the fingerprint of a row's bytes is one number whatever device, thread count or reduction tree
computed it (tests/test_rowprint.py checks CPU against CUDA and against a plain Python reference).

What it catches: a change of one element changes its word (m is a bijection and j is fixed) and
so the sum: always detected, a single ulp or a sign flip included. Any other change (a swapped
pair, a reordered row, changes in several elements) changes the sum unless the changed words'
differences cancel modulo 2**64; modelling m as a random function, that happens with probability
2**-64 per compared pair of rows (about 5e-20: a dump pair of 1e9 row comparisons misses one with
probability under 1e-10). An XOR of words, or a plain sum of elements, would miss every swap: the
position j inside each word is what makes order count. m has one xorshift where splitmix has
three: each element costs 8 tensor operations instead of 14 (the host pays for each); the full
mix is kept for the once-per-row finish, where every bit of the sum must reach every bit of the
print.
"""

from __future__ import annotations

import math
import sys
import zlib
from typing import Dict, Tuple

import torch

VERSION = 1  # recorded in every fingerprint dump; a reader refuses another
_M64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    value &= _M64
    return value - (1 << 64) if value >> 63 else value


GOLDEN = _signed(0x9E3779B97F4A7C15)  # K: odd, so (j + 1) * K differs for every j below 2**64
MIX_1 = _signed(0xBF58476D1CE4E5B9)
MIX_2 = _signed(0x94D049BB133111EB)
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_ELEMENTS = 1 << 24  # at most this many elements are worked on at once (int64 temporaries: 128 MB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 words (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, in place on a fresh int64 tensor: a bijection of 64-bit words."""
    x ^= _shift_right(x, 30)
    x *= MIX_1
    x ^= _shift_right(x, 27)
    x *= MIX_2
    x ^= _shift_right(x, 31)
    return x


def seed(dtype: torch.dtype, width: int) -> int:
    """What a row's type and length add: equal bytes of another type or length print otherwise."""
    name = str(dtype).replace("torch.", "")
    return _signed(width * GOLDEN + zlib.crc32(name.encode()))


_keys: Dict[Tuple[torch.device, int], torch.Tensor] = {}


def _position_keys(width: int, device: torch.device) -> torch.Tensor:
    """(j + 1) * K for every element position j of a row, made once per width and device."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # made by the graph itself, in its own pool: a cached tensor could be dropped from the cache
        # (and its memory reused) while the graph still reads it
        return torch.arange(1, width + 1, dtype=torch.int64, device=device) * GOLDEN
    key = (device, width)
    found = _keys.get(key)
    if found is None:
        if len(_keys) > 64:
            _keys.clear()
        found = _keys[key] = torch.arange(1, width + 1, dtype=torch.int64, device=device) * GOLDEN
    return found


def signed_bits(rows: torch.Tensor) -> torch.Tensor:
    """The rows' elements as signed integers of their width: a view, or the rows themselves."""
    kind = INT_OF_SIZE[rows.element_size()]
    return rows if rows.dtype == kind else rows.view(kind)


def element_bits(rows: torch.Tensor) -> torch.Tensor:
    """The rows' elements as signed integers of their width, widened to int64 (a new tensor)."""
    bits = signed_bits(rows)
    # a new contiguous tensor: never the caller's own int64 storage (it is worked on in place),
    # and its 32-bit halves can be viewed (fingerprints)
    return torch.empty(bits.shape, dtype=torch.int64, device=bits.device).copy_(bits)


def fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """int64 fingerprint of each row of a 2-D tensor [n, width] of any stored element type."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be 2-D [n, width], not {list(rows.shape)}")
    return mix(seeded_sums(rows))


def seeded_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum of mixed words XOR its seed: the fingerprint before its final mix, which
    the rows of many tensors take together (passprints: a dozen kernels fewer per row width)."""
    n, width = rows.shape
    if not (n and width):
        sums = torch.zeros(n, dtype=torch.int64, device=rows.device)
    else:
        keys = _position_keys(width, rows.device)
        step = max(1, _chunk_elements(rows.device) // width)
        sums = _joined([_mixed_word_sums(rows[start : start + step], keys) for start in range(0, n, step)])
    sums ^= seed(rows.dtype, width)
    return sums


def _mixed_word_sums(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row, the sum modulo 2**64 of m(bits_j + (j + 1) * K) over its elements."""
    words = element_bits(rows)
    words += keys
    words *= MIX_1
    _fold_halves(words)
    words *= MIX_2
    return words.sum(dim=1)


def _joined(parts: list) -> torch.Tensor:
    """The parts one after the other: the part itself when there is one (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fold_halves(words: torch.Tensor) -> None:
    """words ^= words >>> 32, in place on contiguous int64 words: the high half XORed into the low
    half, read through an int32 view (little-endian: low half first), with no temporary."""
    if _LITTLE_ENDIAN and words.is_contiguous():
        halves = words.view(torch.int32).view(*words.shape, 2)
        halves[..., 0] ^= halves[..., 1]
    else:
        words ^= _shift_right(words, 32)


_LITTLE_ENDIAN = sys.byteorder == "little"  # every CUDA host is; the view is the host's byte order


def _chunk_elements(device: torch.device) -> int:
    """Elements worked on at once: on a CPU a chunk whose int64 temporaries stay in cache; on a GPU
    a large one (each operation is a kernel launch)."""
    return CHUNK_ELEMENTS if device.type != "cpu" else min(CHUNK_ELEMENTS, 1 << 18)


# Largest finite magnitude of each float type, as bits without the sign: |x| <= max <=> (bits & ~sign) <= this.
MAX_FINITE_BITS = {
    torch.float64: 0x7FEFFFFFFFFFFFFF,
    torch.float32: 0x7F7FFFFF,
    torch.float16: 0x7BFF,
    torch.bfloat16: 0x7F7F,
}
for _name, _bits in (("float8_e4m3fn", 0x7E), ("float8_e5m2", 0x7B)):
    if hasattr(torch, _name):
        MAX_FINITE_BITS[getattr(torch, _name)] = _bits


def magnitudes(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(largest finite |x| per row as float64, NaN/inf count per row as int32) of float rows;
    (NaN, 0) per row for integer and bool rows. Worked on the bits: without the sign bit, a float's
    bits order as its magnitude does, and those above the largest finite one are inf or NaN. The
    float64 values are exact: each is one of the row's own elements."""
    n, width = rows.shape
    device = rows.device
    if rows.dtype not in MAX_FINITE_BITS:
        return (
            torch.full((n,), float("nan"), dtype=torch.float64, device=device),
            torch.zeros(n, dtype=torch.int32, device=device),
        )
    size = rows.element_size()
    magnitude = rows.view(INT_OF_SIZE[size]) & ((1 << (8 * size - 1)) - 1)  # the sign bit cleared
    if size == 1:
        magnitude = magnitude.to(torch.int16)  # few kernels take uint8 reductions alike; values are < 128
    if width and device.type == "cpu":
        # rows without inf or NaN (nearly all) need one pass, not four; a GPU would have to wait
        # for the check, and a graph capture cannot, so it always takes the full path
        peak = magnitude.amax(dim=1)
        if not bool((peak > MAX_FINITE_BITS[rows.dtype]).any()):
            largest = peak.to(INT_OF_SIZE[size])
            return largest.view(rows.dtype).to(torch.float64), torch.zeros(n, dtype=torch.int32)
    too_large = magnitude > MAX_FINITE_BITS[rows.dtype]
    nonfinite = too_large.sum(dim=1, dtype=torch.int32)
    if not width:
        return torch.zeros(n, dtype=torch.float64, device=device), nonfinite
    largest = magnitude.masked_fill_(too_large, 0).amax(dim=1).to(INT_OF_SIZE[size])
    return largest.view(rows.dtype).to(torch.float64), nonfinite


def row_stats(rows: torch.Tensor) -> torch.Tensor:
    """[3, n] int64 of a 2-D tensor's rows: fingerprint, largest finite |x| (float64 bits; NaN for
    integer rows), NaN/inf count. One tensor: one copy to the host per batch of rows."""
    return stats_table([seeded_sums(rows)], [magnitudes(rows)])


def stats_table(sums: list, magnitudes_of: list) -> torch.Tensor:
    """row_stats of several row blocks at once, in order, from each block's seeded_sums (consumed:
    mixed in place) and magnitudes, on one device: the final mix is one set of kernels for all."""
    fingerprint = mix(_joined(sums))
    largest = _joined([m[0] for m in magnitudes_of])
    nonfinite = _joined([m[1] for m in magnitudes_of])
    return torch.stack([fingerprint, largest.view(torch.int64), nonfinite.to(torch.int64)])


def as_rows(tensor: torch.Tensor, token_dims) -> torch.Tensor:
    """The tensor as [token rows, elements]: token dims moved to the front and flattened; with no
    token dims, the whole tensor as one row."""
    if token_dims is None:
        return tensor.reshape(1, tensor.numel())
    k = len(token_dims)
    leading = _LEADING[k] if k < len(_LEADING) else list(range(k))
    moved = tensor if token_dims == leading else tensor.movedim(list(token_dims), leading)
    shape = moved.shape
    if k == 1 and len(shape) == 2:
        return moved  # already [rows, elements] (hooks stage hundreds of these a step)
    return moved.reshape(math.prod(shape[:k]), math.prod(shape[k:]))  # not -1: zero rows is a shape too


_LEADING = [list(range(k)) for k in range(8)]  # token dims already at the front, compared without a new list
