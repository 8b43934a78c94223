"""In-process phases of --strict-only (seconds / minor page faults), after the imports."""
import resource, sys, time
def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
f0, t0 = flt(), time.perf_counter()
from analyzer import compare, align as al, index as ix, load, memtune
t1, f1 = time.perf_counter(), flt()
memtune.allow()
a, b = load.open_dump(sys.argv[1]), load.open_dump(sys.argv[2])
ia, ib = ix.load_indexes([a, b], progress=False, prefetch=("rows", compare.VERDICT_ROW_COLUMNS))
memtune.keep_freed_memory()
ra, rb = ia.rank(0), ib.rank(0)
for side in (ra, rb):
    for k in compare.VERDICT_ROW_COLUMNS:
        side.cols("rows")[k]
t2, f2 = time.perf_counter(), flt()
P = al.prove(al.align(ra, rb), ra, rb, "a", "b")
t3, f3 = time.perf_counter(), flt()
tab = compare.row_table(P, ra, rb)
t4, f4 = time.perf_counter(), flt()
v = compare.strict_verdict(P, ra, rb, tab)
t5, f5 = time.perf_counter(), flt()
print(f"imports {t1-t0:.3f}/{f1-f0} load {t2-t1:.3f}/{f2-f1} align+prove {t3-t2:.3f}/{f3-f2} "
      f"row_table {t4-t3:.3f}/{f4-f3} strict {t5-t4:.3f}/{f5-f4} total {t5-t0:.3f}; rows {len(tab['pair'])}")
