#!/bin/bash
# The CUDA graph checks and figures on a CUDA machine, results under $1 (default ./graphs-gpu):
# tests/test_gpu_graphs.py (replays dumped as eager steps, padding trimmed, a stale static buffer
# named, the budget error), then bench_graphs.py (MODEL: 1b by default, 8b or tiny).
set -u
out=${1:-graphs-gpu}
model=${2:-1b}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# (dumpdiff installed: pip install -e .)
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())' \
  | tee "$out/device.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py 2>&1 | tail -60 | tee "$out/tests.txt"
timeout 300 python3 benchmarks/bench_graphs.py --model "$model" --out "$out" 2>&1 | grep -v Warning | tail -40 \
  | tee "$out/bench.txt"
