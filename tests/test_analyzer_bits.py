"""The analyzer works on raw element bits in numpy (no torch on the verdict path): its decoding of
every float type, its per-row magnitudes and its error figures must agree with torch's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dumpdiff.analyzer.dump.dtypes import of_torch, to_float64
from dumpdiff.analyzer.dump.torchbits import from_torch, to_torch
from dumpdiff.analyzer.index.fingerprint import fingerprints, row_stats
from dumpdiff.analyzer.verdict.compare import error_stats
from helpers import ROOT, dump_pair, dumpdiff, load_model, make_tiny_llama, prompt_ids

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def awkward_values(dtype) -> torch.Tensor:
    """Normal, subnormal, signed zeros, the largest finite value, inf and NaN of ``dtype``."""
    info = torch.finfo(dtype)
    special = [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, 1.0, -3.5]
    if dtype not in (torch.float8_e4m3fn,):  # e4m3fn has no infinity
        special += [float("inf"), float("-inf")]
    values = torch.cat([torch.tensor(special, dtype=torch.float64), torch.randn(64, dtype=torch.float64) * 50])
    return torch.cat([values.to(dtype), torch.tensor([float("nan")]).to(dtype)])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_float_bits_decode_as_torch_does(dtype):
    values = awkward_values(dtype)
    bits, kind = from_torch(values)
    assert kind == of_torch(dtype) and bits.dtype.itemsize == values.element_size()
    assert np.array_equal(to_float64(bits, kind), values.double().numpy(), equal_nan=True)
    assert torch.equal(to_torch(bits, kind).view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_row_magnitudes_skip_inf_and_nan_and_count_them(dtype):
    rows = awkward_values(dtype)[None].repeat(3, 1)
    rows[1] = rows[1].double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).to(dtype)  # a finite row
    rows[2, :] = torch.tensor(2.0).to(dtype)
    fps, amax, nonfinite = row_stats(*from_torch(rows))
    as64 = rows.double()
    finite = torch.isfinite(as64)
    expected = torch.where(finite, as64.abs(), 0.0).amax(dim=1).numpy()
    assert np.array_equal(amax, expected) and nonfinite.tolist() == (~finite).sum(dim=1).tolist()
    assert len(set(fps.tolist())) == 3


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_row_magnitudes_of_ordinary_rows_are_exact(dtype):
    """Rows without inf, NaN or the largest value take the fast path: still exact, 64-bit too."""
    rows = (torch.randn(64, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    rows[0, :2] = torch.tensor([1 + 2**-52, -0.5], dtype=torch.float64).to(dtype)  # one ulp above 1 in float64
    _, amax, nonfinite = row_stats(*from_torch(rows))
    assert np.array_equal(amax, rows.double().abs().amax(dim=1).numpy()) and not nonfinite.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_rows_taken_a_block_at_a_time_give_each_row_its_own_figures(dtype, monkeypatch):
    """Large tensors are hashed and measured in blocks of rows: every block, the last partial one
    included, must give the figures the row alone gives (an inf in a late block is still counted
    in its own row)."""
    from dumpdiff.analyzer.index import fingerprint

    rows = (torch.randn(37, 40, generator=torch.Generator().manual_seed(2)) * 9).to(dtype)
    if dtype.is_floating_point:
        rows[30, 7], rows[36, 0] = float("inf"), float("nan")
    alone = [row_stats(*from_torch(rows[i : i + 1])) for i in range(len(rows))]
    monkeypatch.setattr(fingerprint, "BLOCK_BYTES", 3 * rows[0].nbytes + 1)  # 13 blocks, the last of one row
    fps, amax, nonfinite = row_stats(*from_torch(rows))
    assert fps.tolist() == [int(a[0][0]) for a in alone]
    assert nonfinite.tolist() == [int(a[2][0]) for a in alone]
    if dtype.is_floating_point:
        assert amax.tolist() == [float(a[1][0]) for a in alone] and nonfinite[30] == 1 and nonfinite[36] == 1
    else:
        assert amax is None


def test_fingerprints_see_dtype_and_width_not_just_bytes():
    zeros = torch.zeros(2, 4, dtype=torch.int16)
    assert fingerprints(zeros)[0] != fingerprints(zeros.view(torch.bfloat16))[0]
    assert fingerprints(zeros)[0] != fingerprints(torch.zeros(2, 8, dtype=torch.int16))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_error_figures_match_torch(dtype):
    ref = (torch.randn(8, 32) * 4).to(dtype)
    test = ref.clone()
    test.view(torch.uint8)[3, 5] ^= 1  # a flipped low bit: one element, one ulp away (or one of its neighbours)
    test[6, 0] = (ref[6, 0].double() * 1.5).to(dtype)
    bits_r, kind = from_torch(ref)
    figures = error_stats(bits_r, from_torch(test)[0], kind)
    r64, t64 = ref.double(), test.double()
    assert figures["max_abs"] == pytest.approx(float((r64 - t64).abs().max()), rel=0, abs=0)
    assert figures["elements_differ"] == int(
        (ref.view(torch.uint8) != test.view(torch.uint8))
        .reshape(8, -1)
        .reshape(-1, ref.element_size())
        .any(dim=1)
        .sum()
    )
    assert figures["dtype"] == str(dtype).replace("torch.", "") and figures["max_ulp"] >= 1


def test_verdicts_import_neither_torch_nor_pandas(tmp_path):
    """--strict-only answers from the index and the culprit's bytes: no second of torch start-up
    and no third of a second of pandas, whether it builds the indexes or finds them built; nor
    numpy.ma, which numpy's plain np.unique imports (6 ms). The default (noise-aware) verdict on a
    dense model reads tensor values in numpy: neither torch nor pandas either."""
    model = load_model(make_tiny_llama(tmp_path / "llama"))
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=4)
    probe = (
        "import json, runpy, sys\n"
        "sys.argv = ['dumpdiff', 'first-divergence', sys.argv[1], sys.argv[2], '--strict-only', '--format', "
        "'json', '--no-progress']\n"
        "try:\n    runpy.run_module('dumpdiff.analyzer.cli', run_name='__main__')\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        "print(json.dumps({'exit': code, 'torch': 'torch' in sys.modules, 'pandas': 'pandas' in sys.modules, "
        "'numpy.ma': 'numpy.ma' in sys.modules}), "
        "file=sys.stderr)\n"
    )
    verdicts = []
    for step in ("builds the indexes", "index command", "reads the indexes"):
        if step == "index command":
            code, out, err = dumpdiff("index", ref, dec, "--no-progress", "--rebuild")  # both in one command
            assert code == 0 and out.count("tensor rows") == 2, err
            continue
        proc = subprocess.run([sys.executable, "-c", probe, ref, dec], capture_output=True, text=True, cwd=ROOT)
        status = json.loads(proc.stderr.strip().splitlines()[-1])
        assert status == {"exit": 1, "torch": False, "pandas": False, "numpy.ma": False}, (step, proc.stderr[-2000:])
        verdicts.append(json.loads(proc.stdout))
    assert verdicts[0]["culprit"]["call"] and verdicts[0]["culprit"]["max_abs"] > 0
    assert verdicts[0] == verdicts[1]
    proc = subprocess.run(
        [sys.executable, "-c", probe.replace("'--strict-only', ", ""), ref, dec],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    status = json.loads(proc.stderr.strip().splitlines()[-1])
    assert (status["exit"], status["torch"], status["pandas"]) == (1, False, False), proc.stderr[-2000:]
    noise = json.loads(proc.stdout)["ranks"]["0"]["noise"]
    assert noise["rows_examined"] > 0 and noise["top_jumps"], noise


def test_index_tables_are_built_without_pandas_and_read_back_by_it(tmp_path):
    """The index build assembles arrow tables from numpy and lists (pyarrow's converters import
    pandas); what it writes must read back, with pandas too, as the values it was given."""
    import pandas as pd
    import pyarrow.parquet as pq

    from dumpdiff.analyzer.errors import DumpError
    from dumpdiff.analyzer.index import arrow as arrowbuild

    passes = [
        {
            "n": np.array([1, -2], np.int64),
            "x": np.array([0.5, np.nan]),
            "ok": np.array([True, False]),
            "text": ["naïve", None],
            "name": arrowbuild.dictionary(["b.out.0", "a.in.0"], np.array([1, 1])),
        },
        {
            "n": np.array([3], np.int64),
            "x": np.array([-0.0]),
            "ok": np.array([True]),
            "text": ["✓"],
            "name": arrowbuild.dictionary(["c.out.0"], np.array([1])),
        },
        {
            "n": np.zeros(0, np.int64),
            "x": np.zeros(0),
            "ok": np.zeros(0, bool),
            "text": [],
            "name": arrowbuild.dictionary([], np.zeros(0, np.int64)),
        },
    ]
    table = arrowbuild.table(arrowbuild.concat(passes))
    pq.write_table(table, tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet")
    assert back["n"].tolist() == [1, -2, 3] and back["ok"].tolist() == [True, False, True]
    assert np.array_equal(back["x"].to_numpy(), [0.5, np.nan, -0.0], equal_nan=True)
    assert [None if pd.isna(v) else v for v in back["text"]] == ["naïve", None, "✓"]
    assert back["name"].astype(str).tolist() == ["b.out.0", "a.in.0", "c.out.0"]
    assert pq.read_table(tmp_path / "t.parquet").column("text").null_count == 1
    with pytest.raises(DumpError, match="not valid Unicode"):
        arrowbuild.table({"text": ["fine", "\ud800"]})


@pytest.mark.parametrize("dtype", FLOATS)
def test_noise_row_errors_match_torch(dtype):
    """The noise-aware verdict's per-row errors, computed in numpy from bits, equal the same
    formula in torch's float64 (inf, NaN, subnormals, signed zeros included), and so does the
    tolerance test."""
    import math

    from dumpdiff.analyzer.verdict.noise import _compare_rows

    ref = awkward_values(dtype).reshape(-1)
    ref = ref[: (len(ref) // 4) * 4].reshape(4, -1)
    test = ref.clone()
    test.view(torch.uint8)[1, 3] ^= 1
    test[2] = (ref[2].double() * 1.5).to(dtype)
    rel, absolute, exceeds, eps = _compare_rows(from_torch(ref)[0], from_torch(test)[0], of_torch(dtype), 1e-3, 1e-2)
    r, t = ref.double(), test.double()
    finite = torch.isfinite(r) & torch.isfinite(t)
    diff = torch.where(finite, (r - t).abs(), torch.where((torch.isnan(r) & torch.isnan(t)) | (r == t), 0.0, math.inf))
    scale = torch.where(finite, r.abs(), 0.0).amax(dim=1).clamp_min(torch.finfo(dtype).tiny)
    assert np.array_equal(absolute, diff.amax(dim=1).numpy())
    assert np.array_equal(rel, (diff.amax(dim=1) / scale).numpy())
    assert np.array_equal(exceeds, (diff > 1e-3 + 1e-2 * r.abs()).any(dim=1).numpy())
    assert eps == torch.finfo(dtype).eps and rel[0] == 0 and rel[2] > 0


def test_noise_rows_stored_in_different_element_types_are_compared_by_value():
    """A tensor kept in bfloat16 by one run and float32 by the other: its rows are compared as
    numbers, not as bit patterns of different widths."""
    from dumpdiff.analyzer.verdict.noise import _compare_rows

    ref = (torch.randn(3, 16) * 3).to(torch.bfloat16)
    test = ref.float()
    test[1, 4] += 0.25
    rel, absolute, _, eps = _compare_rows(
        from_torch(ref)[0], from_torch(test)[0], of_torch(torch.bfloat16), None, None, of_torch(torch.float32)
    )
    assert rel[0] == rel[2] == 0 and absolute[1] == pytest.approx(0.25, rel=1e-6)
    assert eps == torch.finfo(torch.bfloat16).eps


def test_row_reader_reads_a_small_pass_read_broadly_once(tmp_path, monkeypatch):
    """The noise-aware walk asks for one row of every tensor of each decode pass: past a few
    tensors the (small) pass file is read whole, once, and every row read equals a row read alone."""
    from dumpdiff.analyzer.dump.load import open_dump
    from dumpdiff.analyzer.index import rows as rowread
    from dumpdiff.analyzer.index.store import load_index

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    _, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=3)

    def read_all(whole_after):
        monkeypatch.setattr(rowread, "WHOLE_FILE_AFTER", whole_after)
        index = load_index(open_dump(dec), progress=False).rank(0)
        rows, reader = index.cols("rows"), rowread.RowReader(index)
        last = int(rows["pass"].max())  # a decode pass: one token row
        mine = np.nonzero((rows["pass"] == last) & (rows["row"] >= 0))[0]
        got = [
            reader.bits(last, tensor, [row])
            for tensor, row in zip(rows["tensor"][mine].tolist(), rows["row"][mine].tolist())
        ]
        return got, reader.bytes_read, reader.refs[last].path, len(mine)

    whole, read_whole, path, n_tensors = read_all(1)  # whole from the first tensor asked for
    alone, read_alone, _, _ = read_all(10**9)  # never whole: row by row
    assert n_tensors > 8 and read_whole == os.path.getsize(path) > read_alone
    for (bits_w, type_w), (bits_a, type_a) in zip(whole, alone):
        assert type_w == type_a and bits_w.dtype == bits_a.dtype and np.array_equal(bits_w, bits_a)


@pytest.mark.parametrize("group_bytes", [64 << 20, 1], ids=["one-read", "a-read-per-file"])
def test_rows_sliced_from_decode_files_equal_rows_read_alone(tmp_path, monkeypatch, group_bytes):
    """The noise-aware walk slices the rows of decode-step files out of span reads at the byte
    offsets the index holds (batchread._from_spans): every row of every tensor, batches in
    file order or not, entries in any order, equals the row the row reader finds through the
    file's header, in the same element type."""
    from dumpdiff.analyzer.dump.load import open_dump
    from dumpdiff.analyzer.index import batches as batchread
    from dumpdiff.analyzer.index import rows as rowread
    from dumpdiff.analyzer.index.store import load_index

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    _, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=10)
    monkeypatch.setattr(batchread, "GROUP_BYTES", group_bytes)
    index = load_index(open_dump(dec), progress=False).rank(0)
    codes, names = index.cols("rows").codes("tensor")
    rng = np.random.default_rng(0)
    entries = [rng.permutation(np.nonzero(codes == c)[0]) for c in range(len(names))]
    tensors = [str(names[c]) for c, e in enumerate(entries) if len(e)]
    entries = [e for e in entries if len(e)]
    sliced = []
    real = batchread._from_spans
    monkeypatch.setattr(batchread, "_from_spans", lambda *a: sliced.append(real(*a)) or sliced[-1])
    starts = np.cumsum([0] + [len(e) for e in entries])
    spans = [
        np.arange(start, stop) for start, stop in zip(starts[:-1], starts[1:])
    ]  # batches as in_file_order takes them
    number = {int(span[0]): i for i, span in enumerate(spans)}
    in_file = [number[int(span[0])] for span in batchread.in_file_order(index, np.concatenate(entries), spans)]
    assert in_file != list(range(len(entries)))
    for order in (list(range(len(entries))), in_file):
        fast = batchread.read_batches(index, [tensors[i] for i in order], [entries[i] for i in order])
        monkeypatch.setattr(batchread, "WHOLE_FILE_AFTER", 10**9)  # the row reader alone, row by row
        alone = batchread.read_batches(
            load_index(open_dump(dec), progress=False).rank(0), [tensors[i] for i in order], [entries[i] for i in order]
        )
        monkeypatch.setattr(batchread, "WHOLE_FILE_AFTER", rowread.WHOLE_FILE_AFTER)
        for (rows_f, type_f), (rows_a, type_a), i in zip(fast, alone, order):
            assert type_f == type_a and rows_f.dtype == rows_a.dtype, tensors[i]
            assert np.array_equal(rows_f.reshape(len(rows_f), -1), rows_a.reshape(len(rows_a), -1)), tensors[i]
    assert sliced[0].mean() > 0.5  # most rows (every decode step's) were sliced, not read alone


def test_many_decode_steps_read_with_few_file_descriptors(tmp_path):
    """The noise-aware walk reads a slice of every decode step's file in one group: it keeps one
    file open at a time, so a long decode run compares under a low open-file limit (macOS
    defaults to 256; containers set less) instead of failing with "too many open files"."""
    import resource

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(8), new_tokens=48)
    assert dumpdiff("index", ref, dec, "--no-progress")[0] == 0

    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dumpdiff.analyzer.cli",
            "first-divergence",
            ref,
            dec,
            "--no-progress",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=few_files,
        timeout=300,
    )
    assert proc.returncode == 1 and json.loads(proc.stdout)["ranks"]["0"]["noise"]["rows_examined"] >= 48, proc.stderr


def test_input_error_is_the_running_max_over_the_sequence():
    """A call's input error on a row counts every earlier row of its sequence (a scan or an
    attention carries them forward), per call and per sequence, whatever order rows come in."""
    from dumpdiff.analyzer.verdict.noise import _running_max

    values = np.array([0.0, 3.0, 1.0, np.inf, 2.0, 0.5, 0.0])
    ccode = np.array([0, 0, 0, 0, 1, 1, 1])
    seq = np.array(["s", "s", "t", "s", "s", "s", "s"], dtype=object)
    pos = np.array([2, 1, 5, 9, 0, 3, 1])
    # call 0, seq s: pos 1 -> 3, pos 2 -> max(3, 0), pos 9 -> inf; seq t alone; call 1: 2, 2, 2
    assert _running_max(values, ccode, seq, pos).tolist() == [3.0, 3.0, 1.0, np.inf, 2.0, 2.0, 2.0]
    # over the earlier rows only (what a call with integer inputs carries in its cache): 0 first
    assert _running_max(values, ccode, seq, pos, exclusive=True).tolist() == [3.0, 0.0, 0.0, 3.0, 0.0, 2.0, 2.0]


def test_many_decode_steps_indexed_by_worker_processes(tmp_path):
    """A dump of many decode steps is indexed by worker processes (the per-tensor work holds the
    GIL): the same five tables as one thread builds, and a damaged step is still one line, exit 2."""
    import pyarrow.parquet as pq

    from dump_surgery import edit_pass_meta, one_line_error, pass_path

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    model.generation_config.eos_token_id = None
    _, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(8), new_tokens=40)  # 39 decode passes
    tables = {}
    for processes in ("0", "2"):
        code, out, err = dumpdiff(
            "-v", "index", dec, "--rebuild", "--no-progress", env={"DUMPDIFF_INDEX_PROCESSES": processes}
        )
        assert code == 0 and ("in 2 worker processes" in err) == (processes == "2"), err
        tables[processes] = {
            n: pq.read_table(os.path.join(dec, "index", f"{n}.parquet")).to_pylist()
            for n in ("tokens", "seqs", "calls", "tensors", "rows")
        }
    for name, rows in tables["0"].items():
        assert json.dumps(rows, default=str) == json.dumps(tables["2"][name], default=str), name  # NaN amax too
    edit_pass_meta(pass_path(dec, 30), lambda meta: meta["tokens"].update(pos=["x"]))
    one_line_error(
        dumpdiff("index", dec, "--rebuild", "--no-progress", env={"DUMPDIFF_INDEX_PROCESSES": "2"}), "pass-000030"
    )


LIBRARY_CALLER = """
import logging, sys
with open(sys.argv[2], "a") as ran:  # no __main__ guard: a worker that imports this script runs this again
    ran.write("ran\\n")
logging.basicConfig(level=logging.INFO, format="%(message)s")
from dumpdiff.analyzer.index.store import load_indexes
from dumpdiff.analyzer.dump.load import open_dump
load_indexes([open_dump(sys.argv[1])], rebuild=True, progress=False)
print("built")
"""


def test_a_library_caller_gets_worker_processes_that_never_run_its_script(tmp_path):
    """A user's script that calls the index build as a library, with no ``if __name__ ==
    "__main__"`` guard, gets the worker processes the command line gets (multiprocessing's spawn
    would run the script again in each worker), and the tables one process builds."""
    import pyarrow.parquet as pq

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    model.generation_config.eos_token_id = None
    _, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(8), new_tokens=40)  # 39 decode passes
    script = tmp_path / "caller.py"
    script.write_text(LIBRARY_CALLER)
    tables = {}
    for processes in ("0", "2"):
        marker = tmp_path / f"ran-{processes}.txt"
        proc = subprocess.run(
            [sys.executable, str(script), dec, str(marker)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "DUMPDIFF_INDEX_PROCESSES": processes},
            timeout=300,
        )
        assert proc.returncode == 0 and proc.stdout == "built\n", proc.stderr
        assert ("indexing in 2 worker processes" in proc.stderr) == (processes == "2"), proc.stderr
        assert marker.read_text() == "ran\n"  # the script ran once, in its own process only
        tables[processes] = {
            n: pq.read_table(os.path.join(dec, "index", f"{n}.parquet")).to_pylist()
            for n in ("tokens", "seqs", "calls", "tensors", "rows")
        }
    assert json.dumps(tables["0"], default=str) == json.dumps(tables["2"], default=str)
    # The workers take the caller's import path, not the working directory `python -c` would put
    # first: a user's json.py there is not run by them (the console script's own path lacks it).
    here = tmp_path / "workdir"
    here.mkdir()
    (here / "json.py").write_text(f"open({str(tmp_path / 'user-json-ran')!r}, 'w').close()\n")
    program = os.path.join(os.path.dirname(sys.executable), "dumpdiff")
    proc = subprocess.run(
        [program, "-v", "index", dec, "--rebuild", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=here,
        env={**os.environ, "DUMPDIFF_INDEX_PROCESSES": "2"},
        timeout=300,
    )
    assert proc.returncode == 0 and "in 2 worker processes" in proc.stderr, proc.stderr
    assert not (tmp_path / "user-json-ran").exists()


@pytest.mark.parametrize("dtype", [d for d in FLOATS if d != torch.float64])
def test_noise_row_errors_of_finite_rows_match_float64(dtype, monkeypatch):
    """Finite rows of float types of 4 bytes or fewer are compared in float32 (half the bytes):
    the same errors as the float64 formula."""
    from dumpdiff.analyzer.verdict import noise
    from dumpdiff.analyzer.verdict.noise import _compare_rows

    taken = []
    fast = noise._finite_rows_in_float32
    monkeypatch.setattr(noise, "_finite_rows_in_float32", lambda *a: taken.append(fast(*a)) or taken[-1])
    ref = (torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    noise = 4 * torch.finfo(dtype).eps * torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    test = (ref.double() * (1 + noise)).to(dtype)  # a few ulps apart, as noise is
    test[0] = ref[0]
    rel, absolute, exceeds, eps = _compare_rows(from_torch(ref)[0], from_torch(test)[0], of_torch(dtype), None, None)
    r, t = ref.double(), test.double()
    expected = (r - t).abs().amax(dim=1)
    assert np.allclose(absolute, expected.numpy(), rtol=1e-6, atol=0) and absolute[0] == 0 and absolute[1:].all()
    assert np.allclose(rel, (expected / r.abs().amax(dim=1)).numpy(), rtol=1e-6, atol=0) and not exceeds.any()
    assert len(taken) == 1 and taken[0] is not None  # the float32 path answered


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")], ids=["finite", "nan", "inf", "-inf"])
@pytest.mark.parametrize("side", ["ref", "test", "both"])
def test_float32_row_errors_leave_any_non_finite_row_to_the_exact_path(bad, side):
    """The float32 shortcut answers only when every difference is finite, and then gives each
    row's largest |a - b| and largest |a| (rows of negative numbers included); a NaN or an inf
    on either side, anywhere, sends the whole comparison to the exact float64 path."""
    from dumpdiff.analyzer.verdict.noise import _finite_rows_in_float32

    f32 = of_torch(torch.float32)
    ref = torch.randn(5, 33, generator=torch.Generator().manual_seed(2))
    ref[1] = -ref[1].abs() - 1  # a row of negative numbers only
    test = ref + 1e-3 * torch.randn(5, 33, generator=torch.Generator().manual_seed(3))
    if bad is not None:
        for t in [ref] if side == "ref" else [test] if side == "test" else [ref, test]:
            t[3, 7] = bad
    found = _finite_rows_in_float32(from_torch(ref)[0], from_torch(test)[0], f32, f32)
    if bad is not None:
        assert found is None
        return
    largest, magnitude = found
    assert np.array_equal(largest, (ref - test).abs().amax(dim=1).double().numpy())
    assert np.array_equal(magnitude, ref.abs().amax(dim=1).double().numpy())


def test_noise_walk_over_more_small_files_than_the_cache_holds_reads_them_once(tmp_path, monkeypatch):
    """The noise-aware walk goes tensor by tensor over every sampled decode pass: once the small
    files it reads whole outgrow the row cache, it reads rows instead of re-reading each file
    for every tensor (hundreds of times the dump)."""
    from dumpdiff.analyzer.index import rows as rowread
    from dumpdiff.analyzer.verdict.diverge import first_divergence

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    model.generation_config.eos_token_id = None
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(8), new_tokens=40)
    read = {}
    for cache in (rowread.CACHE_BYTES, 300_000):  # all small files fit / a few do
        monkeypatch.setattr(rowread.RowReader.__init__, "__defaults__", (cache,))
        result = first_divergence(ref, dec, progress=False)
        read[cache] = result["ranks"]["0"]["noise"]["bytes_read"]
    decode_files = sum(
        os.path.getsize(os.path.join(dec, "rank0", f))
        for f in os.listdir(os.path.join(dec, "rank0"))
        if f.endswith(".safetensors")
    )
    assert read[300_000] <= 1.5 * read[rowread.CACHE_BYTES] and read[300_000] < 3 * decode_files, (read, decode_files)


@pytest.mark.parametrize(
    "case", ["unique-small-range", "duplicates", "wide-range", "negative", "empty-side", "no-match", "unsigned"]
)
def test_key_join_matches_every_equal_key_in_order(case):
    """keyjoin.join (the verdict's joins) equals a brute-force join: every (side, probe) pair of
    equal keys, by probe position then side position, whether it takes its lookup-table path
    (unique keys, small range) or its sorted path."""
    from dumpdiff.analyzer.index.keyjoin import join

    rng = np.random.default_rng(len(case))
    side = {
        "unique-small-range": rng.permutation(5000)[:3000] + 7,
        "duplicates": rng.integers(0, 300, 4000),
        "wide-range": rng.permutation(3000) * (1 << 40),
        "negative": rng.permutation(4000)[:2500] - 2000,
        "empty-side": np.zeros(0, np.int64),
        "no-match": np.arange(100, 200),
        "unsigned": rng.permutation(3000).astype(np.uint32),
    }[case]
    probe = np.concatenate(
        [
            rng.choice(side, 2000) if len(side) else np.zeros(0, side.dtype),
            rng.integers(-3000, 6000, 500).astype(side.dtype)
            if case != "wide-range"
            else rng.integers(0, 3000, 500) * (1 << 40) + 1,
        ]
    )
    at_side, at_probe = join(side, probe)
    where = {}
    for k, key in enumerate(side.tolist()):
        where.setdefault(key, []).append(k)
    expected = [(s, p) for p, key in enumerate(probe.tolist()) for s in where.get(key, [])]
    assert list(zip(at_side.tolist(), at_probe.tolist())) == expected


def test_distinct_gives_what_np_unique_gives():
    """The verdict path's stand-in for np.unique: same values, same order, same dtype."""
    from dumpdiff.analyzer.index.columns import distinct

    rng = np.random.default_rng(0)
    cases = [
        np.zeros(0, np.int64),
        np.array([7]),
        rng.integers(-3, 40, 5000),
        rng.integers(0, 4, (6, 7)).astype(np.int16),
        np.array(["mlp#0.out.0", "attn#0.in.0", "mlp#0.out.0", ""], dtype=object),
        np.array(["b", "a", "b"]),
    ]
    for values in cases:
        got, want = distinct(values), np.unique(values)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), values


class _TokensOnly:
    """An index holding only a tokens table (and no prefix ids): what row_keys reads."""

    def __init__(self, rows):
        from dumpdiff.analyzer.index.columns import Columns

        names = ("pass", "row", "seq", "pos", "id", "mode", "valid", "step")
        self._tokens = Columns(
            {
                n: np.array([r[k] for r in rows], dtype=object if n in ("seq", "mode") else np.int64)
                for k, n in enumerate(names)
            }
        )
        self._seqs = Columns(
            {"pass": np.zeros(0, np.int64), "seq": np.zeros(0, object), "prefix_ids": np.zeros(0, object)}
        )

    def cols(self, name):
        return self._tokens if name == "tokens" else self._seqs


def test_row_keys_follow_branches_and_refuse_a_position_computed_twice_in_one_pass():
    """Keys are the ids from position 0 as each pass saw them. A later pass that computes a
    position again with another token branches off (a rejected speculative draft); one pass that
    computes a position twice (a tree of drafts) leaves its rows from there unkeyed, with a note,
    instead of keying a row under a sibling's context."""
    from dumpdiff.analyzer.verdict.align import row_keys

    prompt = [(0, r, "q", r, 10 + r, "prefill", 1, 1) for r in range(5)]
    chain = row_keys(
        _TokensOnly(
            prompt
            + [
                (1, 0, "q", 5, 20, "extend", 1, 2),
                (1, 1, "q", 6, 31, "extend", 1, 2),
                (1, 2, "q", 7, 32, "extend", 1, 2),
            ]
        )
    )[0]["key"].tolist()
    straight = row_keys(
        _TokensOnly(
            prompt
            + [
                (1, 0, "q", 5, 20, "extend", 1, 2),
                (1, 1, "q", 6, 21, "extend", 1, 2),
                (1, 2, "q", 7, 22, "extend", 1, 2),  # drafts 21, 22: 21 rejected
                (2, 0, "q", 6, 31, "extend", 1, 3),
                (2, 1, "q", 7, 32, "extend", 1, 3),
            ]
        )
    )
    keys = straight[0]["key"].tolist()
    assert keys[5] == chain[5] and keys[8:] == chain[6:]  # the accepted branch pairs
    assert keys[6] not in chain and keys[7] not in chain  # the rejected draft's rows pair with nothing
    tree, notes, _ = row_keys(
        _TokensOnly(
            prompt
            + [
                (1, 0, "q", 5, 20, "extend", 1, 2),
                (1, 1, "q", 6, 21, "extend", 1, 2),
                (1, 2, "q", 6, 31, "extend", 1, 2),
                (1, 3, "q", 7, 32, "extend", 1, 2),
            ]
        )
    )
    assert tree["key"].tolist()[5:7] == chain[5:6] + [keys[6]] and tree["key"].tolist()[7:] == [None, None]
    assert any("computes position 6 of sequence q twice" in n for n in notes)


def test_a_call_that_never_finished_is_still_walked(tmp_path):
    """A call recorded without a completion time (post None in the pass metadata, as sglang's own
    dumper gives for a call whose output it never saw) is still compared: the same culprit, in the
    timeline, not skipped for its parent."""
    from dump_surgery import copy_dump, edit_pass_meta, rank0

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=4)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--strict-only", "--format", "json", "--no-progress")
    assert code == 1, err
    before = json.loads(out)
    culprit = before["culprit"]["call"]
    unfinished = copy_dump(dec, tmp_path / "unfinished")

    def forget_post(meta):
        for call in meta["calls"]:
            if call["call"] == culprit:
                call["post"] = None

    for name in sorted(os.listdir(rank0(unfinished))):  # the prefill and every decode step
        if name.endswith(".safetensors"):
            edit_pass_meta(os.path.join(rank0(unfinished), name), forget_post)
    code, out, err = dumpdiff("first-divergence", ref, unfinished, "--strict-only", "--format", "json", "--no-progress")
    assert code == 1, err
    after = json.loads(out)
    assert after["culprit"]["call"] == culprit and after["culprit"]["n_rows"] == before["culprit"]["n_rows"]
    assert culprit in [c["call"] for c in after["ranks"]["0"]["calls_timeline"]]
