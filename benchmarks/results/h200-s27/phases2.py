"""Main-thread time of the strict verdict's steps, in-process (warm): wrap module functions with timers."""
import time, sys, os, collections
sys.path.insert(0, os.getcwd())
T0 = time.perf_counter()
import analyzer.cli as cli
T1 = time.perf_counter()
import numpy, pyarrow, pyarrow.parquet
T2 = time.perf_counter()
from analyzer import diverge, compare, align, index, columns, keyjoin
try:
    from analyzer import callcells
except ImportError:
    callcells = None
T3 = time.perf_counter()
times = collections.Counter(); calls = collections.Counter()
def wrap(mod, name):
    f = getattr(mod, name, None)
    if f is None:  # a step another version of the code does not have
        return
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: times[f"{mod.__name__.split('.')[-1]}.{name}"] += time.perf_counter() - t; calls[f"{mod.__name__.split('.')[-1]}.{name}"] += 1
    setattr(mod, name, w)
for n in ("load_indexes", "align", "prove", "plan_join", "row_table", "uncompared_calls", "strict_verdict"): wrap(diverge, n)
if callcells:
    for n in ("call_cells", "posts_of_b"): wrap(compare, n)
for n in ("_grids", "_placed_grids", "_pair_grids", "_columns", "merged_vocabulary", "recode", "_calls_of_tensors", "_per_call", "calls_of_b", "call_order",
          "calls_timeline", "_first_per_pair", "_call_info", "_error_figures", "nonfinite", "_own_code_note", "distinct"): wrap(compare, n)
for n in ("row_keys", "_ambiguous_keys", "_tensor_fps", "embedding_call"): wrap(align, n)
for n in ("_read_fresh", "_stamp", "_locked_folders"): wrap(index, n)
if os.environ.get("SWI"):
    sys.setswitchinterval(float(os.environ["SWI"]))
threads = os.environ.get("JT")
if threads: compare.JOIN_THREADS = int(threads)
sys.argv = ["dumpdiff", "first-divergence", "--strict-only", sys.argv[1], sys.argv[2]]
out = sys.stdout; sys.stdout = open(os.devnull, "w")
t = time.perf_counter()
try: cli.entry()
except SystemExit: pass
T4 = time.perf_counter(); sys.stdout = out
print(f"JT={threads} SWI={os.environ.get('SWI')} cli {1000*(T1-T0):.0f} np+pa {1000*(T2-T1):.0f} ours {1000*(T3-T2):.0f} command {1000*(T4-t):.0f} | " +
      " ".join(f"{k}={1000*v:.1f}" for k, v in times.items()))
