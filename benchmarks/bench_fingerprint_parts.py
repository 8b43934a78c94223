"""Where a fingerprint decode step's added time goes: the same steps with parts of the dumper
taken out, against the plain step measured in the same rounds.

A random HF Llama (Llama-3-8B's layer shape on a GPU, a small one on a CPU), batch 8, greedy
decode steps through ``generate`` (a generate of 1 + N tokens less one of 1 token), every module
hooked; states in interleaved rounds, each ratio the median of per-round ratios:

* plain              no dumper                                                 the baseline
* no-op hooks        hooks that do nothing, on every module (torch's hook dispatch alone)
* fingerprint        DUMPER_NON_INTRUSIVE_MODE=fingerprint, whole
* no files           the same, the writer thread writing nothing (it still waits for the pass)
* no prints          the same, nothing staged or printed (the metadata and files stay)
* bookkeeping only   neither: the hooks' Python work per call and per pass

The parts are taken out by replacing two dumper methods in this process (PassWriter._write,
Dumper._stage_print), so the differences between states are what each part costs.

    python benchmarks/bench_fingerprint_parts.py                              (CPU)
    python benchmarks/bench_fingerprint_parts.py --device cuda --layers 8     (8 of the 8B shape's layers)
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from bench_fingerprint import decode_seconds, fingerprint_config, noop_hooks
from common import GPU_LLAMA_8B, llama, median, result  # first: puts the repo on sys.path

from dumpdiff import dumper
from dumpdiff.dumper import hooks, writer

CPU_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
STATES = ("plain", "no-op hooks", "fingerprint", "no files", "no prints", "bookkeeping only")


def run_state(state: str, model, ids, steps: int, device: str, work: str) -> float:
    if state == "plain":
        return decode_seconds(model, ids, steps, device)
    if state == "no-op hooks":
        handles = noop_hooks(model)
        try:
            return decode_seconds(model, ids, steps, device)
        finally:
            for handle in handles:
                handle.remove()
    write, stage = writer.PassWriter._write, hooks.Dumper._stage_print
    if state in ("no files", "bookkeeping only"):
        # the pass is still waited for (its event), as a real write would
        writer.PassWriter._write = lambda self, record: record.ready is not None and record.ready.synchronize()
    if state in ("no prints", "bookkeeping only"):
        hooks.Dumper._stage_print = lambda *args: None
    handle = dumper.install(model, fingerprint_config(work, "parts"))
    try:
        seconds = decode_seconds(model, ids, steps, device)
        handle.flush()
        return seconds
    finally:
        handle.remove()
        writer.PassWriter._write, hooks.Dumper._stage_print = write, stage


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the other core is the writer thread's, as on a GPU host
        model = llama(torch.float32, "cpu", num_hidden_layers=args.layers, **CPU_SHAPE)
    else:
        model = llama(torch.bfloat16, args.device, **{**GPU_LLAMA_8B, "num_hidden_layers": args.layers})
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, 32), generator=torch.Generator().manual_seed(0)).to(args.device)
    work = tempfile.mkdtemp(prefix="dumpdiff-bench-parts-")
    for state in STATES:  # warm at the measured length: kernels compiled, caches filled
        run_state(state, model, ids, args.steps, args.device, work)
    times = {state: [] for state in STATES}
    for r in range(args.rounds):
        for state in STATES if r % 2 == 0 else STATES[::-1]:
            times[state].append(run_state(state, model, ids, args.steps, args.device, work))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.layers} layers, batch {args.batch}, {args.steps} decode steps on {name}, every module hooked")
    plain_ms = median(times["plain"]) / args.steps * 1e3
    for state in STATES[1:]:
        ratio = median([t / p for t, p in zip(times[state], times["plain"])])
        ms = median(times[state]) / args.steps * 1e3
        result(f"{state} decode step / plain", round(ratio, 3), "context", None, "x", f"{ms:.2f} vs {plain_ms:.2f} ms")


if __name__ == "__main__":
    main()
