"""Where a fingerprint decode pass's time goes: timers around the dumper's methods, with plans
(dumper/passplan.py) and without, against the plain run measured in the same run.

One dumper is kept across generates for each state, so that every timed decode step of the
planned state follows its plan (as in a long-running dump): a warm generate first (the structure
met, then traced), then a timed one. Decode time is (generate of 1 + steps tokens) - (generate of
1 token); the timers count the long generate's passes. Not interleaved rounds: one generate per
state, a check of where the time goes rather than a ratio to quote alone (bench_fingerprint.py
is that).

    python benchmarks/bench_pass_timers.py                               (CPU: a small Llama)
    python benchmarks/bench_pass_timers.py --device cuda --model 8b      (Llama-3-8B's shape, bf16)
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch
from bench_fingerprint import CPU_LLAMA, generate_seconds
from common import GPU_LLAMA_8B, llama, result

from dumpdiff import dumper
from dumpdiff.dumper import hooks, passplan, rawcopy, writer

TIMES: dict = {}


def _timed(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` (a class's method or a module's function) with a timer under ``label``
    (the writer thread's time apart)."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            key = label + (" [writer thread]" if threading.current_thread().name == "dumper-writer" else "")
            TIMES[key] = TIMES.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=["cpu", "8b"], default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    # wrapped before install: the hooks are bound when attached
    for name, label in (("_pre", "pre-hooks"), ("_post", "post-hooks"), ("_begin_pass", "start"), ("_end_pass", "end")):
        _timed(hooks.Dumper, name, label)
    _timed(writer.PassWriter, "_write", "write")
    _timed(rawcopy, "copy_rows", "staging copies (in the hooks)")
    dtype = torch.bfloat16 if args.model == "8b" else torch.float32
    model = llama(dtype, args.device, **(GPU_LLAMA_8B if args.model == "8b" else CPU_LLAMA))
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)

    def decode_ms():
        long = generate_seconds(model, ids, args.steps + 1, args.device)
        return long, (long - generate_seconds(model, ids, 1, args.device)) / args.steps * 1e3

    decode_ms()  # warm-up at the measured length
    plain = min(decode_ms()[1] for _ in range(2))
    passes = args.steps + 2  # the long generate's: its prefill and every decode step
    for plans in (True, False):
        passplan.PLANS = plans
        config = dumper.DumperConfig(
            enable=True,
            dir=tempfile.mkdtemp(prefix="dumpdiff-bench-timers-"),
            exp_name="timers",
            non_intrusive_mode="fingerprint",
            min_free_bytes=0,
            queue_bytes=8 << 30,
        )
        handle = dumper.install(model, config)
        try:
            generate_seconds(model, ids, args.steps + 1, args.device)  # structures met and traced
            handle.flush()
            TIMES.clear()
            long = generate_seconds(model, ids, args.steps + 1, args.device)
            handle.flush()
            spent = dict(TIMES)
            step = (long - generate_seconds(model, ids, 1, args.device)) / args.steps * 1e3
            handle.flush()
            followed = handle._plans.followed
        finally:
            handle.remove()
        state = "plans" if plans else "plans off"
        parts = ", ".join(f"{label} {seconds / passes * 1e3:.2f}" for label, seconds in sorted(spent.items()))
        print(f"# {state}: {step:.2f} ms a decode step against {plain:.2f} plain; ms a pass: {parts}", flush=True)
        result(
            f"fingerprint decode step / plain, one dumper kept, {state}",
            round(step / plain, 3),
            "context",
            None,
            "x",
            f"{step:.2f} vs {plain:.2f} ms; {followed} passes followed a plan",
        )


if __name__ == "__main__":
    main()
