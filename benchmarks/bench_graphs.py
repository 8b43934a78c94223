"""What dumping CUDA graph replays costs, against the plain replay measured in the same run.

A random HF Llama in bf16 (``--model 1b``: benchmarks/common.py GPU_LLAMA; ``8b``: Llama-3-8B's
shape, GPU_LLAMA_8B; ``tiny``: a small one for a smoke run; the states' models share one set of
weights), a batch of prompts prefilled eagerly, then greedy decode steps, each one
replay of a graph captured with a static KV cache (examples/hf_cuda_graph.py). Every module is
hooked. States, timed over the decode steps in interleaved rounds (medians of per-round ratios):

* plain          graph captured without the dumper                          the baseline
* all idle       graph recorded in mode all, dumping disabled: the recorded copies alone
* all            mode all, every replay written (after_replay: host copy, pass metadata, writer)
* fp idle / fp   the same in mode fingerprint (row prints computed inside the graph)
* eager / eager all   the same steps run eagerly without / with the dumper (context)

Also printed: the bytes written per decode step and the static buffer bytes each mode needed.

    python benchmarks/bench_graphs.py --model 1b --out DIR      (needs CUDA)
    python benchmarks/bench_graphs.py --model 8b --out DIR      (the shape of the 1.1x target)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time

import torch
from common import GPU_LLAMA, GPU_LLAMA_8B, llama, median, result  # first: puts the repo on sys.path

from dumpdiff import dumper

TINY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=704)


def decode_seconds(decoder, prompt, steps, handle=None, enable=False):
    """Seconds of ``steps`` decode steps after a prefill (each a replay, or eager), the writer's
    queue emptied inside the timed span when a dump is written (``enable``); the prefill is not
    dumped."""
    batch, length = prompt.shape
    if handle is not None:
        handle.configure(enable=False)
    decoder.cache.reset()  # in place: a graph keeps its addresses
    with torch.no_grad():
        decoder.model(
            input_ids=prompt,
            position_ids=torch.arange(length, device=prompt.device).expand(batch, length),
            cache_position=torch.arange(length, device=prompt.device),
            past_key_values=decoder.cache,
            use_cache=True,
        )
        torch.cuda.synchronize()
        if handle is not None:
            handle.configure(enable=enable)
        start = time.perf_counter()
        for step in range(steps):
            decoder.pos.fill_(length + step)
            decoder.slot.fill_(length + step)
            if decoder.graphs:
                if handle is not None:
                    handle.replay(decoder.graph)
                else:
                    decoder.graph.replay()
                logits = decoder.logits
            else:
                logits = decoder.model(**decoder.step_inputs()).logits
            decoder.ids.copy_(logits[:, -1].argmax(-1)[:, None])
        torch.cuda.synchronize()
        if handle is not None:
            handle.flush()
        seconds = time.perf_counter() - start
    if handle is not None:
        handle.configure(enable=False)
    return seconds


def main() -> None:
    from hf_cuda_graph import GraphDecoder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("1b", "8b", "tiny"), default="1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--buffer-bytes", type=int, default=256 << 20)
    parser.add_argument("--work", default=None, help="dump folder (default: a temporary one, deleted)")
    parser.add_argument("--out", default=None, help="folder for the log")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphs: needs a CUDA device")
    work = args.work or tempfile.mkdtemp(prefix="bench_graphs_")
    shape = {"1b": GPU_LLAMA, "8b": GPU_LLAMA_8B, "tiny": TINY}[args.model]
    base = llama(dtype=torch.bfloat16, device="cuda", **shape)
    max_len = args.prompt + args.steps + 2
    prompt = torch.randint(3, base.config.vocab_size, (args.batch, args.prompt), device="cuda")
    states = {}
    # each state's model a copy of its own (each state's dumper hooks its model), sharing the
    # weights: five 8B models would not fit one GPU
    shared = {id(tensor): tensor for tensor in (*base.parameters(), *base.buffers())}
    log_lines = [
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}, "
        f"batch {args.batch}, prompt {args.prompt}, steps {args.steps}, rounds {args.rounds}"
    ]
    for name, mode, graphs in (
        ("plain", None, True),
        ("all", "all", True),
        ("fp", "fingerprint", True),
        ("eager", None, False),
        ("eager all", "all", False),
    ):
        model = copy.deepcopy(base, memo=shared) if name != "plain" else base
        handle = None
        if mode is not None:
            handle = dumper.install(
                model,
                dumper.DumperConfig(
                    dir=work,
                    exp_name=name.replace(" ", "-"),
                    cleanup_previous=True,
                    non_intrusive_mode=mode,
                    graph_buffer_bytes=args.buffer_bytes,
                    queue_bytes=8 << 30,
                    min_free_bytes=0,
                ),
            )
        decoder = GraphDecoder(model, args.batch, max_len, handle, graphs)
        if graphs:
            decoder.capture()
        states[name] = (decoder, handle)
        if handle is not None and graphs:
            needed = max(handle._graphs.recordings(decoder.graph)[0].layout.used.values())
            log_lines.append(f"{name}: static buffers used {needed} bytes")
    times = {key: [] for key in ("plain", "all idle", "all", "fp idle", "fp", "eager", "eager all")}
    order = list(times)
    for round_no in range(args.rounds):
        turn = order[round_no % len(order) :] + order[: round_no % len(order)]
        for key in turn:
            state = key.replace(" idle", "")
            decoder, handle = states[state]
            times[key].append(decode_seconds(decoder, prompt, args.steps, handle, enable=not key.endswith("idle")))
    written = {}
    for name in ("all", "fp", "eager all"):
        _, handle = states[name]
        state = handle.state()
        written[name] = state["bytes_written"] / max(state["passes_written"], 1)
        handle.remove()

    def ratio(key, base_key):
        return median([a / b for a, b in zip(times[key], times[base_key])])

    step_ms = {key: 1000 * median(values) / args.steps for key, values in times.items()}
    figures = [
        ("recorded copies, dumping disabled / plain replay (mode all)", ratio("all idle", "plain"), "<= 1.10"),
        ("every replay written / plain replay (mode all)", ratio("all", "plain"), "info"),
        ("recorded prints, dumping disabled / plain replay (fingerprint)", ratio("fp idle", "plain"), "<= 1.10"),
        ("every replay written / plain replay (fingerprint)", ratio("fp", "plain"), "info"),
        ("eager step / plain replay", ratio("eager", "plain"), "info"),
        ("eager step dumped (mode all) / plain replay", ratio("eager all", "plain"), "info"),
        ("written replay (mode all) / eager step dumped (mode all)", ratio("all", "eager all"), "info"),
    ]
    for label, value, target in figures:
        passed = None if target == "info" else value <= float(target.split()[-1])
        result(label, round(value, 3), target, passed)
        log_lines.append(f"{label}: {value:.3f} (target {target})")
    for key, ms in step_ms.items():
        log_lines.append(f"{key}: {ms:.2f} ms per decode step (median)")
    for name, nbytes in written.items():
        result(f"bytes written per decode step ({name})", int(nbytes), "info", None, unit="B")
        log_lines.append(f"bytes written per decode step ({name}): {int(nbytes)}")
    fp_share = written["fp"] / written["all"] if written["all"] else float("nan")
    result("fingerprint bytes / mode all bytes, per replay", round(fp_share, 4), "info", None)
    log_lines.append(f"fingerprint bytes / mode all bytes, per replay: {fp_share:.4f}")
    text = "\n".join(log_lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_graphs-{args.model}.log"), "w") as handle:
            handle.write(text + "\n")
            handle.write(json.dumps({"times": times}) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
