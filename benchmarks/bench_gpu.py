"""The whole performance story on a GPU, in one run (an H200, bf16, random weights).

A random HF Llama built from a config (common.GPU_LLAMA: hidden 2048, 20 layers, 16 heads, 8 kv
heads, intermediate 5632, vocab 32000: 1.07B parameters) in bf16, a prefill of 2048 tokens and decode
steps. Every figure is a ratio against a baseline of the same run:

* off      installed with dumping disabled / no hooks, per forward (interleaved)     <= 1.01
* on       forward stall with dumping (hooks, pinned async copies) / time of the pinned
           device-to-host copies of the same bytes alone                             close to 1
* disk     writer-thread throughput / raw save_file+fsync of the same tensors        >= 0.80
* bytes    captured vs written; DUMPER_POSITIONS for a decode-vs-reference pair
* analyzer index build vs cat, first-divergence --strict-only and noise-aware on the dumps
           made here (natural bf16 prefill-vs-decode divergence), tests/test_gpu.py

    python benchmarks/bench_gpu.py [--out DIR] [--device cuda] [--small]   (--small: a smoke test)
    python benchmarks/bench_gpu.py --model 8b --skip tests,off,on,steady      (the analysis at Llama-3-8B's shape)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import torch
from common import (  # first: puts
    GPU_LLAMA,
    GPU_LLAMA_8B,
    RESULTS,
    ROOT,
    captured_bytes,
    files_under,
    fmt_bytes,
    llama,
    median,  # the repository on sys.path
    n_params,
    result,
)

from dumpdiff import dumper


def section(name):
    print(f"\n=== {name} ===", flush=True)


def timed_forward(model, ids, device):
    torch.cuda.synchronize() if device.startswith("cuda") else None
    start = time.perf_counter()
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    return time.perf_counter() - start


def bench_on(model, ids, device, work, passes=3):
    """Stall of a dumped forward (capture only: each pass is flushed outside the timed region)
    against the pinned D2H copy of the same stored tensors, timed alone."""
    from bench_write import load_pass

    plain = [timed_forward(model, ids, device) for _ in range(5)]
    handle = dumper.install(
        model, dumper.DumperConfig(enable=True, dir=work, exp_name="on", cleanup_previous=True, queue_bytes=64 << 30)
    )
    first = timed_forward(model, ids, device)  # pins host memory for the first time
    handle.flush()
    dumped = []
    for _ in range(passes):
        dumped.append(timed_forward(model, ids, device))
        handle.flush()
    plain += [timed_forward(model, ids, device) for _ in range(0)]
    writer = handle._writer
    write_tp = writer.bytes_written / writer.write_seconds if writer.write_seconds else None
    peak = writer.peak_pending_bytes
    handle.remove()
    plain += [timed_forward(model, ids, device) for _ in range(5)]
    files = files_under(os.path.join(work, "on"))
    meta, tensors = load_pass(files[-1])
    sizes = captured_bytes(meta)
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    # The same copies alone: device tensors of the stored shapes into pinned host buffers.
    dev = [t.to(device) for t in tensors.values()]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in dev]
    d2h = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for h, d in zip(host, dev):
            h.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - start)
    t_plain, t_dump, t_d2h = median(plain), median(dumped), median(d2h)
    stall = t_dump - t_plain
    print(
        f"# forward {t_plain * 1e3:.1f} ms, dumped forward {t_dump * 1e3:.1f} ms (first, pinning: "
        f"{first * 1e3:.0f} ms), D2H of {fmt_bytes(stored)} alone {t_d2h * 1e3:.1f} ms "
        f"({fmt_bytes(stored / t_d2h)}/s)",
        flush=True,
    )
    result(
        "on: forward stall / pinned D2H copy time of the same bytes (GPU)",
        stall / t_d2h,
        "close to 1 (<= 1.25)",
        stall / t_d2h <= 1.25,
        "x",
        f"stall {stall * 1e3:.1f} ms (forward {t_plain * 1e3:.1f} -> {t_dump * 1e3:.1f} ms), D2H "
        f"{t_d2h * 1e3:.1f} ms for {fmt_bytes(stored)} ({fmt_bytes(stored / t_d2h)}/s); first pass "
        f"{first * 1e3:.0f} ms (pinned memory allocated)",
    )
    result(
        "on: dumped forward / no hooks (GPU, capture only)",
        t_dump / t_plain,
        "info",
        None,
        "x",
        f"{t_dump * 1e3:.1f} ms vs {t_plain * 1e3:.1f} ms",
    )
    result(
        "bytes written / bytes captured by the hooks (GPU pass)",
        stored / sizes["captured"],
        "< 1 (aliases stored once)",
        stored < sizes["captured"],
        "x",
        f"{fmt_bytes(sizes['captured'])} captured, {fmt_bytes(stored)} stored per pass",
    )
    # Disk: raw save_file + fsync of the same tensors vs the writer thread.
    from bench_write import raw_save

    raw_dir = os.path.join(work, "raw")
    t_raw = raw_save([(meta, tensors)] * 2, raw_dir)
    shutil.rmtree(raw_dir, ignore_errors=True)
    raw_tp = 2 * stored / t_raw
    if write_tp:
        result(
            "on: writer-thread throughput / raw save_file+fsync (GPU machine disk)",
            write_tp / raw_tp,
            ">= 0.80",
            write_tp / raw_tp >= 0.80,
            "x",
            f"writer {fmt_bytes(write_tp)}/s vs raw {fmt_bytes(raw_tp)}/s; peak host bytes held {fmt_bytes(peak)}",
        )
    del dev, host, tensors
    shutil.rmtree(os.path.join(work, "on"), ignore_errors=True)
    return stored


def bench_disk_bound(model, ids, device, work, stored, passes=3):
    """Steady state with the default 2 GB queue: forwards wait for the disk (back-pressure)."""
    plain = sum(timed_forward(model, ids, device) for _ in range(passes))
    handle = dumper.install(model, dumper.DumperConfig(enable=True, dir=work, exp_name="steady", cleanup_previous=True))
    start = time.perf_counter()
    for _ in range(passes):
        timed_forward(model, ids, device)
    handle.flush()
    total = time.perf_counter() - start
    writer = handle._writer
    written, peak, queue = writer.bytes_written, writer.peak_pending_bytes, writer.queue_bytes
    handle.remove()
    from bench_write import load_pass, raw_save

    files = files_under(os.path.join(work, "steady"))
    loaded = [load_pass(f) for f in files]
    t_raw = raw_save(loaded, os.path.join(work, "raw"))
    shutil.rmtree(os.path.join(work, "raw"), ignore_errors=True)
    del loaded
    ratio = t_raw / max(total - plain, 1e-9)
    result(
        "on: dump throughput (time added to forwards) / raw save_file+fsync (GPU)",
        ratio,
        ">= 0.80",
        ratio >= 0.80,
        "x",
        f"{passes} passes, {fmt_bytes(written)}: forwards {plain:.2f}s, with "
        f"dumping {total:.2f}s, raw {t_raw:.2f}s; peak host bytes {fmt_bytes(peak)} "
        f"(queue {fmt_bytes(queue)}, pass {fmt_bytes(stored)})",
    )
    result(
        "writer memory: peak bytes held / max(queue, one pass) (GPU)",
        peak / max(queue, stored),
        "<= 1.0",
        peak <= max(queue, stored) * 1.001,
        "x",
        "",
    )
    shutil.rmtree(os.path.join(work, "steady"), ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir())
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model: a smoke test of this script")
    ap.add_argument(
        "--model",
        choices=("1b", "8b"),
        default="1b",
        help="1b: the 1.07B Llama (hidden 2048, 20 layers); 8b: Llama-3-8B's shape (hidden 4096, 32 layers)",
    )
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (dumps) at the end")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: off,on,steady,rows,analyze,tests")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    device = args.device
    work = args.work or tempfile.mkdtemp(prefix="dumpdiff-gpu-")
    os.makedirs(work, exist_ok=True)
    if device.startswith("cuda"):
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} cuda {torch.version.cuda}", flush=True)
    dtype = torch.bfloat16
    if args.small:
        shape = dict(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
            vocab_size=1024,
        )
        tokens, new_tokens = 128, 4
    else:
        shape = dict(GPU_LLAMA if args.model == "1b" else GPU_LLAMA_8B)
        tokens, new_tokens = 2048, 16
    model = llama(dtype, device, **{"max_position_embeddings": 4096, **shape})
    print(f"# model: random Llama {n_params(model) / 1e9:.2f}B params, {dtype}, {tokens}-token prefill", flush=True)
    if not args.small:
        result(
            "GPU model size (parameters)",
            n_params(model) / 1e9,
            ">= 1",
            n_params(model) >= 1e9,
            "B",
            f"random HF Llama, {dtype}, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}",
        )
    ids = torch.randint(3, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(3):
        timed_forward(model, ids, device)

    def guarded(name, fn):
        if name in skip:
            return None
        section(name)
        start = time.perf_counter()
        try:
            return fn()
        except Exception:  # noqa: BLE001 - one section failing must not lose the others
            traceback.print_exc()
            result(f"{name}: section failed", 0, "runs", False, "", traceback.format_exc()[-300:])
        finally:
            print(f"# section {name}: {time.perf_counter() - start:.1f}s", flush=True)
            with open(os.path.join(args.out, "gpu-results.json"), "w") as handle:
                json.dump(RESULTS, handle, indent=1)

    def tests():
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
        result(
            "tests/test_gpu.py on the GPU",
            proc.returncode,
            "exit 0",
            proc.returncode == 0,
            "",
            proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:],
        )

    guarded("tests", tests)

    def off():
        import bench_off

        base, installed = [], []  # forward times per round
        for r in range(20):
            for state in ("base", "off") if r % 2 == 0 else ("off", "base"):
                if state == "base":
                    base.append(bench_off.forward_times(model, ids, 10, device))
                else:
                    handle = dumper.install(model, dumper.DumperConfig(enable=False, dir=work, exp_name="off"))
                    installed.append(bench_off.forward_times(model, ids, 10, device))
                    handle.remove()
        ratio = bench_off.paired_ratio(installed, base)
        result(
            "off: installed, disabled / no hooks (GPU)",
            ratio,
            "<= 1.01",
            ratio <= 1.01,
            "x",
            f"median of 20 per-round ratios; median forward {median(sum(base, [])) * 1e3:.2f} ms vs "
            f"{median(sum(installed, [])) * 1e3:.2f} ms, 200 forwards each",
        )

    guarded("off", off)
    if not device.startswith("cuda"):
        skip |= {"on", "steady"}  # pinned memory and CUDA events need a GPU
    stored = guarded("on", lambda: bench_on(model, ids, device, work)) or 0
    if stored:
        guarded("steady", lambda: bench_disk_bound(model, ids, device, work, stored))

    pair = {}

    def rows():
        import bench_rows

        sizes, verdicts = bench_rows.measure(model, ids, new_tokens, os.path.join(work, "rows"), device, where="GPU")
        pair["full"] = (os.path.join(work, "rows", "full", "ref"), os.path.join(work, "rows", "full", "dec"))
        shutil.rmtree(os.path.join(work, "rows", "last"), ignore_errors=True)

    guarded("rows", rows)
    model = None  # frees its GPU memory before the next section
    torch.cuda.empty_cache() if device.startswith("cuda") else None

    def analyze():
        import bench_analyze

        ref, dec = pair["full"]
        ns = argparse.Namespace(warm_only=False)
        bench_analyze.run(ns, ref, dec)
        proc = subprocess.run(
            [sys.executable, "-m", "dumpdiff.analyzer.cli", "first-divergence", ref, dec, "--no-progress"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
        with open(os.path.join(args.out, "first-divergence-gpu.txt"), "w") as handle:
            handle.write(
                f"$ dumpdiff first-divergence ref dec   (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}"
            )

    if "full" in pair:
        guarded("analyze", analyze)

    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(args.out, "gpu-results.json"), "w") as handle:
        json.dump(RESULTS, handle, indent=1)
    print("\n=== summary ===")
    for row in RESULTS:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[row["pass"]]
        value = f"{row['value']:.4g}" if isinstance(row["value"], float) else str(row["value"])
        print(f"{verdict:4}  {value:>10} {row['unit']:2} target {row['target']:<28} {row['name']}")


if __name__ == "__main__":
    main()
