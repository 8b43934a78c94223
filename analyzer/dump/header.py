"""A pass file's safetensors header, read and checked by us.

Opening a file, safetensors checks its header: JSON of the right types, every tensor's bytes
inside the file, laid end to end, nothing left over. For a decode step of a few MB, that check
plus parsing the same header again for its tensor entries cost more than indexing its tensors.
This reader vouches only for headers that pass those same checks (stricter where simpler: no
unknown fields, no repeated names, dtypes the analyzer reads) and leaves every other file to
safetensors, which opens it and names what is wrong. Decode steps repeat their tensor entries'
text: an entry list is checked once and recalled by its exact text.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import threading
from json.decoder import scanstring
from typing import Optional, Tuple

import numpy as np

from dumpdiff.dumper.format import PASS_META_KEY

from .dtypes import BY_CODE
from .layout import FileLayout
from .metacheck import ints_within

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
META_AT = '{"__metadata__":{%s:"' % json.dumps(PASS_META_KEY)  # how safetensors writes our one metadata key
REMEMBERED = 8  # entry lists kept: a run's prefill and decode shapes, other batch sizes

# entries text -> (a layout of them, whose checked entries later files share; the tensor names)
_by_text: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
_lock = threading.Lock()


@dataclasses.dataclass
class Header:
    meta_text: str  # the pass metadata, JSON text
    layout: FileLayout  # where each tensor lies; every entry checked
    names: frozenset  # the tensors in the file


def read_header(path: str, whole: bool = False, buffer_for=None) -> Tuple[Optional[Header], Optional[np.ndarray]]:
    """(the file's header when this reader vouches for it, else None; the file's bytes when
    ``whole``, read into ``buffer_for(n)`` (a uint8 array of at least n bytes) when given).
    Never raises: a file it cannot read is left to safetensors."""
    data = None
    try:
        with open(path, "rb", buffering=0 if buffer_for else -1) as handle:
            if whole:
                data = (
                    _read_into(handle, buffer_for)
                    if buffer_for is not None
                    else np.frombuffer(handle.read(), dtype=np.uint8)
                )
                size = int.from_bytes(data[:8].tobytes(), "little")
                head, file_size = data[8 : 8 + min(size, MAX_HEADER_BYTES + 1)].tobytes(), len(data)
            else:
                size = int.from_bytes(handle.read(8), "little")
                head = handle.read(size) if size <= MAX_HEADER_BYTES else b""
                file_size = os.fstat(handle.fileno()).st_size
    except OSError:
        return None, None
    if not 0 < size <= MAX_HEADER_BYTES or len(head) != size:
        return None, data
    return _vouched(head, 8 + size, file_size), data


def _read_into(handle, buffer_for) -> np.ndarray:
    """The rest of a file read into a buffer from ``buffer_for`` (one byte more than its size
    now: a file that grew shows as longer than the size the dump recorded)."""
    room = buffer_for(os.fstat(handle.fileno()).st_size + 1)
    view, got = memoryview(room), 0
    while got < len(room):
        n = handle.readinto(view[got:])
        if not n:
            return room[:got]
        got += n
    more = handle.read()  # it grew past the buffer while being read: its whole length shows
    return np.frombuffer(room.tobytes() + more, dtype=np.uint8) if more else room[:got]


def _vouched(head: bytes, data_start: int, file_size: int) -> Optional[Header]:
    try:
        text = head.decode("utf-8")  # strict, as safetensors: no invalid bytes, no surrogates
        if not text.startswith(META_AT):
            return None
        meta_text, end = scanstring(text, len(META_AT))  # strict: no raw control characters
        meta_text.encode("utf-8")  # a lone surrogate written as an escape: safetensors refuses it
    except ValueError:  # UnicodeError is one
        return None
    rest = text[end:].rstrip(" ")  # safetensors pads the header with spaces to a multiple of 8 bytes
    if rest.startswith('},"'):  # then the tensor entries: the top-level object's other members
        entries_text = "{" + rest[2:]
    elif rest == "}}":  # no tensors
        entries_text = "{}"
    else:
        return None
    known = _by_text.get(entries_text)
    if known is None or known[0].data_size != file_size - data_start:
        entries = _checked_entries(entries_text, file_size - data_start)
        if entries is None:
            return None
        known = (FileLayout(entries, data_start, file_size), frozenset(entries))
        with _lock:
            _by_text[entries_text] = known
            while len(_by_text) > REMEMBERED:
                _by_text.popitem(last=False)
    template, names = known
    layout = FileLayout(template.header, data_start, file_size)
    layout.share(template)
    return Header(meta_text, layout, names)


_SIGNED = re.compile(r"[\[,:]\s*-")  # a number with a sign ("-0" is 0 to Python, a float to safetensors)
FIELDS = ('"dtype":', '"shape":', '"data_offsets":')


def _checked_entries(text: str, data_size: int) -> Optional[dict]:
    """The tensor entries when safetensors would accept them for a data section of this size.
    Only entry lists without escapes and signs are vouched for (a tensor name with a quote or a
    backslash is left to safetensors): then each field is spelt as in FIELDS, and counting them
    finds a field or a name given twice, which json.loads would keep quiet about."""
    if "\\" in text or ("-" in text and _SIGNED.search(text)):
        return None
    try:
        entries = json.loads(text)
        "".join(entries).encode("utf-8")  # tensor names without lone surrogates
    except (ValueError, RecursionError):
        return None
    if "__metadata__" in entries or any(text.count(field) != len(entries) for field in FIELDS):
        return None
    spans = []
    for entry in entries.values():
        if type(entry) is not dict or len(entry) != 3:
            return None
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        dtype = BY_CODE.get(code) if type(code) is str else None
        if (
            dtype is None
            or not ints_within(shape, 0, 2**64)
            or not ints_within(offsets, 0, 2**64)
            or len(offsets) != 2
            or offsets[1] - offsets[0] != _byte_size(shape, dtype.size)
        ):
            return None
        spans.append(offsets)
    spans.sort()
    at = 0
    for begin, end in spans:  # laid end to end from the data's first byte to the file's last
        if begin != at:
            return None
        at = end
    return entries if at == data_size else None


def _byte_size(shape: list, size: int) -> int:
    """The tensor's bytes, or -1 where safetensors' 64-bit product overflows: it multiplies the
    dims left to right and refuses at the first overflow, a later 0 dim notwithstanding."""
    count = 1
    for dim in shape:
        count *= dim
        if count >= 2**64:
            return -1
    return count * size if count * size * 8 < 2**64 else -1
