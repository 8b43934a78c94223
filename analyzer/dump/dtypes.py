"""Element types of dumped tensors, handled as raw bits in numpy (no torch needed to analyse).

A dump stores each tensor's bytes with a safetensors dtype code. The analyzer keeps them as
unsigned integers of the same width, which is all that hashing, row slicing and bit-equality
need, and turns them into float64 only where numbers are shown (error figures, magnitudes).
numpy has no bfloat16 or float8, so those are decoded from their bits here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # torch's name, as reports print it: float32, bfloat16, int64 ...
    code: str  # safetensors' code: F32, BF16, I64 ...
    size: int  # bytes per element
    kind: str  # "float", "int" or "bool"
    native: Optional[type] = None  # the numpy type holding the values, where numpy has one

    @property
    def bits(self) -> type:
        """The unsigned numpy type of the same width: how elements are held."""
        return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[self.size]

    @property
    def floating(self) -> bool:
        return self.kind == "float"


_ALL = [
    DType("float64", "F64", 8, "float", np.float64),
    DType("float32", "F32", 4, "float", np.float32),
    DType("float16", "F16", 2, "float", np.float16),
    DType("bfloat16", "BF16", 2, "float"),
    DType("float8_e4m3fn", "F8_E4M3", 1, "float"),
    DType("float8_e5m2", "F8_E5M2", 1, "float"),
    DType("int64", "I64", 8, "int", np.int64),
    DType("int32", "I32", 4, "int", np.int32),
    DType("int16", "I16", 2, "int", np.int16),
    DType("int8", "I8", 1, "int", np.int8),
    DType("uint64", "U64", 8, "int", np.uint64),
    DType("uint32", "U32", 4, "int", np.uint32),
    DType("uint16", "U16", 2, "int", np.uint16),
    DType("uint8", "U8", 1, "int", np.uint8),
    DType("bool", "BOOL", 1, "bool", np.bool_),
]
BY_CODE = {d.code: d for d in _ALL}
BY_NAME = {d.name: d for d in _ALL}


def of_torch(dtype) -> DType:
    """The DType of a torch dtype (``torch.float32`` -> float32), without importing torch."""
    return BY_NAME[str(dtype).replace("torch.", "")]


# Largest finite magnitude, as bits without the sign bit: |x| <= max  <=>  (bits & mask) <= this.
_MAX_FINITE_BITS = {
    "float64": 0x7FEFFFFFFFFFFFFF,
    "float32": 0x7F7FFFFF,
    "float16": 0x7BFF,
    "bfloat16": 0x7F7F,
    "float8_e4m3fn": 0x7E,
    "float8_e5m2": 0x7B,
}


# (exponent bits, mantissa bits) of each float type: its epsilon and smallest normal number.
_FLOAT_FIELDS = {
    "float64": (11, 52),
    "float32": (8, 23),
    "float16": (5, 10),
    "bfloat16": (8, 7),
    "float8_e4m3fn": (4, 3),
    "float8_e5m2": (5, 2),
}


def eps(dtype: DType) -> float:
    """The gap between 1 and the next float (torch.finfo(dtype).eps)."""
    return 2.0 ** -_FLOAT_FIELDS[dtype.name][1]


def tiny(dtype: DType) -> float:
    """The smallest positive normal number (torch.finfo(dtype).tiny)."""
    return 2.0 ** (2 - 2 ** (_FLOAT_FIELDS[dtype.name][0] - 1))


def magnitude_mask(dtype: DType):
    """(mask without the sign bit, bits of the largest finite value), both of dtype.bits."""
    return dtype.bits((1 << (8 * dtype.size - 1)) - 1), dtype.bits(_MAX_FINITE_BITS[dtype.name])


@functools.lru_cache(maxsize=None)
def _e4m3_table() -> np.ndarray:
    """float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinity, S.1111.111 is NaN."""
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, b & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    mag[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b & 0x80, -mag, mag)


def to_float32(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Elements held as bits (dtype.bits) of a float type of 4 bytes or fewer -> their values as
    float32, exactly (every such value is a float32)."""
    bits = np.ascontiguousarray(bits)
    if dtype.name == "float32":
        return bits.view(np.float32)
    if dtype.name == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype.name == "float16":
        return bits.view(np.float16).astype(np.float32)
    return to_float64(bits, dtype).astype(np.float32)  # float8: 256 values, from a table


def to_float64(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Elements held as bits (dtype.bits) -> their values as float64."""
    bits = np.ascontiguousarray(bits)
    if dtype.native is not None:
        return bits.view(dtype.native).astype(np.float64)
    if dtype.name == "bfloat16":  # the top half of a float32
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    if dtype.name == "float8_e5m2":  # the top byte of a float16
        return (bits.astype(np.uint16) << np.uint16(8)).view(np.float16).astype(np.float64)
    if dtype.name == "float8_e4m3fn":
        return _e4m3_table()[bits]
    raise ValueError(f"no float values for {dtype.name}")
