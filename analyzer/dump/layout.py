"""Where each tensor lies in a safetensors pass file, read from its header by us (no safetensors
call per tensor): the index build and the row reader slice tensors out of plain reads."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

import numpy as np

from ..errors import DumpError, show
from .dtypes import BY_CODE

MAX_HEADER_BYTES = 1 << 30


class FileLayout:
    """Where each tensor of a safetensors file lies, from its header; entries are checked when
    asked for (a reader of a few rows needs one or two of hundreds). ``share`` hands this layout
    the checked entries of an earlier file whose tensors lie the same way (decode steps)."""

    def __init__(self, header: dict, data_start: int, file_size: int) -> None:
        self.header, self._start, self.file_size = header, data_start, file_size
        self._entries: Dict[str, Optional[tuple]] = {}  # offsets from the data start

    def get(self, name: str):
        """(DType, shape, first byte, end byte) of a tensor, or None when the header does not say
        it in a way this reader follows (then safetensors reads the tensor and names the trouble)."""
        entry = self._entries.get(name, False)
        if entry is False:
            entry = self._entries[name] = self._entry(name)
        return None if entry is None else (entry[0], entry[1], self._start + entry[2], self._start + entry[3])

    @property
    def data_size(self) -> int:
        return self.file_size - self._start

    def tensor_entries(self) -> dict:
        """The header's tensor entries (all but the metadata)."""
        return {name: entry for name, entry in self.header.items() if name != "__metadata__"}

    def share(self, other: "FileLayout") -> None:
        """Use ``other``'s checked entries: its tensor entries and data size equal this file's."""
        self._entries = other._entries

    def _entry(self, name: str):
        entry = self.header.get(name) if name != "__metadata__" else None
        try:
            dtype = BY_CODE[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        nbytes = math.prod(shape) * dtype.size
        if end - begin != nbytes or begin < 0 or self._start + end > self.file_size:
            return None
        return dtype, shape, begin, end


def file_layout(path: str) -> Optional[FileLayout]:
    """The layout of a safetensors file, or None when its header cannot be read as one."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) != 8:
                return None
            size = int.from_bytes(head, "little")
            if size > MAX_HEADER_BYTES:
                return None
            header = handle.read(size)
            file_size = os.fstat(handle.fileno()).st_size
    except OSError:
        return None
    return _parsed(header, 8 + size, file_size)


def layout_of_bytes(data: np.ndarray) -> Optional[FileLayout]:
    """The layout of a safetensors file already read whole."""
    if len(data) < 8:
        return None
    size = int.from_bytes(data[:8].tobytes(), "little")
    if 8 + size > len(data):
        return None
    return _parsed(data[8 : 8 + size].tobytes(), 8 + size, len(data))


def _parsed(header_bytes: bytes, data_start: int, file_size: int) -> Optional[FileLayout]:
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError):
        return None
    return FileLayout(header, data_start, file_size) if isinstance(header, dict) else None


def usable_layout(pf, names: List[str], layout: Optional[FileLayout] = None) -> Optional[FileLayout]:
    """The layout of a PassFile's file when this reader follows the header for every name, else None."""
    layout = layout or pf.layout or file_layout(pf.ref.path)
    return None if layout is None or any(layout.get(name) is None for name in names) else layout


def read_whole_file(path: str, size: Optional[int] = None) -> np.ndarray:
    """A small pass file's bytes, in one read; ``size``: the size its layout was read at."""
    try:
        with open(path, "rb") as handle:
            data = np.frombuffer(handle.read(), dtype=np.uint8)
    except OSError as exc:
        raise DumpError(f"{show(path)}: cannot read ({exc}); the file is damaged") from None
    if size is not None and len(data) != size:
        raise DumpError(f"{show(path)}: changed while being read; copy the dump again")
    return data
