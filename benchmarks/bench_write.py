"""Dumping is disk-bound, with bounded memory, and stores no tensor twice.

Same run, same disk, same tensors:

* raw      the tensors of every dumped pass, loaded back into memory, written again with plain
           ``safetensors.torch.save_file`` + ``fsync`` (the dumper fsyncs every pass file: its
           crash-safety promise), one file per pass. Also reported without fsync, as information.
* dump     N forward passes with dumping enabled, until every pass is on disk (``flush``),
           minus the same N forwards without hooks: the time dumping adds.

    dump throughput / raw throughput = t_raw / (t_dump - t_forwards)     target >= 0.80

Also: the writer thread's own throughput (bytes / time inside its write step), the memory it
held (peak bytes queued, against DUMPER_QUEUE_BYTES, with a queue smaller than a pass to force
back-pressure), and bytes captured vs bytes written (aliases: a module's output that is the
next module's input is stored once; stored tensors with identical bytes are counted).

    python benchmarks/bench_write.py [--tokens 512] [--passes 4] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time

import torch
from common import (  # first: puts the repository on sys.path
    captured_bytes,
    dir_bytes,
    files_under,
    fmt_bytes,
    fsync_path,
    llama,
    median,
    result,
)
from safetensors import safe_open
from safetensors.torch import save_file

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt


def load_pass(path):
    with safe_open(path, "pt") as handle:
        meta = json.loads(handle.metadata()[fmt.PASS_META_KEY])
        return meta, {k: handle.get_tensor(k) for k in handle.keys()}


def run_forwards(model, inputs):
    with torch.no_grad():
        for ids in inputs:
            model(ids)


def dump_forwards(model, inputs, root, name, **config):
    handle = dumper.install(
        model, dumper.DumperConfig(enable=True, dir=root, exp_name=name, cleanup_previous=True, **config)
    )
    start = time.perf_counter()
    run_forwards(model, inputs)
    handle.flush()
    elapsed = time.perf_counter() - start
    writer = handle._writer
    stats = {
        "seconds": elapsed,
        "bytes": writer.bytes_written,
        "write_seconds": getattr(writer, "write_seconds", None),
        "peak_pending": getattr(writer, "peak_pending_bytes", None),
        "queue_bytes": writer.queue_bytes,
    }
    handle.remove()
    return stats


def raw_save(passes, out_dir, fsync=True) -> float:
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    for i, (meta, tensors) in enumerate(passes):
        path = os.path.join(out_dir, f"raw-{i}.safetensors")
        save_file(tensors, path, metadata={fmt.PASS_META_KEY: json.dumps(meta, separators=(",", ":"))})
        if fsync:
            fsync_path(path)
    return time.perf_counter() - start


def duplicate_bytes(tensors) -> int:
    """Bytes of stored tensors whose dtype, shape and bytes equal another stored tensor's."""
    seen, dup = set(), 0
    for t in tensors.values():
        key = (
            str(t.dtype),
            tuple(t.shape),
            hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).digest(),
        )
        if key in seen:
            dup += t.numel() * t.element_size()
        seen.add(key)
    return dup


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    # Few FLOPs per byte dumped (narrow, many token rows), so that the disk, not the GEMMs, is
    # what dumping is measured against.
    model = llama(
        torch.float32,
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=344,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, 1024, (args.batch, args.tokens), generator=gen) for _ in range(args.passes)]
    root = tempfile.mkdtemp(prefix="dumpdiff-bench-write-", dir=args.dir)
    try:
        run_forwards(model, inputs[:1])  # warm-up
        t_fwd, t_dump, t_raw, t_raw_nosync, writer_tp, dumped = [], [], [], [], [], None
        for r in range(args.rounds):
            start = time.perf_counter()
            run_forwards(model, inputs)
            t_fwd.append(time.perf_counter() - start)
            dumped = dump_forwards(model, inputs, root, "dump")
            t_dump.append(dumped["seconds"])
            if dumped["write_seconds"]:
                writer_tp.append(dumped["bytes"] / dumped["write_seconds"])
            passes = [load_pass(p) for p in files_under(os.path.join(root, "dump"))]
            t_raw.append(raw_save(passes, os.path.join(root, "raw")))
            shutil.rmtree(os.path.join(root, "raw"))
            t_raw_nosync.append(raw_save(passes, os.path.join(root, "raw"), fsync=False))
            shutil.rmtree(os.path.join(root, "raw"))
            print(
                f"# round {r}: forwards {t_fwd[-1]:.2f}s, dump {t_dump[-1]:.2f}s, raw save+fsync {t_raw[-1]:.2f}s, "
                f"raw save (no fsync) {t_raw_nosync[-1]:.2f}s",
                flush=True,
            )
        written = dir_bytes(os.path.join(root, "dump"))
        # Per round (its three timings taken back to back), then the median over rounds: the
        # machine's load drifts between rounds.
        ratios = sorted(r / max(d - f, 1e-9) for r, d, f in zip(t_raw, t_dump, t_fwd))
        writer_ratios = sorted(w / (written / r) for w, r in zip(writer_tp, t_raw))
        added = median(t_dump) - median(t_fwd)
        raw_tp = written / median(t_raw)
        dump_tp = written / max(added, 1e-9)
        print(
            f"# {args.passes} passes of {args.batch}x{args.tokens} tokens, {fmt_bytes(written)} written; forwards alone "
            f"{median(t_fwd):.2f}s, with dumping {median(t_dump):.2f}s",
            flush=True,
        )
        result(
            "on: dump throughput / raw save_file+fsync throughput (CPU)",
            median(ratios),
            ">= 0.80",
            median(ratios) >= 0.80,
            "x",
            f"median of {len(ratios)} rounds (each: raw time / time dumping added to "
            f"the forwards), rounds {', '.join(f'{r:.2f}' for r in ratios)}; medians: dump {fmt_bytes(dump_tp)}/s vs "
            f"raw {fmt_bytes(raw_tp)}/s; {fmt_bytes(written)} in {args.passes} pass files",
        )
        if writer_ratios:
            result(
                "on: writer-thread throughput / raw save_file+fsync (CPU)",
                median(writer_ratios),
                ">= 0.80",
                median(writer_ratios) >= 0.80,
                "x",
                f"{fmt_bytes(median(writer_tp))}/s inside the writer; rounds "
                f"{', '.join(f'{r:.2f}' for r in writer_ratios)}",
            )
        nosync_tp = written / median(t_raw_nosync)
        result(
            "info: dump throughput / raw save_file without fsync (page cache)",
            dump_tp / nosync_tp,
            "info",
            None,
            "x",
            f"raw without fsync {fmt_bytes(nosync_tp)}/s: the page cache, not the disk",
        )

        # Bytes: captured by the hooks vs written; identical stored tensors.
        captured = stored = dup = 0
        for path in files_under(os.path.join(root, "dump")):
            meta, tensors = load_pass(path)
            sizes = captured_bytes(meta)
            captured += sizes["captured"]
            stored += sum(t.numel() * t.element_size() for t in tensors.values())
            dup += duplicate_bytes(tensors)
        result(
            "bytes written / bytes captured by the hooks",
            written / captured,
            "< 1 (aliases stored once)",
            written < captured,
            "x",
            f"{fmt_bytes(captured)} captured, {fmt_bytes(stored)} tensor bytes stored, {fmt_bytes(written)} on disk",
        )
        result(
            "stored tensors whose bytes duplicate another stored tensor",
            dup,
            "0 B",
            dup == 0,
            "B",
            "same dtype, shape and bytes within one pass",
        )

        # Back-pressure: a queue smaller than one pass; the writer never holds more than
        # max(queue, one pass) and the forwards wait for the disk.
        pass_bytes = stored // args.passes
        queue = max(pass_bytes // 4, 1 << 20)
        bp = dump_forwards(model, inputs, root, "bp", queue_bytes=queue)
        bound = max(queue, pass_bytes)
        if bp["peak_pending"] is not None:
            result(
                "writer memory: peak bytes held / max(DUMPER_QUEUE_BYTES, one pass)",
                bp["peak_pending"] / bound,
                "<= 1.0",
                bp["peak_pending"] <= bound,
                "x",
                f"queue {fmt_bytes(queue)}, pass {fmt_bytes(pass_bytes)}, peak held {fmt_bytes(bp['peak_pending'])}; "
                f"{bp['seconds']:.2f}s with back-pressure vs {median(t_dump):.2f}s with a 2 GB queue",
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
