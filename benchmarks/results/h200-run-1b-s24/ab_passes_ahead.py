"""A/B on one host: the index build with and without the start-up read-ahead (passes_ahead),
trees alternating, dumps evicted from the page cache before each run. Usage:
  python3 ab_passes_ahead.py NEW_TREE OLD_TREE REF DEC ROUNDS"""
import os, shutil, statistics, subprocess, sys, time
new, old, ref, dec, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sys.path.insert(0, os.path.join(new, "benchmarks"))
from common import evict
trees = {"with read-ahead": new, "without": old}
for label, cmd in (("index --rebuild", ["index", ref, dec, "--rebuild", "--no-progress"]),
                   ("first-divergence --strict-only, no saved index", ["first-divergence", ref, dec, "--strict-only", "--no-progress"])):
    times = {k: [] for k in trees}
    for i in range(rounds):
        for k in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            if "no saved index" in label:
                for d in (ref, dec):
                    shutil.rmtree(os.path.join(d, "index"), ignore_errors=True)
            evict(ref, dec)
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "analyzer.cli", *cmd], cwd=trees[k], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=trees[k]))
            times[k].append(time.perf_counter() - t)
            assert p.returncode in (0, 1), p.stderr[-2000:]
    for k, v in times.items():
        print(f"{label}: {k}: median {statistics.median(v):.3f} s  runs " + " ".join(f"{x:.2f}" for x in v), flush=True)
