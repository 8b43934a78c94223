#!/bin/bash
# The noise corpus on a CUDA machine in parallel slices (one process per architecture, dtype and
# kind of run: 14 at once on an H100's 16 cores), merged into $1/results.jsonl, tables printed:
#   benchmarks/run_corpus_gpu.sh OUT [clean|planted|all]
# A slice's results.jsonl is written run by run, so a slice cut short still counts what it ran.
set -u
out=${1:-corpus-gpu}
what=${2:-all}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/device.txt"
only=(); [ "$what" != all ] && only=(--only "$what")
# the trained model's runs first and alone: they train it once into $out/models
python3 benchmarks/noise_corpus.py --device cuda "${only[@]}" --match trained \
  --out "$out/slice-trained" --models "$out/models" >"$out/slice-trained.tables" 2>"$out/slice-trained.log"
slices=()
for arch in llama. qwen3. qwen3_moe. gemma2. mamba. jamba.; do
  [ "$what" != planted ] && slices+=("clean $arch float32,bfloat16")
  case $arch in mamba. | jamba.) continue ;; esac  # no KV cache to plant in
  [ "$what" != clean ] && slices+=("planted $arch float32" "planted $arch bfloat16")
done
for i in "${!slices[@]}"; do
  read -r only match dtypes <<<"${slices[$i]}"
  python3 benchmarks/noise_corpus.py --device cuda --only "$only" --match "$match" --dtypes "$dtypes" \
    --out "$out/slice$i" --models "$out/models" >"$out/slice$i.tables" 2>"$out/slice$i.log" &
done
wait
cat "$out"/slice*/results.jsonl 2>/dev/null >"$out/results.jsonl"
python3 benchmarks/noise_corpus.py --from "$out/results.jsonl"
