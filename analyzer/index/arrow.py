"""Index tables as pyarrow Tables, assembled from numpy arrays and Python lists without pandas.

pyarrow's own converters (``pa.array``, ``Table.from_pandas``) import pandas on first use: 0.6 s
on a slow host, a tenth of indexing a 7 GB dump pair. Arrays here are built from their buffers.

A column is a numpy array (integers, floats, bools), a list of str or None (text; None is null),
or a ``Dictionary`` (text as integer codes into a vocabulary: a million rows naming a few hundred
tensors).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Union

import numpy as np

from ..errors import DumpError
from .columns import merged_vocabulary, recode


class Dictionary(NamedTuple):
    codes: np.ndarray  # integers, one per row
    vocabulary: np.ndarray  # distinct strings, sorted


class TextPieces(NamedTuple):
    """A text column of many passes, pass by pass: the passes of one structure share one list,
    turned into an arrow array once."""

    pieces: list


Column = Union[np.ndarray, list, Dictionary, TextPieces]


def dictionary(values: List[str], repeats: np.ndarray) -> Dictionary:
    """Each of ``values`` repeated ``repeats`` times, as a Dictionary."""
    vocabulary, codes = np.unique(np.array(values, dtype=str), return_inverse=True)
    return Dictionary(np.repeat(codes.reshape(-1), repeats), vocabulary.astype(object))


def length(values: Column) -> int:
    if isinstance(values, TextPieces):
        return sum(map(len, values.pieces))
    return len(values.codes) if isinstance(values, Dictionary) else len(values)


def decoded(values: Dictionary) -> list:
    """A Dictionary's values, spelled out."""
    return values.vocabulary[values.codes].tolist()


def encoded(values: list) -> Dictionary:
    """A text column without nulls as a Dictionary: thousands of rows repeat a few hundred names,
    and a reader turns codes into strings far faster than it decodes each string."""
    lookup: Dict[str, int] = {}
    codes = np.fromiter((lookup.setdefault(v, len(lookup)) for v in values), np.int64, len(values))
    words = np.array(list(lookup), dtype=object)
    order = np.argsort(words.astype(str)) if len(words) else np.zeros(0, np.int64)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return Dictionary(rank[codes] if len(codes) else codes, words[order])


def concat(parts: List[Dict[str, Column]]) -> Dict[str, Column]:
    """The tables of several passes as one; every part has the same columns."""
    if not parts:
        return {}
    out: Dict[str, Column] = {}
    for name, first in parts[0].items():
        pieces = [part[name] for part in parts]
        if isinstance(first, Dictionary):
            # Passes of one structure repeat one vocabulary: each distinct one is merged once.
            keys = [tuple(p.vocabulary.tolist()) for p in pieces]
            distinct = {}
            for key, p in zip(keys, pieces):
                distinct.setdefault(key, p.vocabulary)
            vocabulary = merged_vocabulary(*distinct.values())
            recoded = {key: recode(v, vocabulary) for key, v in distinct.items()}
            out[name] = Dictionary(np.concatenate([recoded[key][p.codes] for key, p in zip(keys, pieces)]), vocabulary)
        elif isinstance(first, list):
            out[name] = TextPieces(pieces)
        else:
            out[name] = np.concatenate(pieces)
    return out


def table(columns: Dict[str, Column], encode=()):
    """A pyarrow Table; the text columns named in ``encode`` are stored dictionary-encoded when
    they hold no null."""
    import pyarrow as pa

    def flat(values):
        return [v for piece in values.pieces for v in piece] if isinstance(values, TextPieces) else values

    columns = {
        name: values
        if name not in encode or not isinstance(values, (list, TextPieces)) or None in flat(values)
        else encoded(flat(values))
        for name, values in columns.items()
    }
    return pa.Table.from_arrays([_array(values) for values in columns.values()], names=list(columns))


def _array(values: Column):
    import pyarrow as pa

    if isinstance(values, Dictionary):
        n_words = len(values.vocabulary)
        kind = np.int8 if n_words < 1 << 7 else np.int16 if n_words < 1 << 15 else np.int32
        indices = _numbers(np.asarray(values.codes).astype(kind))
        return pa.DictionaryArray.from_arrays(indices, _text(list(values.vocabulary), large=False))
    if isinstance(values, TextPieces):
        # Passes of one structure repeat one list; pieces equal by value are made once (a worker
        # process's pieces come back as copies: shared by value, no longer by identity).
        by_value: dict = {}
        pieces = [by_value.setdefault(tuple(piece), piece) for piece in values.pieces]
        if len(by_value) * 2 > len(pieces):  # few repeat: one array
            return _text([v for piece in pieces for v in piece])
        made = {}  # id of a distinct piece -> its array
        for piece in pieces:
            if id(piece) not in made:
                made[id(piece)] = _text(piece)
        return pa.concat_arrays([made[id(piece)] for piece in pieces])
    if isinstance(values, list) or values.dtype == object:
        return _text(list(values))
    return _numbers(values)


def _numbers(values: np.ndarray):
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    if values.dtype == bool:
        return pa.Array.from_buffers(
            pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))]
        )
    kind = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _text(values: list, large: bool = True):
    """Strings (None: null) as an arrow string array."""
    import pyarrow as pa

    try:
        encoded = [v.encode() if v is not None else b"" for v in values]
    except UnicodeEncodeError as exc:  # a lone surrogate, from a JSON escape in a damaged header
        raise DumpError(
            f"a name in the pass metadata is not valid Unicode ({exc.object[:60]!r}); the dump is damaged"
        ) from None
    offsets = np.zeros(len(values) + 1, np.int64 if large else np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    valid = np.fromiter((v is not None for v in values), bool, len(values))
    bitmap = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    kind = pa.large_string() if large else pa.string()
    return pa.Array.from_buffers(
        kind,
        len(values),
        [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))],
        null_count=int(len(values) - valid.sum()),
    )
