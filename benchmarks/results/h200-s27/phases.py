import time, sys, os
T0 = time.perf_counter()
sys.path.insert(0, os.getcwd())
import analyzer.cli as cli
T1 = time.perf_counter()
from analyzer import diverge
times = {}
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: times[name] = times.get(name, 0) + time.perf_counter() - t
    setattr(mod, name, w)
for n in ("open_dump", "check_same_model", "load_indexes", "align", "prove", "row_table", "uncompared_calls", "strict_verdict", "rank_kind"):
    wrap(diverge, n)
sys.argv = ["dumpdiff", "first-divergence", "--strict-only", sys.argv[1], sys.argv[2]]
out = sys.stdout; sys.stdout = open(os.devnull, "w")
t = time.perf_counter()
try: cli.entry()
except SystemExit: pass
T2 = time.perf_counter()
sys.stdout = out
print(f"import cli {1000*(T1-T0):.0f} ms, command {1000*(T2-t):.0f} ms: " + ", ".join(f"{k} {1000*v:.0f}" for k, v in times.items()))
