"""The analyzer works on raw element bits in numpy (no torch on the verdict path): its decoding of
every float type, its per-row magnitudes and its error figures must agree with torch's own."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from analyzer.compare import error_stats
from analyzer.dtypes import of_torch, to_float64
from analyzer.fingerprint import fingerprints, row_stats
from analyzer.torchbits import from_torch, to_torch
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
    rows[0, :2] = torch.tensor([1 + 2 ** -52, -0.5], dtype=torch.float64).to(dtype)  # one ulp above 1 in float64
    _, amax, nonfinite = row_stats(*from_torch(rows))
    assert np.array_equal(amax, rows.double().abs().amax(dim=1).numpy()) and not nonfinite.any()


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
    assert figures["elements_differ"] == int((ref.view(torch.uint8) != test.view(torch.uint8)).reshape(8, -1)
                                             .reshape(-1, ref.element_size()).any(dim=1).sum())
    assert figures["dtype"] == str(dtype).replace("torch.", "") and figures["max_ulp"] >= 1


def test_strict_verdict_never_imports_torch_or_pandas(tmp_path):
    """--strict-only answers from the index and the culprit's bytes: no second of torch start-up,
    and (the indexes built) no third of a second of pandas."""
    model = load_model(make_tiny_llama(tmp_path / "llama"))
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=4)
    code, out, err = dumpdiff("index", ref, dec, "--no-progress")  # both in one command
    assert code == 0 and out.count("tensor rows") == 2, err
    probe = ("import json, runpy, sys\n"
             "sys.argv = ['dumpdiff', 'first-divergence', sys.argv[1], sys.argv[2], '--strict-only', '--format', "
             "'json', '--no-progress']\n"
             "try:\n    runpy.run_module('analyzer.cli', run_name='__main__')\n"
             "except SystemExit as exc:\n    code = exc.code\n"
             "print(json.dumps({'exit': code, 'torch': 'torch' in sys.modules, 'pandas': 'pandas' in sys.modules}), "
             "file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", probe, ref, dec], capture_output=True, text=True, cwd=ROOT)
    status = json.loads(proc.stderr.strip().splitlines()[-1])
    verdict = json.loads(proc.stdout)
    assert status == {"exit": 1, "torch": False, "pandas": False}, proc.stderr[-2000:]
    assert verdict["culprit"]["call"] and verdict["culprit"]["max_abs"] > 0
