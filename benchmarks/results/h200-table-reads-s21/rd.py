# Run beside pq/{ref,dec}/rows.parquet (the CPU benchmark pair's saved rows tables):
#   python3 rd.py MODE GROUPS   (old 0 | bytes N | mmap N): ms to decode the 9 verdict columns of both.
import sys, time, os, mmap, concurrent.futures as cf
t0 = time.perf_counter()
import pyarrow as pa, pyarrow.parquet as pq
cols = ["pass", "row", "tensor", "rowshape", "fp", "nonfinite", "srow", "rank", "offset"]
mode, groups = sys.argv[1], int(sys.argv[2])
t1 = time.perf_counter()
paths = [f"pq/{s}/rows.parquet" for s in ("ref", "dec")]
def opened(path):
    with open(path, "rb") as h:
        if mode == "bytes":
            data = pa.py_buffer(h.read())
        elif mode == "mmap":
            data = pa.py_buffer(mmap.mmap(h.fileno(), 0, access=mmap.ACCESS_READ))
        else:
            return h, None
    return data, pq.ParquetFile(pa.BufferReader(data)).metadata
if mode == "old":
    hs = [open(p, "rb") for p in paths]; fs = [pq.ParquetFile(h) for h in hs]
    pool = cf.ThreadPoolExecutor(2)
    futs = [pool.submit(f.read, cols, True) for f in fs]
    out = [f.result() for f in futs]
else:
    files = [opened(p) for p in paths]
    k = min(groups, len(cols))
    pool = cf.ThreadPoolExecutor(2 * k)
    futs = [pool.submit(lambda d, m, g: pq.ParquetFile(pa.BufferReader(d), metadata=m).read(columns=g, use_threads=False), d, m, cols[i::k])
            for d, m in files for i in range(k)]
    out = [f.result() for f in futs]
t2 = time.perf_counter()
print(f"{mode}/{groups} {1e3*(t2-t1):.1f}")
