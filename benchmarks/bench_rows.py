"""Fewer bytes. Row selection stores only the token rows a comparison needs.

A decode run (generate: a T-token prefill + decode steps) is compared with a reference prefill
of prompt + output (T + k rows). Only the k rows from position T on are compared by a
decode-vs-reference question, so ``DUMPER_POSITIONS='T:'`` (or ``DUMPER_LAST_ROWS=k`` for the
reference) should store about k/(T+k) of the reference's bytes. Measured: bytes of each dump,
full and selected, against that expectation; and first-divergence must still name a culprit
on the selected dumps (alignment proved on the kept rows).

    python benchmarks/bench_rows.py [--tokens 512] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from common import ROOT, dir_bytes, dump_pair, fmt_bytes, llama, result  # first: puts the repository on sys.path


def first_divergence(ref, dec):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dumpdiff.analyzer.cli",
            "first-divergence",
            ref,
            dec,
            "--format",
            "json",
            "--no-progress",
            "--strict-only",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    try:
        verdict = json.loads(proc.stdout)
    except ValueError:
        verdict = {}
    return proc.returncode, verdict, proc.stderr.strip()[-300:]


def measure(model, prompt, new_tokens, work, device="cpu", where="CPU"):
    tokens = prompt.shape[1]
    full_ref, full_dec = dump_pair(model, os.path.join(work, "full"), prompt, new_tokens, device)
    pos_ref, pos_dec = dump_pair(
        model, os.path.join(work, "positions"), prompt, new_tokens, device, positions=f"{tokens}:"
    )
    last_ref, last_dec = dump_pair(model, os.path.join(work, "last"), prompt, new_tokens, device, last_rows=new_tokens)
    sizes = {
        name: dir_bytes(path)
        for name, path in (
            ("full ref", full_ref),
            ("full dec", full_dec),
            ("positions ref", pos_ref),
            ("positions dec", pos_dec),
            ("last ref", last_ref),
            ("last dec", last_dec),
        )
    }
    for name, size in sizes.items():
        print(f"# {where} {name}: {fmt_bytes(size)}", flush=True)
    expected = new_tokens / (tokens + new_tokens)
    for how, ref in (("DUMPER_POSITIONS", "positions ref"), ("DUMPER_LAST_ROWS", "last ref")):
        ratio = sizes[ref] / sizes["full ref"]
        result(
            f"rows: reference bytes with {how} / full ({where})",
            ratio,
            f"about k/(T+k) = {expected:.3f} (<= 2x that)",
            ratio <= 2 * expected,
            "x",
            f"T={tokens}, k={new_tokens}: {fmt_bytes(sizes[ref])} of {fmt_bytes(sizes['full ref'])}",
        )
    both = (sizes["positions ref"] + sizes["positions dec"]) / (sizes["full ref"] + sizes["full dec"])
    result(
        f"rows: dump pair bytes with DUMPER_POSITIONS={tokens}: / full ({where})",
        both,
        f"about k/(T+k) = {expected:.3f} (<= 2x that)",
        both <= 2 * expected,
        "x",
        f"{fmt_bytes(sizes['positions ref'] + sizes['positions dec'])} of "
        f"{fmt_bytes(sizes['full ref'] + sizes['full dec'])}",
    )
    verdicts = {}
    for how, (ref, dec) in (("full", (full_ref, full_dec)), ("positions", (pos_ref, pos_dec))):
        code, verdict, err = first_divergence(ref, dec)
        culprit = (verdict.get("culprit") or {}).get("call")
        rows = verdict.get("ranks", {}).get("0", {}).get("rows_compared")
        verdicts[how] = (code, culprit, rows, err)
        print(
            f"# {where} first-divergence on {how} dumps: exit {code}, culprit {culprit}, rows compared {rows} {err}",
            flush=True,
        )
    code, culprit, rows, err = verdicts["positions"]
    result(
        f"rows: first-divergence on row-selected dumps ({where})",
        code,
        "exit 0/1, alignment proved",
        code in (0, 1),
        "",
        f"culprit {culprit} on {rows} compared rows (full dumps: culprit {verdicts['full'][1]} "
        f"on {verdicts['full'][2]} rows){'; ' + err if code not in (0, 1) else ''}",
    )
    return sizes, verdicts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    model = llama(
        torch.float32,
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=688,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    prompt = torch.randint(3, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    work = tempfile.mkdtemp(prefix="dumpdiff-bench-rows-", dir=args.dir)
    try:
        measure(model, prompt, args.new_tokens, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
