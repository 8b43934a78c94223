"""Stop 27 probe: the index build in-process (threads only, as bench_analyze's in-process row), with the GIL's
switch interval and the streamed block size varied. argv: REF DEC VARIANT [cold]"""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from analyzer import indexbuild
from analyzer.index import load_indexes
from analyzer.load import open_dump
from common import evict
ref, dec, variant = sys.argv[1:4]
if "swi" in variant:
    sys.setswitchinterval(0.0005)
if "block8" in variant:
    indexbuild.ROW_BLOCK_BYTES = 8 << 20
if len(sys.argv) > 4:
    evict(ref, dec)
t = time.perf_counter()
load_indexes([open_dump(ref), open_dump(dec)], rebuild=True, progress=False)
print(f"{variant} {'cold' if len(sys.argv) > 4 else 'warm'} {time.perf_counter() - t:.2f}")
