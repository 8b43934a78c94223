#!/bin/bash
# The fingerprint checks and figures on a CUDA machine, results under $1 (default ./fingerprint-gpu):
# the CPU==CUDA tests, then bench_fingerprint.py at Llama-3-8B's shape (bf16, batch 8, 32 decode
# steps), then mode all with and without carried prints and the index builds at a short prompt.
set -u
out=${1:-fingerprint-gpu}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# (dumpdiff installed: pip install -e .)
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_rowprint.py tests/test_rowkernel.py tests/test_rawcopy.py \
  tests/test_passplan.py tests/test_fingerprint_mode.py -k "cuda or rowprint or gpu or graph or raw or driver" \
  2>&1 | tail -15 | tee "$out/tests.txt"
python3 benchmarks/bench_fingerprint.py --device cuda --model 8b --batch 8 --prompt 128 --steps 32 --rounds 3 \
  --skip all,index --prefill 2000 --out "$out/decode-8b.json" 2>&1 | grep -v Warning | tee "$out/decode-8b.log"
python3 benchmarks/bench_fingerprint.py --device cuda --model 8b --batch 8 --prompt 16 --steps 8 --rounds 2 \
  --out "$out/all-8b.json" 2>&1 | grep -v Warning | tee "$out/all-8b.log"
