"""How the index build scales with hashing threads and block size on this machine.

Hash-only (row_stats over tensors already in memory) and a whole in-process build of a dump,
for each (threads, block words) setting; prints the best setting as ``BEST threads block``.

    python benchmarks/bench_index_tuning.py DUMP [--settings 8:65536,16:262144]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import os, sys, time, torch
sys.path.insert(0, {root!r})
from analyzer.fingerprint import row_stats
from analyzer.index import build_tables
from analyzer.load import open_dump
x = torch.randn(4096, 8192, dtype=torch.bfloat16)  # 64 MiB
parts = [x[i:i + 2048] for i in range(0, 4096, 2048)]
row_stats(x)
start = time.perf_counter()
for _ in range(8):
    row_stats(x)
hash_bw = 8 * x.numel() * 2 / (time.perf_counter() - start)
dump = open_dump({dump!r})
build_tables(dump, progress=False)
total = sum(p.nbytes for r in dump.ranks.values() for p in r.passes)
start = time.perf_counter()
build_tables(dump, progress=False)
print(hash_bw, total / (time.perf_counter() - start))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--settings", default="1:65536,4:65536,8:65536,8:262144,16:65536,16:262144")
    args = ap.parse_args()
    best = None
    for setting in args.settings.split(","):
        threads, block = setting.split(":")
        env = {**os.environ, "DUMPDIFF_HASH_THREADS": threads, "DUMPDIFF_HASH_BLOCK_WORDS": block}
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, dump=args.dump)], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-800:])
            continue
        hash_bw, build_bw = map(float, out.stdout.split())
        print(f"threads {threads:>2} block {block:>7}: hash {hash_bw / 1e9:6.2f} GB/s, build (warm) "
              f"{build_bw / 1e9:6.2f} GB/s", flush=True)
        if best is None or build_bw > best[0]:
            best = (build_bw, threads, block)
    if best:
        print(f"BEST {best[1]} {best[2]}")


if __name__ == "__main__":
    main()
