bash compile.sh > /dev/null 2>&1
W=/tmp/w-prof
if [ ! -f $W/dec/index/stamp.json ]; then python3 - <<'PY'
import sys, torch; sys.path.insert(0, "benchmarks")
import bench_analyze
bench_analyze.build_dumps("/tmp/w-prof", 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device="cuda")
PY
python3 -m analyzer.cli index $W/ref $W/dec --no-progress; fi
python3 -m compileall -q analyzer dumper; (cd old && python3 -m compileall -q analyzer dumper)
for i in 1 2 3 4; do for t in old new; do d=.; [ $t = old ] && d=old; echo -n "$t "; (cd $d && python3 phases.py $W/ref $W/dec cold); done; done 2>&1 | tee $OUT/ab-phases.txt
python3 - <<'PY' | tee $OUT/ab-cli.txt
import os, subprocess, sys, time, statistics
W = "/tmp/w-prof"
def evict(*folders):
    subprocess.run(["sync"])
    for folder in folders:
        for base, _, files in os.walk(folder):
            for n in files:
                fd = os.open(os.path.join(base, n), os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
res = {"old": [], "new": []}; outs = {}
for i in range(8):
    for t in (("old", "new") if i % 2 else ("new", "old")):
        evict(W + "/ref", W + "/dec")
        s = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "analyzer.cli", "first-divergence", W + "/ref", W + "/dec", "--strict-only", "--format", "json", "--no-progress"], cwd="old" if t == "old" else ".", capture_output=True, text=True)
        res[t].append(time.perf_counter() - s); outs.setdefault(t, p.stdout)
for t, v in res.items(): print(t, "median", round(statistics.median(v), 3), "min", round(min(v), 3), [round(x, 3) for x in v])
print("same output:", outs["old"] == outs["new"])
PY
