"""What fingerprint dumps cost, against the plain run measured in the same run.

A random HF Llama, a batch of prompts, greedy decode steps through ``generate``; every module
hooked. The decode time of a state is (generate of 1 + steps tokens) - (generate of 1 token),
so the prefill is left out; states are measured in interleaved rounds, medians reported:

* plain         no dumper installed                                        the baseline
* no-op hooks   hooks that do nothing on every module / plain              the floor
  (each ratio is the median of per-round ratios; rounds alternate the order of the states)
* fingerprint   DUMPER_NON_INTRUSIVE_MODE=fingerprint / plain              GPU target <= 1.4
* general       the same with plans off (dumper/passplan.py): every decode step worked out
                by the general hooks / plain                               (context)
* all           mode all without carried prints / plain                    (context)
* all+prints    mode all with DUMPER_FINGERPRINTS=1 / mode all             the price of carrying them
* bytes         fingerprint files / the tensor bytes mode all stores       target <= 1%
* gc            the garbage collector's time per generated token, fingerprint and plain (context)
  (--warm-dumper: each round's dumper dumps one untimed generate first, so that every timed decode
  step follows a plan, as in a long-running dump; by default the first two follow none)
* prefill       with --prefill N: one forward of N tokens dumped in mode fingerprint, its file
                on disk, less the plain forward (seconds; target: well under one on a GPU)
* index         the index of a full dump: XXH3 from its bytes, carried prints read, rowprint
                computed from its bytes (a full dump compared with a fingerprint dump), and
                the index of the fingerprint dump itself

    python benchmarks/bench_fingerprint.py                       (CPU: a small Llama, float32)
    python benchmarks/bench_fingerprint.py --model 8b --device cuda --skip all,index --prefill 2000
                                                                  (Llama-3-8B's shape, bf16)
    python benchmarks/bench_fingerprint.py --model 8b --layers 2 --prompt 16 --steps 4 --rounds 1 --skip all,index
                                         (the bytes at Llama-3-8B's row widths, on a CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import torch
from common import (  # first: puts the repo on sys.path
    GPU_LLAMA_8B,
    captured_bytes,
    dir_bytes,
    llama,
    median,
    result,
    sync,
)

from dumpdiff import dumper
from dumpdiff.dumper import passplan

CPU_LLAMA = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=704,
    vocab_size=8000,
    max_position_embeddings=2048,
)


def generate_seconds(model, ids, new_tokens, device):
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - start


def decode_seconds(model, ids, steps, device, settle=lambda: None):
    """Time of ``steps`` decode steps: a generate of 1 + steps tokens less one of 1 token.
    ``settle`` (untimed) runs after each: the dump writer's backlog of one must not fall into
    the other's time."""
    long = generate_seconds(model, ids, steps + 1, device)
    settle()
    short = generate_seconds(model, ids, 1, device)
    settle()
    return long - short


class GcClock:
    """Seconds Python's cyclic garbage collector ran while entered: the dumper's per-pass
    metadata is what makes it run, and a full collection walks every object of the process."""

    def __enter__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._tick)

    def _tick(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def noop_hooks(model):
    """Hooks that do nothing, registered on every module as the dumper registers its own: the
    floor any hook-based dumper stands on (torch's slow call path with hooks)."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True))
    return handles


def fingerprint_config(work: str, name: str) -> dumper.DumperConfig:
    """Mode fingerprint into a fresh experiment folder under ``work``, dumping from the start."""
    return dumper.DumperConfig(
        enable=True, dir=work, exp_name=name, cleanup_previous=True, non_intrusive_mode="fingerprint", min_free_bytes=0
    )


def prefill_seconds(model, ids, device, work, fingerprint: bool) -> float:
    """One forward of ``ids``, plain or dumped in mode fingerprint with its file on disk."""
    handle = dumper.install(model, fingerprint_config(work, "prefill")) if fingerprint else None
    try:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False)
        if handle is not None:
            handle.flush()
        sync(device)
        return time.perf_counter() - start
    finally:
        if handle is not None:
            handle.remove()


def bench_prefill(model, tokens, vocab, device, work, rounds):
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    prefill_seconds(model, ids, device, work, True)  # warm-up
    plain, dumped = [], []
    for r in range(rounds):
        for fingerprint in (False, True) if r % 2 == 0 else (True, False):
            (dumped if fingerprint else plain).append(prefill_seconds(model, ids, device, work, fingerprint))
    extra = median([d - p for d, p in zip(dumped, plain)])
    result(
        f"prefill of {tokens} tokens dumped in mode fingerprint, extra seconds",
        round(extra, 3),
        "well under 1 s on a GPU",
        extra < 1.0 if device != "cpu" else None,
        "s",
        f"{median(dumped):.3f} vs {median(plain):.3f} s plain",
    )


def measure(model, ids, steps, device, work, config, name, warm=False):
    """(decode seconds, dump folder) of one round of a state; config None: no dumper; "noop":
    no-op hooks only. ``warm``: the dumper first dumps one untimed generate, so that the timed
    decode steps all follow plans, as in a long-running dump."""
    if config is None:
        return decode_seconds(model, ids, steps, device), None
    if config == "noop":
        handles = noop_hooks(model)
        try:
            return decode_seconds(model, ids, steps, device), None
        finally:
            for handle in handles:
                handle.remove()
    config = dict(config)
    passplan.PLANS = config.pop("plans", True)
    handle = dumper.install(
        model,
        dumper.DumperConfig(
            enable=True, dir=work, exp_name=name, cleanup_previous=True, queue_bytes=8 << 30, min_free_bytes=0, **config
        ),
    )
    try:
        if warm:
            generate_seconds(model, ids, steps + 1, device)
            handle.flush()
        seconds = decode_seconds(model, ids, steps, device, settle=handle.flush)
    finally:
        handle.remove()
    return seconds, os.path.join(work, name)


def tensor_bytes_of(folder):
    """Bytes mode all would store for the passes of a dump (from its metadata: exact, nothing written)."""
    from safetensors import safe_open

    total = 0
    for base, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(base, name), "np") as handle:
                    total += captured_bytes(json.loads(handle.metadata()["dumpdiff.pass"]))["stored_full_rows"]
    return total


def bench_index(work, model, ids, steps, device):
    """Index build times of one dump made three ways (seconds, medians of 3 builds)."""
    from dumpdiff.analyzer.dump.load import open_dump
    from dumpdiff.analyzer.index import prints as printindex
    from dumpdiff.analyzer.index import store as index_mod
    from dumpdiff.analyzer.index.build import build_many as xxh3_build

    dumps = {}
    for name, config in (
        ("plain", {"fingerprints": "0"}),
        ("carried", {"fingerprints": "1"}),
        ("fp", {"non_intrusive_mode": "fingerprint"}),
    ):
        _, dumps[name] = measure(model, ids, steps, device, work, config, f"index-{name}")
    opened = {k: open_dump(v) for k, v in dumps.items()}
    builds = {
        "xxh3 of full bytes": lambda: xxh3_build([opened["plain"]], progress=False),
        "carried prints read": lambda: printindex.build_many([opened["carried"]], progress=False),
        "rowprint of full bytes": lambda: printindex.build_many([opened["plain"]], progress=False),
        "fingerprint dump": lambda: printindex.build_many([opened["fp"]], progress=False),
    }
    times = {}
    for label, build in builds.items():
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            build()
            runs.append(time.perf_counter() - start)
        times[label] = median(runs)
    del index_mod
    return times, {k: dir_bytes(v) for k, v in dumps.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=["cpu", "8b"], default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on a GPU")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the shape's); bytes per layer do not change with it",
    )
    parser.add_argument("--skip", default="", help="comma list of: all, index, noop, general")
    parser.add_argument(
        "--warm-dumper",
        action="store_true",
        help="each round's dumper dumps one untimed generate first, so that every timed decode step "
        "follows a plan (the garbage collector's figure then counts that generate too)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="also time a dumped prefill of this many tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    shape = dict(GPU_LLAMA_8B if args.model == "8b" else CPU_LLAMA)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    model = llama(dtype, args.device, **shape)
    ids = torch.randint(
        3, shape["vocab_size"], (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    ).to(args.device)
    print(
        f"# {args.model} Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {dtype}) on "
        f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}: batch {args.batch}, "
        f"prompt {args.prompt}, {args.steps} decode steps, every module hooked",
        flush=True,
    )
    work = tempfile.mkdtemp(prefix="dumpdiff-bench-fp-")
    states = {"plain": None, "fingerprint": {"non_intrusive_mode": "fingerprint"}}
    if "noop" not in skip:
        states["no-op hooks"] = "noop"
    if "general" not in skip:
        states["general"] = {"non_intrusive_mode": "fingerprint", "plans": False}
    if "all" not in skip:
        states.update({"all": {"fingerprints": "0"}, "all+prints": {"fingerprints": "1"}})
    try:
        # warm-up at the measured length: a first generate of new cache lengths runs far slower
        decode_seconds(model, ids, args.steps, args.device)
        measure(model, ids, args.steps, args.device, work, states["fingerprint"], "warm")
        times = {name: [] for name in states}
        collected = {name: [] for name in states}  # garbage collector seconds of each round's generates
        folders = {}
        for r in range(args.rounds):
            order = list(states.items()) if r % 2 == 0 else list(states.items())[::-1]  # drift hits each state alike
            for name, config in order:
                if folders.get(name):  # only the last round's dump is read: a mode-all dump at 8B fills disks
                    shutil.rmtree(folders[name], ignore_errors=True)
                with GcClock() as clock:
                    seconds, folders[name] = measure(
                        model,
                        ids,
                        args.steps,
                        args.device,
                        work,
                        config,
                        f"{name.replace('+', '-')}-{r}",
                        warm=args.warm_dumper,
                    )
                times[name].append(seconds)
                collected[name].append(clock.seconds)
            print(
                f"# round {r}: " + ", ".join(f"{n} {t[-1] / args.steps * 1e3:.2f} ms/step" for n, t in times.items()),
                flush=True,
            )
        step = {name: median(t) / args.steps for name, t in times.items()}
        out = {"device": args.device, "model": args.model, "ms_per_step": {k: v * 1e3 for k, v in step.items()}}

        def ratio_of(name, base):  # the median of per-round ratios: a shared host's speed drifts between rounds
            return median([x / y for x, y in zip(times[name], times[base])])

        ratio = ratio_of("fingerprint", "plain")
        result(
            "fingerprint decode step / plain",
            round(ratio, 3),
            "<= 1.4 on a GPU",
            ratio <= 1.4 if args.device != "cpu" else None,
            "x",
            f"{step['fingerprint'] * 1e3:.2f} vs {step['plain'] * 1e3:.2f} ms",
        )
        if "no-op hooks" in step:
            result(
                "no-op hooks decode step / plain (the floor)",
                round(ratio_of("no-op hooks", "plain"), 3),
                "context",
                None,
                "x",
            )
        if "general" in step:
            result(
                "fingerprint with plans off (general hooks) decode step / plain",
                round(ratio_of("general", "plain"), 3),
                "context",
                None,
                "x",
                f"{step['general'] * 1e3:.2f} ms",
            )
        if "all" in step:
            result("all decode step / plain", round(ratio_of("all", "plain"), 3), "context", None, "x")
            result("all with carried prints / all", round(ratio_of("all+prints", "all"), 3), "close to 1", None, "x")
        gc_ms = median(collected["fingerprint"]) / (args.steps + 2) * 1e3
        result(
            "garbage collector time per generated token, fingerprint",
            round(gc_ms, 2),
            "context",
            None,
            "ms",
            f"{gc_ms / (step['fingerprint'] * 1e3):.1%} of its decode step; plain "
            f"{median(collected['plain']) / (args.steps + 2) * 1e3:.2f} ms",
        )
        out["gc_ms_per_token"] = {k: median(v) / (args.steps + 2) * 1e3 for k, v in collected.items()}
        fp_bytes = dir_bytes(folders["fingerprint"])
        full_bytes = tensor_bytes_of(folders["fingerprint"])
        share = fp_bytes / full_bytes
        result(
            "fingerprint bytes / all-mode tensor bytes",
            round(share, 5),
            "<= 0.01",
            share <= 0.01,
            "",
            f"{fp_bytes / 1e6:.2f} MB vs {full_bytes / 1e6:.1f} MB",
        )
        out.update(fp_bytes=fp_bytes, all_tensor_bytes=full_bytes)
        if "index" not in skip:
            index_times, sizes = bench_index(work, model, ids, args.steps, args.device)
            for label, seconds in index_times.items():
                print(f"# index, {label}: {seconds:.3f} s", flush=True)
            base = index_times["xxh3 of full bytes"]
            for label in ("carried prints read", "rowprint of full bytes", "fingerprint dump"):
                result(
                    f"index: {label} / xxh3 of full bytes", round(index_times[label] / base, 3), "context", None, "x"
                )
            out.update(index_seconds=index_times, index_dump_bytes=sizes)
        if args.prefill:
            bench_prefill(model, args.prefill, shape["vocab_size"], args.device, work, args.rounds)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(out, handle, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
