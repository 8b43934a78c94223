"""Staging copies as raw bytes (dumper/rawcopy.py) give the fingerprints copy_ gives, on a CPU
and on a GPU (in the order copy_ would run them there); a GPU driver that fails leaves copy_ to
do the work."""

from __future__ import annotations

import logging

import pytest
import torch

from dumpdiff.dumper import rawcopy
from dumpdiff.dumper.passprints import PassPrints

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors(device: str):
    """(rows, shape, copied raw) as hooks stage them: [n, width] rows, or a tensor and the
    (n, width) its reshape gives."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 1, 512, generator=g).to(torch.bfloat16).to(device)
    wide = torch.randn(8, 1, 768, generator=g).to(torch.bfloat16).to(device)
    big = torch.randn(2048, 512, generator=g).to(device)  # 4 MiB: above a CPU's memmove size
    return [
        (base.view(8, 512), None, True),
        (base, (8, 512), True),  # contiguous [B, 1, H]: its reshape is not made
        (base[2:5, 0], None, True),  # rows at an offset into their storage
        (wide[..., :512], (8, 512), False),  # a column slice: copy_'s
        (wide[:, 0, :512], None, False),
        (torch.randn(0, 512, generator=g).to(torch.bfloat16).to(device), None, True),  # no rows
        (torch.arange(40, dtype=torch.int64, device=device).view(8, 5), None, True),
        (torch.randn(5, 7, generator=g).to(device).t(), None, False),  # transposed: copy_'s
        (big, None, device != "cpu"),
    ]


def _table(tensors, raw: bool):
    prints = PassPrints(raw_copies=raw)
    metas = [{} for _ in tensors]
    for meta, (rows, shape, _) in zip(metas, tensors):
        prints.add(meta, rows, shape)
    table = prints.finish()
    if table.is_pinned():
        torch.cuda.synchronize()
    return table, [meta["print"] for meta in metas]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_raw_copies_stage_the_bytes_copy_stages(monkeypatch, device):
    used = []
    real = rawcopy.copy_rows
    monkeypatch.setattr(rawcopy, "copy_rows", lambda *args: used.append(real(*args)) or used[-1])
    tensors = _tensors(device)
    raw = _table(tensors, raw=True)
    assert rawcopy.disabled is None
    assert used == [expected for _, _, expected in tensors]
    copied = _table(tensors, raw=False)
    assert torch.equal(raw[0], copied[0]) and raw[1] == copied[1]  # the same prints, rows and order
    assert len(raw[0][0].unique()) > raw[0].shape[1] // 2  # and they differ: not a table of zeros


def test_a_tensor_rewritten_after_its_capture_keeps_its_captured_print():
    rows = torch.ones(8, 64)
    prints, meta = PassPrints(), {}
    prints.add(meta, rows)
    rows.fill_(2)  # an in-place kernel after the hook
    assert _table([(torch.ones(8, 64), None, True)], raw=False)[0].equal(prints.finish())


@needs_cuda
def test_a_driver_copy_runs_on_the_current_stream_after_the_kernel_that_wrote_the_rows():
    rows = torch.zeros(64, 4096, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    prints = PassPrints()
    meta = {}
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the write lands long after the copy is queued
        rows.fill_(7)
        prints.add(meta, rows)
        table = prints.finish()
    side.synchronize()
    expected, _ = _table([(torch.full((64, 4096), 7, dtype=torch.bfloat16, device="cuda"), None, True)], raw=False)
    assert torch.equal(table, expected)


@needs_cuda
def test_a_failing_driver_is_said_once_and_copy_does_the_work(monkeypatch, caplog):
    rawcopy.copy_rows(0, torch.zeros(0, device="cuda"))  # loaded
    memcpy, current, stream = rawcopy._driver
    monkeypatch.setattr(rawcopy, "_driver", [lambda *args: 1, current, stream])
    monkeypatch.setattr(rawcopy, "disabled", None)
    with caplog.at_level(logging.WARNING, logger="dumper"):
        failed = _table(_tensors("cuda"), raw=True)
    assert rawcopy.disabled is not None
    assert sum("fall back to torch's copy_" in r.getMessage() for r in caplog.records) == 1
    good = _table(_tensors("cuda"), raw=False)
    assert torch.equal(failed[0], good[0]) and failed[1] == good[1]
