"""The alignment proof between two runs of one model that need not agree bit for bit.

Token ids and positions must be equal on every pair, as for prefill against decode. The
embedding output (a lookup: no arithmetic) must then be bit-identical when both runs hold the
same element type; across types the finer side's values, rounded to the coarser type (round to
nearest, ties to even, as a cast does), must be the coarser side's bits: the same weights looked
up at the same ids. A run whose weights differ fails here, whatever its dtype."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from ..dump.dtypes import BY_NAME, DType, eps, tiny, to_float32, to_float64
from ..dump.load import show
from ..errors import DumpError
from ..index.rows import reader_of
from ..index.table import Index
from .align import Alignment, embedding_call

MAX_PROOF_ROWS = 4096  # embedding rows read for the proof (spread evenly beyond this)
ULPS = 2  # how far an embedding that computes after its lookup may round, in the coarser type


def round_bits(bits: np.ndarray, dtype: DType, into: DType) -> np.ndarray:
    """Elements of ``dtype`` (held as bits) rounded to the coarser ``into``, as ``into``'s bits."""
    values = to_float32(bits, dtype) if dtype.size <= 4 else bits.view(np.float64).astype(np.float32)
    if into.name == "float32":
        return values.view(np.uint32)
    if into.name == "float16":
        return values.astype(np.float16).view(np.uint16)
    if into.name == "bfloat16":
        word = values.view(np.uint32).astype(np.uint64)
        return ((word + 0x7FFF + ((word >> 16) & 1)) >> 16).astype(np.uint16)
    raise DumpError(f"cannot compare embeddings of {dtype.name} and {into.name}")


def prove_embeddings(alignment: Alignment, a: Index, b: Index, label_a: str, label_b: str) -> Tuple[str, bool]:
    """The proof line for the embedding output, and whether one run's embedding output is the
    other's scaled by sqrt(hidden_size) (then the two outputs are not compared as one op); raises
    DumpError when it does not hold."""
    emb_a, emb_b = embedding_call(a), embedding_call(b)
    if emb_a is None or emb_b is None:
        raise DumpError(
            f"cannot prove the alignment: {label_a if emb_a is None else label_b} has no dumped embedding call (a "
            "module taking the token ids); widen DUMPER_FILTER to include it, or pass --trust-alignment"
        )
    pairs = alignment.cols
    pick = np.arange(len(pairs))
    if len(pick) > MAX_PROOF_ROWS:
        pick = np.linspace(0, len(pairs) - 1, MAX_PROOF_ROWS).astype(np.int64)
    bits_a, type_a = _rows(a, emb_a[1], pairs["pass_a"][pick], pairs["row_a"][pick])
    bits_b, type_b = _rows(b, emb_b[1], pairs["pass_b"][pick], pairs["row_b"][pick])
    held = [i for i in range(len(pick)) if bits_a[i] is not None and bits_b[i] is not None]
    if not held:
        raise DumpError(
            "cannot prove the alignment: the embedding output has no token rows in common between the dumps"
        )
    if type_a == type_b:
        fine, coarse, how = type_a, type_a, "bit-identical"
        same = [np.array_equal(bits_a[i], bits_b[i]) for i in held]
    else:
        if type_a.size == type_b.size:  # float16 against bfloat16: neither is the other rounded
            raise DumpError(
                f"cannot prove the alignment: the embeddings are {type_a.name} and {type_b.name}, neither a rounding of "
                "the other; pass --trust-alignment"
            )
        fine, coarse = (type_a, type_b) if type_a.size > type_b.size else (type_b, type_a)
        fine_bits, coarse_bits = (bits_a, bits_b) if fine is type_a else (bits_b, bits_a)
        same = [np.array_equal(round_bits(fine_bits[i], fine, coarse), coarse_bits[i]) for i in held]
        how = f"equal after rounding {fine.name} to {coarse.name}"
    bad = len(same) - sum(same)
    shown = emb_b[0] if emb_a[0] == emb_b[0] else f"{emb_a[0]} and {emb_b[0]}"
    sampled = "" if len(pick) == len(pairs) else f" (an even sample of {len(pick)})"
    if bad:
        # An embedding that computes after its lookup (Gemma's scales it by sqrt(hidden) in the
        # model's dtype) rounds once more in each run: then each element must lie within
        # ULPS units in the last place of the coarser type, which other weights or another
        # token's row miss by far.
        near = [_within_ulps(bits_a[i], type_a, bits_b[i], type_b, coarse) for i in held]
        scaled = _scaled_side(bits_a, type_a, bits_b, type_b, coarse, held) if not all(near) else None
        if scaled is not None:
            scaled, plain = (label_a, label_b) if scaled == "a" else (label_b, label_a)
            return (
                f"embedding output ({shown}) of {show(scaled)} within {ULPS} {coarse.name} units in the last place of "
                f"{show(plain)}'s times sqrt(hidden_size) on all {len(held)} paired rows read{sampled}: one run "
                "scales the looked-up rows inside its embedding module, the other after it (Gemma's in HF and an "
                "engine), so the same weights were looked up at the same token ids; the embedding output itself is "
                "not compared, the scaled rows are (the first layer's input)",
                True,
            )
        if not all(near):
            first = held[near.index(False)]
            raise DumpError(
                f"alignment proof failed: the embedding outputs ({shown}) differ on {len(near) - sum(near)} of "
                f"{len(held)} paired rows (first: position {pairs['pos'][pick[first]]}) by more than {ULPS} "
                f"{coarse.name} units in the last place (they must be {how}, or that near where the embedding "
                "computes after its lookup): the runs use different weights or the rows are misaligned; no verdict "
                "is given"
            )
        return (
            f"embedding output ({shown}) within {ULPS} {coarse.name} units in the last place on all {len(held)} paired "
            f"rows read{sampled} ({how} on {len(held) - bad}): the embedding computes after its lookup (a scale, as "
            "Gemma's), so the same weights looked up at the same token ids round once more in each run",
            False,
        )
    if how == "bit-identical":
        return f"embedding output ({shown}) bit-identical on all {len(held)} paired rows read{sampled}", False
    return (
        f"embedding output ({shown}) {how} on all {len(held)} paired rows read{sampled}: {type_a.name} and "
        f"{type_b.name} values cannot be bit-identical, so the {coarse.name} side is checked to be the other rounded "
        "(the same weights looked up at the same token ids)",
        False,
    )


def _within_ulps(bits_a, type_a: DType, bits_b, type_b: DType, coarse: DType) -> bool:
    """Whether every element of two rows lies within ULPS units in the last place of ``coarse``
    (at the larger of the two magnitudes)."""
    a, b = to_float64(bits_a, type_a), to_float64(bits_b, type_b)
    return a.shape == b.shape and _close(a, b, coarse)


def _scaled_side(bits_a, type_a: DType, bits_b, type_b: DType, coarse: DType, held) -> Optional[str]:
    """ "a" or "b": the run whose embedding rows are, on every held row, the other's times
    sqrt(hidden_size) (the row's width) within ULPS units in the last place of ``coarse``; None
    when neither is. Gemma multiplies its looked-up rows by sqrt(hidden_size): HF inside its
    embedding module, vLLM after it. One factor for every element of every row, fixed by the
    width, is what other weights or other tokens miss by far."""
    for scaled, rows_s, type_s, rows_p, type_p in (
        ("a", bits_a, type_a, bits_b, type_b),
        ("b", bits_b, type_b, bits_a, type_a),
    ):
        factor = None
        for i in held:
            s, p = to_float64(rows_s[i], type_s), to_float64(rows_p[i], type_p)
            factor = factor or math.sqrt(s.size)
            if s.shape != p.shape or not s.size or not _close(s, p * factor, coarse):
                break
        else:
            if factor is not None:
                return scaled
    return None


def _close(a: np.ndarray, b: np.ndarray, coarse: DType) -> bool:
    """Whether a and b (of one shape) are finite alike and within ULPS units in the last place of ``coarse``."""
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return False
    finite = np.isfinite(a)
    a, b = a[finite], b[finite]
    ulp = eps(coarse) * np.maximum(np.maximum(np.abs(a), np.abs(b)), tiny(coarse))
    return bool(np.all(np.abs(a - b) <= ULPS * ulp))


def _rows(index: Index, tensor: str, passes, rows):
    """Per (pass, row), the tensor's row as bits (None where not stored), and its element type."""
    reader = reader_of(index)
    out, kind = [None] * len(passes), None
    for pass_id in np.unique(passes).tolist():
        srows = reader.srows(int(pass_id), tensor)
        at = [i for i in np.nonzero(passes == pass_id)[0].tolist() if int(rows[i]) in srows]
        if not at:
            continue
        bits, kind = reader.stored_bits(int(pass_id), tensor, [srows[int(rows[i])] for i in at])
        bits = bits.reshape(len(at), -1)
        for k, i in enumerate(at):
            out[i] = bits[k]
    return out, kind or BY_NAME["float32"]
