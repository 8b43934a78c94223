"""The one-launch GPU kernel of the row statistics gives the torch form's numbers bit for bit.

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set
before Triton compiles anything: hence a child process), which executes the same kernel code on
CPU tensors with numpy's wrapping 64-bit arithmetic. On a GPU the compiled kernel is checked
instead (the interpreter of some Triton releases cannot loop over a runtime bound)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

COMMON = """
import torch
from dumpdiff.dumper import rowkernel, rowprint

def rows(dtype, n, width, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = (torch.randn(n, width, generator=g) * 1000).to(dtype)
        flat = x.view(-1)
        for i, v in zip((1, 2, 3), (float("nan"), float("inf"), -float("inf"))):
            if i < flat.numel():
                flat[i] = v
        return x
    if dtype == torch.bool:
        return torch.rand(n, width, generator=g) > 0.5
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, (n, width), generator=g).to(dtype)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
"""


def _interpreted(body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-c", COMMON + textwrap.dedent(body)], env=env, capture_output=True, text=True, timeout=600
    )


def test_a_kernel_that_fails_leaves_the_torch_form_to_give_the_same_table(monkeypatch, caplog):
    """A Triton that cannot compile for this GPU, or cannot build its launcher, must not fail the
    model or lose a print: the pass falls back to the torch form, said once in the log."""
    from dumpdiff.dumper import passprints, rowkernel, rowprint

    def broken(rows, table, first):
        raise RuntimeError("ptxas fatal: unsupported GPU architecture\nmore detail")

    monkeypatch.setattr(rowkernel, "available", lambda device: True)  # CPU tensors stand for a GPU's
    monkeypatch.setattr(rowkernel, "row_stats_into", broken)
    monkeypatch.setattr(rowkernel, "grouped_row_stats_into", broken)  # a pass's blocks launched together
    monkeypatch.setattr(rowkernel, "disabled", None)
    tensors = [torch.randn(3, 40), torch.randn(2, 7).to(torch.bfloat16)]
    prints = passprints.PassPrints()
    prints.on_cuda = True
    metas = [{}, {}]
    for meta, tensor in zip(metas, tensors):
        prints.add(meta, tensor)
    with caplog.at_level("WARNING", logger="dumper"):
        table = prints.finish()
    for meta, tensor in zip(metas, tensors):
        first, count = meta["print"]
        assert torch.equal(table[:, first : first + count], rowprint.row_stats(tensor))
    assert rowkernel.disabled == "RuntimeError: ptxas fatal: unsupported GPU architecture"
    assert sum("fall back to torch kernels" in r.getMessage() for r in caplog.records) == 1


interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU checks the compiled kernel")


@interpreted
def test_the_kernels_stats_are_the_torch_forms_for_every_type_width_and_row_layout():
    """Widths across the kernel's chunk size, empty rows, rows with NaN and inf, rows of a
    larger tensor's columns (a row stride that is not the width), written at a column offset."""
    done = _interpreted(
        """
        chunk = rowkernel.CHUNK
        for dtype in DTYPES:
            for n, width in [(5, 37), (2, chunk - 1), (2, chunk + 1), (3, 1), (2, 0), (0, 9)]:
                x = rows(dtype, n, width, seed=n * width)
                for layout in ("contiguous", "columns of a wider tensor"):
                    if layout != "contiguous":
                        wide = torch.cat([x, rows(dtype, n, 3, seed=1)], dim=1)
                        x = wide[:, :width]
                    table = torch.full((3, n + 2), -7, dtype=torch.int64)
                    rowkernel.row_stats_into(x, table, 1)
                    want = rowprint.row_stats(x)
                    assert torch.equal(table[:, 1 : 1 + n], want), (dtype, n, width, layout, table, want)
                    assert (table[:, 0] == -7).all() and (table[:, n + 1] == -7).all(), "wrote outside its columns"
        print("checked")
        """
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


@interpreted
def test_a_pass_worked_on_by_the_kernel_gives_the_torch_forms_table():
    """A pass's blocks go to the kernel together (one launch per element type), or one by one
    where one of them is of a type it does not read (an 8-bit float): the table keeps every
    tensor's rows in place either way."""
    done = _interpreted(
        """
        from dumpdiff.dumper import passprints

        def table(tensors, kernel):
            rowkernel.available = lambda device: kernel  # the interpreter runs on CPU tensors
            prints = passprints.PassPrints(stage_bytes=1 << 30)
            prints.on_cuda = kernel  # blocks are taken to the kernel only on a GPU
            metas = [{} for _ in tensors]
            for meta, tensor in zip(metas, tensors):
                prints.add(meta, tensor)
            return prints.finish(), metas

        def check(tensors):
            (with_kernel, metas), (without, metas_without) = table(tensors, True), table(tensors, False)
            assert rowkernel.disabled is None, rowkernel.disabled
            assert metas == metas_without
            assert torch.equal(with_kernel, without)
            for meta, tensor in zip(metas, tensors):
                first, count = meta["print"]
                assert torch.equal(with_kernel[:, first : first + count], rowprint.row_stats(tensor))

        tensors = [rows(torch.bfloat16, 3, 64, 1), rows(torch.float32, 5, 7, 2), rows(torch.int64, 4, 1, 3),
                   rows(torch.float32, 4, 7, 4).to(torch.float8_e4m3fn), rows(torch.bfloat16, 2, 64, 5)]
        check(tensors)  # one by one: the kernel does not read float8
        check(tensors[:3] + tensors[4:])  # together
        print("checked")
        """
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_kernel_gives_the_cpu_stats_and_a_pass_the_torch_forms_table(monkeypatch):
    from dumpdiff.dumper import passprints, rowkernel, rowprint

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        for n, width in [(300, 4096), (8, 14336), (7, 1), (3, 0)]:
            x = (torch.randn(n, width, generator=g) * 100).to(dtype)
            if n * width > 2:
                x.view(-1)[1] = float("nan") if dtype.is_floating_point else 5
            for on_gpu in (x.cuda(), torch.cat([x, x], dim=1).cuda()[:, :width]):  # rows apart by their stride
                table = torch.empty((3, n), dtype=torch.int64, device="cuda")
                rowkernel.row_stats_into(on_gpu, table, 0)
                assert torch.equal(table.cpu(), rowprint.row_stats(x)), (dtype, n, width)
    assert rowkernel.available(torch.device("cuda"))
    tensors = [
        (torch.randn(8, w, generator=g) * 9).to(t).cuda() for w, t in [(4096, torch.bfloat16), (7, torch.float32)]
    ]

    def table():
        prints = passprints.PassPrints()
        for tensor in tensors:
            prints.add({}, tensor)
        found = prints.finish()
        torch.cuda.synchronize()
        return found

    with_kernel = table()
    monkeypatch.setattr(rowkernel, "disabled", "off for this test")
    assert not rowkernel.available(torch.device("cuda"))
    assert torch.equal(with_kernel, table())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_capture_launches_the_kernel_only_once_it_is_loaded():
    """A capture must not load code: before the kernel is loaded for a type it takes the torch
    form; after rowkernel.load (what the dumper does before a capture), the kernel. Both replay
    to the same table."""
    from dumpdiff.dumper import rowkernel, rowprint
    from dumpdiff.dumper.passprints import PassPrints

    x = (torch.randn(8, 4096, generator=torch.Generator().manual_seed(1)) * 5).to(torch.bfloat16).cuda()
    want = rowprint.row_stats(x.cpu())
    rowkernel._loaded.clear()
    tables, took = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            took.append(rowkernel.takes(x))
            prints = PassPrints()
            prints.add({}, x)
            tables.append(prints.finish(host=False))
        graph.replay()
        torch.cuda.synchronize()
        tables[-1] = tables[-1].cpu()
        rowkernel.load(torch.device("cuda"), [torch.bfloat16])
    assert took == [False, True]
    assert torch.equal(tables[0], want) and torch.equal(tables[1], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capture_after_load_launches_the_kernel_and_compiles_nothing_whatever_the_widths(monkeypatch):
    """Triton compiles a form per argument type and alignment: the form load() makes must be the
    one every staging block of a capture needs, at any row width and count."""
    from dumpdiff.dumper import rowkernel, rowprint
    from dumpdiff.dumper.passprints import PassPrints

    rowkernel._loaded.clear()
    rowkernel.load(torch.device("cuda"), [torch.bfloat16, torch.int64])
    compiled, launched = [], []
    if hasattr(rowkernel._row_stats, "_do_compile"):  # Triton's own compile step, where it has one
        real = rowkernel._row_stats._do_compile
        monkeypatch.setattr(rowkernel._row_stats, "_do_compile", lambda *a, **k: compiled.append(a) or real(*a, **k))
    real_launch = rowkernel.row_stats_into
    monkeypatch.setattr(rowkernel, "row_stats_into", lambda *a: launched.append(a) or real_launch(*a))
    g = torch.Generator().manual_seed(2)
    tensors = [
        (torch.randn(n, w, generator=g) * 3).to(torch.bfloat16).cuda()
        for n, w in [(8, 4096), (8, 14336), (3, 128), (8, 7), (8, 1)]
    ]
    tensors.append(torch.arange(8).view(8, 1).cuda())
    metas = [{} for _ in tensors]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prints = PassPrints()
        for meta, tensor in zip(metas, tensors):
            prints.add(meta, tensor)
        table = prints.finish(host=False)
    graph.replay()
    torch.cuda.synchronize()
    assert compiled == [] and len(launched) == 6  # six blocks: one per element type and width
    for meta, tensor in zip(metas, tensors):
        first, count = meta["print"]
        assert torch.equal(table[:, first : first + count].cpu(), rowprint.row_stats(tensor.cpu()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pass_of_many_widths_takes_one_launch_per_element_type(monkeypatch):
    """Outside a capture a pass's blocks, one per element type and row width, are printed by one
    grouped launch per element type, each row in its tensor's columns; rows beyond the grid's
    programs are looped over."""
    from dumpdiff.dumper import rowkernel, rowprint
    from dumpdiff.dumper.passprints import PassPrints

    monkeypatch.setattr(rowkernel, "_MOST_PROGRAMS", 3)  # blocks of more rows loop
    grids, single = [], []
    real_kernel, real_single = rowkernel._grouped_row_stats, rowkernel.row_stats_into

    class CountedKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return real_kernel[grid]

    monkeypatch.setattr(rowkernel, "_grouped_row_stats", CountedKernel())
    monkeypatch.setattr(rowkernel, "row_stats_into", lambda *a: single.append(a) or real_single(*a))
    g = torch.Generator().manual_seed(3)
    shapes = [(8, 4096, torch.bfloat16), (8, 14336, torch.bfloat16), (11, 7, torch.float32), (8, 4096, torch.bfloat16)]
    shapes += [(5, 1, torch.int64), (2, 1025, torch.float32), (1, 0, torch.bfloat16), (0, 5, torch.bfloat16)]
    tensors = [(torch.randn(n, w, generator=g) * 7).to(t).cuda() for n, w, t in shapes]
    tensors[0].view(-1)[3] = float("inf")
    metas = [{} for _ in tensors]
    prints = PassPrints()
    for meta, tensor in zip(metas, tensors):
        prints.add(meta, tensor)
    table = prints.finish()
    torch.cuda.synchronize()
    assert rowkernel.disabled is None
    # bfloat16 (widths 4096, 14336, 0), float32 (7, 1025), int64: the empty block is not worked on
    assert sorted(grids) == [(1, 3), (2, 3), (3, 3)] and single == []
    for meta, tensor in zip(metas, tensors):
        first, count = meta["print"]
        assert count == tensor.shape[0]
        assert torch.equal(table[:, first : first + count], rowprint.row_stats(tensor.cpu())), tensor.shape
