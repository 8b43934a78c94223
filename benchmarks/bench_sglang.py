"""What the dumper costs a real sglang server on CPU: installed with dumping off, dumping
everything (DUMPER_NON_INTRUSIVE_MODE=all) and dumping fingerprints (mode fingerprint), against
the plain server.

Two servers of one random Llama run side by side: ``plain`` (no DUMPER_* set: the plugin
returns at once) and ``dumper`` (DUMPER_ENABLE=0, DUMPER_SERVER_PORT=reuse: the dumper is
installed, idle). Rounds time four states, in an order that turns every round so a drift of this
shared machine hits every state alike: plain, ``off`` (the idle dumper), ``all`` and
``fingerprint`` (the dumper server with dumping switched on over /dumper/configure for the
round, in that mode, as a new experiment removed after its bytes are counted). One round is the
same workload each time: the radix cache flushed (untimed), then a few prompts sent together,
greedy, a fixed number of new tokens, timed from the request sent to the reply. Each ratio is the
median over rounds of a state's time over the plain server's time in the same round.

    .venv/bin/python benchmarks/bench_sglang.py [--rounds 6] [--prompts 4] [--prompt-len 64] [--new-tokens 32]

Needs sglang in this interpreter (scripts/install-sglang-cpu.sh, or make test).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from common import ROOT, SERVER_SHAPE, dir_bytes, fmt_bytes, median, result, server_workload

sys.path.insert(0, os.path.join(ROOT, "tests"))

from sglang_server import SglangServer, sglang_installed  # noqa: E402

STATES = ("plain", "off", "all", "fingerprint")
# A balanced Latin square: over 4 rounds each state runs once in each position and follows every
# other state once, so neither a slot in the round nor the state before it favours one state.
ORDERS = [(0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1)]


def control(server: SglangServer, **settings):
    return server.request("/dumper/configure", settings)


def main(argv=None):
    if not sglang_installed():
        sys.exit("bench_sglang: no sglang in this interpreter; run with .venv/bin/python after make test")
    args, work, model, prompts = server_workload(__doc__.splitlines()[0], "bench-sglang-", argv)
    dumps = os.path.join(work, "dumps")
    plain = SglangServer(model, log_path=os.path.join(work, "plain.log"))
    dumper = SglangServer(
        model,
        env={"DUMPER_ENABLE": "0", "DUMPER_SERVER_PORT": "reuse", "DUMPER_DIR": dumps},
        log_path=os.path.join(work, "dumper.log"),
    )
    times = {s: [] for s in STATES}
    written = {"all": [], "fingerprint": []}
    drains = {"all": [], "fingerprint": []}  # writing left after the reply (not in the round's time)

    def run(server: SglangServer) -> float:
        server.flush_cache()  # every round prefills its prompts: no radix-cache hit from the last one
        start = time.perf_counter()
        server.generate(prompts, max_new_tokens=args.new_tokens)
        return time.perf_counter() - start

    def dumped(mode: str, name: str):
        """One round on the dumper server in this mode: (time, writer drain, bytes); the
        experiment is removed after its bytes are counted."""
        control(dumper, enable=True, exp_name=name, non_intrusive_mode=mode)
        elapsed = run(dumper)
        start = time.perf_counter()
        control(dumper, enable=False)  # returns once the writer has committed the experiment
        drain = time.perf_counter() - start
        size = dir_bytes(os.path.join(dumps, name), suffix="")
        shutil.rmtree(os.path.join(dumps, name), ignore_errors=True)
        return elapsed, drain, size

    try:
        plain.start()
        dumper.start()
        # First requests and each mode's first dump pay one-time costs (the writer thread, lazy
        # imports): not timed.
        for server in (plain, dumper):
            server.generate(prompts, max_new_tokens=4)
        for mode in written:
            dumped(mode, f"warmup-{mode}")
        for k in range(args.rounds):
            for state in (STATES[i] for i in ORDERS[k % len(ORDERS)]):
                if state in written:
                    elapsed, drain, size = dumped(state, f"round{k}-{state}")
                    drains[state].append(drain)
                    written[state].append(size)
                else:
                    elapsed = run(plain if state == "plain" else dumper)
                times[state].append(elapsed)
            timed = ", ".join(f"{s} {times[s][-1]:.3f} s" for s in STATES)
            sizes = ", ".join(f"{m} {fmt_bytes(written[m][-1])}" for m in written)
            print(f"round {k}: {timed}; written {sizes}", flush=True)
    finally:
        plain.stop()
        dumper.stop()

    workload = (
        f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, random Llama "
        f"hidden {SERVER_SHAPE['hidden_size']} x {SERVER_SHAPE['num_hidden_layers']} layers, float32, {args.rounds} rounds"
    )
    ratios = {s: sorted(t / p for t, p in zip(times[s], times["plain"])) for s in STATES[1:]}
    spread = lambda r: f"rounds {r[0]:.2f}..{r[-1]:.2f}"  # noqa: E731 - this machine's noise, said beside each
    off = median(ratios["off"])
    result(
        "sglang plugin loaded, dumping off / plain server",
        off,
        "<= 1.05",
        off <= 1.05,
        "x",
        f"{workload}; {spread(ratios['off'])}; plain median {median(times['plain']):.3f} s",
    )
    for mode in written:
        result(
            f"sglang dumping, mode {mode} / plain server",
            median(ratios[mode]),
            "information",
            None,
            "x",
            f"{workload}; {spread(ratios[mode])}; writer drained {median(drains[mode]):.3f} s after the reply (median)",
        )
    fp_all = sorted(f / a for f, a in zip(times["fingerprint"], times["all"]))
    result(
        "sglang dumping, mode fingerprint / mode all",
        median(fp_all),
        "information",
        None,
        "x",
        f"{workload}; same rounds; {spread(fp_all)}",
    )
    for mode in written:
        sizes = sorted(written[mode])
        result(
            f"sglang bytes written per round, mode {mode}",
            median(sizes),
            "information",
            None,
            "B",
            f"{fmt_bytes(median(sizes))} (rounds {fmt_bytes(sizes[0])}..{fmt_bytes(sizes[-1])}), every file of the experiment",
        )
    share = median(written["fingerprint"]) / median(written["all"])
    result(
        "sglang fingerprint bytes / mode all bytes, per round",
        share,
        "information",
        None,
        "x",
        f"{share:.2%}; medians over rounds",
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
