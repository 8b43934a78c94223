"""Hooks installed with dumping disabled cost nothing (target: at most 1% per forward).

The boot state of the sglang workflow is ``install(model, DumperConfig(enable=False))``: the
root forward is wrapped, no per-module hook is attached. The baseline is the same model with no
dumper installed, measured in the same run, interleaved block by block (install, time a block,
remove, time a block, ...) so drifts of the machine hit both sides alike; the states take every
place in a round in turn (every order of the three states, round after round), so a place that
is slower (a GPU clocking down after the pause of a switch) is not always the same state's.

Also measured, as information: the state after a dump was made and dumping disabled again
(``configure(enable=False)``), where the per-module hooks stay attached until the next pass.

    python benchmarks/bench_off.py                 # CPU: a random HF Llama, forward >= 5 ms
    python benchmarks/bench_off.py --device cuda   # the same on a GPU (bf16)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import tempfile
import time

import torch
from common import GPU_LLAMA, llama, median, n_params, result, sync

from dumpdiff import dumper

ORDERS = list(itertools.permutations(("base", "off", "wrap")))


def _dumped_then_disabled(model, ids, tmp: str, name: str, **config):
    """The dumper after one short dumped pass, dumping disabled again: per-module hooks attached."""
    handle = dumper.install(model, dumper.DumperConfig(enable=True, dir=tmp, exp_name=name, **config))
    with torch.no_grad():
        model(ids[:, :8])
    handle.configure(enable=False)
    handle.flush()
    return handle


def forward_times(model, ids, n: int, device: str) -> list:
    times = []
    with torch.no_grad():
        for _ in range(n):
            sync(device)
            start = time.perf_counter()
            model(ids)
            sync(device)
            times.append(time.perf_counter() - start)
    return times


def paired_ratio(blocks: list, baselines: list) -> float:
    """Median over rounds of (median of a round's block / median of the same round's baseline
    block): the machine's drift over a run (GPU clocks, other tenants) moves both alike."""
    return median([median(b) / median(a) for b, a in zip(blocks, baselines)])


def wrapper_cost(tmp: str, calls: int = 100_000) -> float:
    """Seconds the installed, disabled dumper adds to one forward, timed around a module that does
    nothing: no kernel, clock or other tenant varies between the two loops (best of 5 each)."""

    class Nothing(torch.nn.Module):
        def forward(self, x):
            return x

    module, x = Nothing(), torch.zeros(1)

    def per_call() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        return (time.perf_counter() - start) / calls

    bare = min(per_call() for _ in range(5))
    handle = dumper.install(module, dumper.DumperConfig(enable=False, dir=tmp, exp_name="cost"))
    installed = min(per_call() for _ in range(5))
    handle.remove()
    return installed - bare


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--variants", action="store_true", help="also time a bare root-forward wrapper")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda:
        model = llama(torch.bfloat16, args.device, **GPU_LLAMA)
        tokens, rounds, block = args.tokens or 2048, args.rounds or 12, args.block or 10
    else:
        model = llama(
            torch.float32,
            hidden_size=256,
            num_hidden_layers=8,
            intermediate_size=688,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        tokens, rounds, block = args.tokens or 64, args.rounds or 40, args.block or 10
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), device=args.device)
    print(
        f"# off-cost on {args.device}: Llama {n_params(model) / 1e6:.1f}M params, {tokens} tokens, "
        f"{rounds} rounds x {block} forwards per state",
        flush=True,
    )
    forward_times(model, ids, 5, args.device)  # warm-up

    base, off, idle_after, wrapped = [], [], [], []  # one list of forward times per round and state
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for state in ORDERS[r % len(ORDERS)]:
                if state == "base":
                    base.append(forward_times(model, ids, block, args.device))
                elif state == "off":
                    handle = dumper.install(model, dumper.DumperConfig(enable=False, dir=tmp, exp_name="off"))
                    off.append(forward_times(model, ids, block, args.device))
                    handle.remove()
                elif args.variants:  # a bare pass-through wrapper of the root forward: the floor
                    original = model.forward
                    model.forward = functools.wraps(original)(lambda *a, original=original, **k: original(*a, **k))
                    wrapped.append(forward_times(model, ids, block, args.device))
                    del model.forward
        # After a dump: hooks were attached by the enabled pass, then dumping was disabled.
        handle = _dumped_then_disabled(model, ids, tmp, "after", filter="layers\\.0\\." if cuda else "")
        base2 = []
        for r in range(max(rounds // 2, 4)):
            for state in ("idle", "base") if r % 2 == 0 else ("base", "idle"):  # which is timed first alternates
                if state == "idle":
                    idle_after.append(forward_times(model, ids, block, args.device))
                else:
                    handle.remove()
                    base2.append(forward_times(model, ids, block, args.device))
                    handle = _dumped_then_disabled(model, ids, tmp, f"after{r}")
        handle.remove()
        cost = wrapper_cost(tmp)

    def flat(blocks):
        return [t for b in blocks for t in b]

    t_base, t_off = median(flat(base)), median(flat(off))
    ratio = paired_ratio(off, base)
    where = "GPU" if cuda else "CPU"
    print(f"# no hooks {t_base * 1e3:.3f} ms/forward, installed+disabled {t_off * 1e3:.3f} ms/forward", flush=True)
    result(
        f"off: installed, disabled / no hooks ({where})",
        ratio,
        "<= 1.01",
        ratio <= 1.01,
        "x",
        f"median of {len(base)} per-round ratios; median forward {t_base * 1e3:.2f} ms vs {t_off * 1e3:.2f} ms, "
        f"{len(flat(base))} forwards each",
        base_ms=t_base * 1e3,
        off_ms=t_off * 1e3,
    )
    result(
        f"off: the disabled dumper's time per forward, timed on a no-op module / no hooks ({where})",
        1 + cost / t_base,
        "<= 1.01",
        1 + cost / t_base <= 1.01,
        "x",
        f"{cost * 1e6:.2f} us per call against a {t_base * 1e3:.2f} ms forward: the same state as above, "
        "without the forward-to-forward noise",
        cost_us=cost * 1e6,
    )
    if wrapped:
        result(
            f"info: a bare root-forward wrapper / no hooks ({where})",
            paired_ratio(wrapped, base),
            "info",
            None,
            "x",
            f"median forward {median(flat(wrapped)) * 1e3:.3f} ms",
        )
    t_base2, t_after = median(flat(base2)), median(flat(idle_after))
    ratio2 = paired_ratio(idle_after, base2)
    result(
        f"off after a dump (enable=False again) / no hooks ({where})",
        ratio2,
        "<= 1.01 (info)",
        ratio2 <= 1.01,
        "x",
        f"median of {len(base2)} per-round ratios; median forward {t_base2 * 1e3:.2f} ms vs {t_after * 1e3:.2f} ms; "
        "the first forward after disabling detaches the per-module hooks",
        base_ms=t_base2 * 1e3,
        off_ms=t_after * 1e3,
    )


if __name__ == "__main__":
    main()
