"""Index build memory with worker processes on the H200: the command's process and each worker's own peak
(benchmarks/_measure.py samples VmHWM), cold and warm, on the 1.07B pair and the 8B-shape pair."""
import json, os, subprocess, sys, time
sys.path.insert(0, "benchmarks")
import torch
import bench_analyze as b
from common import GPU_LLAMA_8B, evict, dump_pair, llama
which = sys.argv[1]
W = f"/tmp/w-{which}"
if which == "1b":
    b.build_dumps(W, 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device="cuda")
else:
    model = llama(torch.bfloat16, "cuda", **GPU_LLAMA_8B)
    prompt = torch.randint(3, 32000, (1, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    dump_pair(model, W, prompt, 16, "cuda")
    del model; torch.cuda.empty_cache()
ref, dec = W + "/ref", W + "/dec"
for proto in ("cold", "warm"):
    if proto == "cold":
        evict(ref, dec)
    out = f"/tmp/m-{which}-{proto}.json"
    s = time.perf_counter()
    subprocess.run([sys.executable, "benchmarks/_measure.py", out, "analyzer.cli", "index", ref, dec, "--rebuild"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rec = json.load(open(out))
    print(f"{which} {proto}: {rec['seconds']:.2f} s, command {rec['max_rss_mb']:.0f} MB, workers: largest "
          f"{rec['worker_max_rss_mb']:.0f} MB, all {rec['workers_rss_mb']:.0f} MB, read {rec['read_bytes'] / 1e9:.1f} GB",
          flush=True)
subprocess.run(["rm", "-rf", W])
