import sys, time, statistics, os
sys.path.insert(0, os.getcwd())
from analyzer import compare
from analyzer.index import load_indexes
from analyzer.load import open_dump
from analyzer.align import align, prove
W = sys.argv[1]
a, b = load_indexes([open_dump(W + "/ref"), open_dump(W + "/dec")], progress=False)
ia, ib = a.rank(0), b.rank(0)
al = prove(align(ia, ib), ia, ib, "a", "b")
marks = {}
def wrap(name):
    f = getattr(compare, name)
    def w(*x, **k):
        s = time.perf_counter(); r = f(*x, **k); marks.setdefault(name, []).append((time.perf_counter() - s) * 1e3); return r
    setattr(compare, name, w)
for n in ["_calls_of_tensors", "_grids", "_columns", "merged_vocabulary", "_per_call", "calls_of_b", "calls_timeline", "_error_figures", "not_comparable", "nonfinite", "call_order"]:
    wrap(n)
for threads in (1, 2, 4, 8, 16):
    compare.JOIN_THREADS = threads
    marks.clear(); tot = []; sv = []
    for _ in range(7):
        s = time.perf_counter(); t = compare.row_table(al, ia, ib); tot.append((time.perf_counter() - s) * 1e3)
        s = time.perf_counter(); compare.strict_verdict(al, ia, ib, t); sv.append((time.perf_counter() - s) * 1e3)
    print(f"threads {threads}: row_table {statistics.median(tot):.1f} ms, strict_verdict {statistics.median(sv):.1f} ms;",
          ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in marks.items()))
