"""Per-phase times of the strict verdict in one process (cold: dump folders evicted first)."""
import os, subprocess, sys, time
ref, dec, cold = sys.argv[1], sys.argv[2], sys.argv[3] == "cold"
def evict(*folders):
    subprocess.run(["sync"])
    for folder in folders:
        for base, _, files in os.walk(folder):
            for n in files:
                fd = os.open(os.path.join(base, n), os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
if cold:
    evict(ref, dec)
T = time.perf_counter()
marks = []
def mark(w): marks.append((w, round((time.perf_counter() - T) * 1e3)))
import numpy, pyarrow, click, pyarrow.parquet
mark("libs")
sys.path.insert(0, os.getcwd())
from analyzer import diverge, compare
mark("analyzer")
for mod, name in [(diverge, "load_indexes"), (diverge, "align"), (diverge, "prove"), (diverge, "row_table"), (diverge, "strict_verdict"), (compare, "_error_figures"), (compare, "_per_call")]:
    f = getattr(mod, name)
    def w(*a, __f=f, __n=name, **k):
        s = time.perf_counter(); r = __f(*a, **k); marks.append((__n + "(own)", round((time.perf_counter() - s) * 1e3))); mark(__n); return r
    setattr(mod, name, w)
r = diverge.first_divergence(ref, dec, progress=False, noise_aware=False)
mark("done")
from analyzer import report
print(("cold" if cold else "warm"), " ".join(f"{k}:{v}" for k, v in marks))
