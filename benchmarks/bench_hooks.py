"""The dumper's per-call Python work, alone: one decode step's hooked calls replayed through the
hooks, against a minimal staging hook measured in the same rounds.

A decode step of a large model on a GPU is bound by the host's Python work (kernels are queued
faster than they run only when the host keeps up), so what the hooks do per call is what a
fingerprint run adds to it. This benchmark takes the model out: one forward's hooked calls
(module, args, kwargs, output) are recorded once, then replayed through

* minimal       a hook that stages each new floating-point tensor (one identity key, one
                copy made as the dumper makes it: raw bytes where contiguous) and nothing
                else: near the floor of any design that copies at hook time       the baseline
* fingerprint   the dumper's hooks, DUMPER_NON_INTRUSIVE_MODE=fingerprint, on a pass that
                repeats a traced one (dumper/passplan.py: each call checked against the plan,
                staging copies to fixed places; the prints themselves are left out)
* general       the same with plans off: every call worked out by the general hooks (staging
                copies, metadata, aliases)
* all           the same in mode all (host copies instead of staging copies)

in interleaved rounds; each ratio is the median of per-round ratios. On a CUDA device the copies
are queued on the device, as in a real step.

    python benchmarks/bench_hooks.py                  (CPU: a random Llama, 16 layers)
    python benchmarks/bench_hooks.py --device cuda --hidden 4096 --layers 32 --batch 8
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time

import torch
from common import llama, median, result, sync

from dumpdiff import dumper
from dumpdiff.dumper import passplan, rawcopy


def record_calls(model, ids):
    """[(kind, module, args, kwargs, output)] of one decode-shaped forward, the root left out."""
    events, handles = [], []
    for module in model.modules():
        if module is model:
            continue
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, k: events.append(("pre", m, a, dict(k), None)), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(
                lambda m, a, k, o: events.append(("post", m, a, dict(k), o)), with_kwargs=True, always_call=True
            )
        )
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return events


class MinimalStager:
    """Stage each tensor not seen before in this pass into one preallocated buffer, by the
    dumper's own cheapest copy (dumper/rawcopy.py: raw bytes where the tensor is contiguous)."""

    def __init__(self, device):
        self.buffer = torch.empty(1 << 26, dtype=torch.uint8, device=device)
        self.address = self.buffer.data_ptr()
        self.seen, self.used = set(), 0

    def stage(self, tensor):
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype, tensor._version)
        if key in self.seen or not tensor.is_floating_point():
            return
        self.seen.add(key)
        n = tensor.numel() * tensor.element_size()
        if self.used + n > self.buffer.numel():
            self.used = 0
        if not rawcopy.copy_rows(self.address + self.used, tensor):
            self.buffer[self.used : self.used + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.used += -(-n // 16) * 16  # the next tensor's view starts aligned

    def replay(self, events):
        self.seen.clear()
        for kind, _, args, kwargs, output in events:
            leaves = (
                (*args, *kwargs.values()) if kind == "pre" else (output if isinstance(output, tuple) else (output,))
            )
            for leaf in leaves:
                if type(leaf) is torch.Tensor:
                    self.stage(leaf)


def open_pass(handle, ids):
    """A pass opened by hand, as the root wrapper opens it (not timed: a pass's own cost)."""
    handle._pass_thread = threading.get_ident()
    if not handle._begin_pass((ids,), {"use_cache": False}):
        raise RuntimeError("the pass was not opened")


def dumper_replay(handle, events):
    """The events through the dumper's hooks; the pass is then dropped (not written)."""
    for kind, module, args, kwargs, output in events:
        if kind == "pre":
            handle._pre(module, args, kwargs)
        else:
            handle._post(module, args, kwargs, output)
    handle._pass = handle._pass_thread = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    heads = max(1, args.hidden // 128) if args.hidden >= 1024 else 2
    model = llama(
        dtype,
        args.device,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        intermediate_size=args.hidden * 7 // 2,
        vocab_size=1024,
    )
    ids = torch.randint(3, 1024, (args.batch, 1), generator=torch.Generator().manual_seed(0)).to(args.device)
    events = record_calls(model, ids)
    hooked = sum(kind == "pre" for kind, *_ in events)
    minimal = MinimalStager(args.device)
    work = tempfile.mkdtemp(prefix="dumpdiff-bench-hooks-")
    times = {name: [] for name in ("minimal", "fingerprint", "general", "all")}
    for r in range(args.rounds):
        order = list(times) if r % 2 == 0 else list(times)[::-1]  # drift hits each state alike
        for name in order:
            handle = None
            if name != "minimal":
                passplan.PLANS = name == "fingerprint"
                handle = dumper.install(
                    model,
                    dumper.DumperConfig(
                        enable=True,
                        dir=work,
                        exp_name=name,
                        non_intrusive_mode="fingerprint" if name == "general" else name,
                        min_free_bytes=0,
                        cleanup_previous=True,
                    ),
                )
                with torch.no_grad():
                    for _ in range(2):  # hooks attached, caches warm; the structure met, then traced
                        model(ids, use_cache=False)
                handle.flush()
                open_pass(handle, ids)
            sync(args.device)
            start = time.perf_counter()
            if handle is None:
                minimal.replay(events)
            else:
                dumper_replay(handle, events)
            sync(args.device)
            times[name].append(time.perf_counter() - start)
            if handle is not None:
                handle.remove()
    per_call = {name: median(t) / hooked * 1e6 for name, t in times.items()}
    print(
        f"# {args.layers} layers, hidden {args.hidden}, batch {args.batch}, {dtype} on {args.device}: "
        f"{hooked} hooked calls a step; us per call: " + ", ".join(f"{name} {us:.1f}" for name, us in per_call.items()),
        flush=True,
    )
    shutil.rmtree(work, ignore_errors=True)
    for name in ("fingerprint", "general", "all"):
        ratio = median([x / y for x, y in zip(times[name], times["minimal"])])
        result(
            f"hooks per call, {name if name != 'all' else 'mode all'} / minimal staging hook",
            round(ratio, 2),
            "context",
            None,
            "x",
            f"{per_call[name]:.1f} vs {per_call['minimal']:.1f} us a call",
        )


if __name__ == "__main__":
    main()
