"""A pass file written in safetensors' layout by the writer itself.

safetensors' ``save_file`` takes the pass metadata as one string and escapes it into the file's
header itself, on every pass, while the writer thread holds the interpreter lock that the
model's thread needs (at 8 layers of a decode step about half of the writer's time). The
writer instead keeps each call's metadata escaped once (metajson.py) and lays the file out as
safetensors does: the header's length as 8 little-endian bytes, the header JSON (the metadata
first, then one entry per tensor) padded with spaces to a multiple of 8 bytes, then the
tensors' bytes end to end, larger element types first so each tensor starts aligned to its
element size. Files are read back by safetensors and by the analyzer's own header reader.
"""

from __future__ import annotations

import json
from typing import BinaryIO, Dict

import torch

from .format import SAFETENSORS_CODES

_CODE = {getattr(torch, name): code for name, code in SAFETENSORS_CODES.items() if hasattr(torch, name)}


def write(handle: BinaryIO, tensors: Dict[str, torch.Tensor], metadata_escaped: Dict[str, str]) -> None:
    """Write host ``tensors`` and ``metadata_escaped`` (key -> its value as it stands between
    the quotes of a JSON string) to ``handle`` as one safetensors file."""
    metadata = ",".join(json.dumps(key) + ':"' + value + '"' for key, value in metadata_escaped.items())
    members = ['"__metadata__":{' + metadata + "}"]
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    data, offset = [], 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        members.append(
            f'{json.dumps(name)}:{{"dtype":"{_CODE[tensor.dtype]}","shape":[{",".join(map(str, tensor.shape))}],'
            f'"data_offsets":[{offset},{offset + size}]}}'
        )
        if size:
            data.append(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        offset += size
    header = ("{" + ",".join(members) + "}").encode("utf-8")
    header += b" " * (-len(header) % 8)
    handle.write(len(header).to_bytes(8, "little"))
    handle.write(header)
    for array in data:
        handle.write(memoryview(array))
