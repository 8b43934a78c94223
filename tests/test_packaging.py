"""What a user installing dumpdiff relies on: the wheel installs dumpdiff.dumper and
dumpdiff.analyzer and nothing generic, and a machine that only analyses dumps needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import torch

from helpers import ROOT, dump_padded_batch, first_divergence_json, load_model, make_tiny_llama

# The `dumpdiff` program in a process where importing torch fails as it does where it is absent.
WITHOUT_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
sys.argv = ["dumpdiff"] + sys.argv[1:]
runpy.run_module("dumpdiff.analyzer.cli", run_name="__main__")
"""


def test_the_wheel_holds_dumpdiff_packages_only(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dumpdiff-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dumpdiff"}
    for module in ("dumpdiff/dumper/hooks.py", "dumpdiff/analyzer/cli/main.py", "dumpdiff/analyzer/verdict/noise.py"):
        assert module in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("dumpdiff/") and n.endswith("/__init__.py") and n.count("/") == 1 for n in names)
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "dumpdiff = dumpdiff.analyzer.cli.main:entry" in entry_points


def test_a_dense_dump_is_analysed_without_torch(tmp_path):
    make_tiny_llama(tmp_path / "model", num_hidden_layers=2)
    dump_padded_batch(load_model(tmp_path / "model", torch.bfloat16), tmp_path / "d", new_tokens=3)
    ref, dec = tmp_path / "d" / "ref", tmp_path / "d" / "dec"
    code, with_torch = first_divergence_json(ref, dec)

    def without(*args):
        return subprocess.run(
            [sys.executable, "-c", WITHOUT_TORCH, *map(str, args)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )

    proc = without("first-divergence", ref, dec, "--format", "json", "--no-progress", "--rebuild-index")
    assert proc.returncode == code, proc.stderr
    assert json.loads(proc.stdout)["ranks"] == with_torch["ranks"]
    proc = without("repro", ref, dec, "--out", tmp_path / "r", "--no-progress")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "repro needs torch" in proc.stderr, proc.stderr
