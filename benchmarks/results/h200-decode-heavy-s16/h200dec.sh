# A decode-heavy pair on the GPU (1.07B shape, bf16, 512-token prompt, 256 new tokens): bench_analyze, then
# index build A/B, cold (dumps evicted): worker processes for decode steps (default) vs none (DUMPDIFF_INDEX_PROCESSES=0)
bash compile.sh 2>&1 | tee $OUT/python-start.txt
W=/tmp/w-dec
python3 benchmarks/bench_analyze.py --work $W --hidden 2048 --layers 20 --inter 5632 --tokens 512 --new-tokens 256 \
  --device cuda --dtype bfloat16 --keep > $OUT/bench-decode-heavy.log 2>&1
grep -E "^# |RESULT" $OUT/bench-decode-heavy.log | cut -c1-300 | tail -40
python3 - $W/ref $W/dec <<'PY' | tee $OUT/ab-index-processes.txt
import os, subprocess, sys, time, statistics
sys.path.insert(0, "benchmarks")
from common import evict
ref, dec = sys.argv[1:3]
times = {"0": [], "default": []}
for i in range(3):
    for v in (("0", "default") if i % 2 == 0 else ("default", "0")):
        evict(ref, dec)
        env = dict(os.environ)
        if v == "0":
            env["DUMPDIFF_INDEX_PROCESSES"] = "0"
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "analyzer.cli", "index", ref, dec, "--rebuild", "--no-progress"], env=env,
                           capture_output=True, text=True)
        times[v].append(time.perf_counter() - start)
        assert p.returncode == 0, p.stderr[-500:]
for v, t in times.items():
    print(f"index cold, processes={v}: median {statistics.median(t):.2f}s  all {[round(x, 2) for x in sorted(t)]}")
print(f"default/none: {statistics.median(times['default']) / statistics.median(times['0']):.3f}  (cpus {os.cpu_count()})")
PY
rm -rf $W
