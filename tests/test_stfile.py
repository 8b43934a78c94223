"""The writer lays pass files out itself (dumper/stfile.py): safetensors must read back every
tensor and the metadata exactly, and the analyzer's header reader must vouch for what the
dumper writes."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from dumpdiff.analyzer.dump import header as passheader
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper import stfile


def _every_kind():
    """Every stored element type (random bits: NaNs and odd float8 codes included), and the
    layouts the writer meets: no dims, no elements, not contiguous, views of one storage."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in sorted(fmt.SAFETENSORS_CODES):
        dtype = getattr(torch, name)
        top = 2 if dtype == torch.bool else 256
        bits = torch.randint(0, top, (3, 5 * dtype.itemsize), generator=g, dtype=torch.uint8)
        tensors[f"m#0.out.{name}"] = bits.view(dtype)
    wide = torch.randn(4, 6, generator=g)
    tensors.update(
        {
            "m#0.in.0": torch.tensor(2.5),  # no dims
            "m#0.in.1": torch.zeros(0, 7, dtype=torch.bfloat16),  # no elements
            "m#0.in.2": wide.t(),  # not contiguous
            "m#0.in.3": wide[:, 1:4],  # a view into a larger storage
            "m#0.in.4": wide[:, 4:],  # another view into the same storage
        }
    )
    return tensors


def test_a_file_reads_back_as_written(tmp_path):
    tensors = _every_kind()
    meta = {"pass": 3, "note": 'a "quoted" \\ path\n\u00e9', "calls": []}
    text = json.dumps(meta, separators=(",", ":"))
    path = tmp_path / "pass.safetensors"
    with open(path, "wb") as handle:
        stfile.write(handle, tensors, {fmt.PASS_META_KEY: json.dumps(text)[1:-1]})
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {fmt.PASS_META_KEY: text}
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            got = handle.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(_bytes(got), _bytes(tensor)), name
    header, _ = passheader.read_header(str(path))
    assert header is not None and json.loads(header.meta_text) == meta and header.names == set(tensors)
    size = int.from_bytes(path.read_bytes()[:8], "little")
    assert size % 8 == 0  # the data starts aligned, as safetensors writes it


def _bytes(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8)
