"""Stop 27 probe: first_divergence --strict-only in-process, after pre-faulting the C heap in a thread while
numpy/pyarrow import (pre: main arena only; pre1: with M_ARENA_MAX=1) or not (base)."""
import time, sys, os, resource, ctypes, threading
T0 = time.perf_counter()
MODE = sys.argv.pop(1)
libc = ctypes.CDLL(None)
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]; libc.memset.restype = ctypes.c_void_p
for p, v in ((-3, 32 << 20), (-1, 1 << 30), (-2, 64 << 20)): libc.mallopt(p, v)
if MODE in ("pre", "pre1"):
    if MODE == "pre1": libc.mallopt(-8, 1)  # M_ARENA_MAX
    chunks = [libc.malloc(16 << 20) for _ in range(int(os.environ.get("MB", 128)) // 16)]
    def touch():
        for c in chunks: libc.memset(c, 0, 16 << 20)
    th = threading.Thread(target=touch); th.start()
sys.path.insert(0, os.environ.get("ROOT", os.getcwd()))
import numpy, pyarrow, pyarrow.parquet, click
from analyzer import diverge
T1 = time.perf_counter()
if MODE in ("pre", "pre1"):
    th.join()
    for c in chunks: libc.free(c)
T2 = time.perf_counter()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter()
diverge.first_divergence(sys.argv[1], sys.argv[2], progress=False, noise_aware=False)
print(f"{1000*(time.perf_counter()-t):.0f} {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0} imports {1000*(T1-T0):.0f} join {1000*(T2-T1):.0f}")
