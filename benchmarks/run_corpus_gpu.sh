#!/bin/bash
# The noise corpus on a CUDA machine in parallel slices (one process per architecture, dtype and
# kind of run: 15 at once on an H100's 16 cores), merged into $1/results.jsonl, tables printed:
#   benchmarks/run_corpus_gpu.sh OUT [clean|planted|all] [SECONDS]
# Each slice writes its results.jsonl run by run and resumes from it, so a call cut short by
# SECONDS (default: no limit) goes on where it stopped when run again over the same OUT. At most
# 4 runs of size m at once: each one's dumps take several GB of the disk.
set -u
out=${1:-corpus-gpu}
what=${2:-all}
limit=${3:-0}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/device.txt"
# the trained model's runs are one slice: it trains the model once into $out/models. A slice's
# folder is named after what it runs, so a call for clean or planted runs resumes the folder an
# earlier call for all of them filled.
slices=("$what trained. float32,bfloat16 trained")
for arch in llama. qwen3. qwen3_moe. gemma2. mamba. jamba.; do
  [ "$what" != planted ] && slices+=("clean $arch float32,bfloat16 clean-${arch%.}")
  case $arch in mamba. | jamba.) continue ;; esac  # no KV cache to plant in
  [ "$what" != clean ] && slices+=("planted $arch float32 planted-${arch%.}-f32" "planted $arch bfloat16 planted-${arch%.}-bf16")
done
for slice in "${slices[@]}"; do
  read -r only match dtypes name <<<"$slice"
  only_arg=(); [ "$only" != all ] && only_arg=(--only "$only")
  timeout "$limit" python3 benchmarks/noise_corpus.py --device cuda "${only_arg[@]}" --match "$match" \
    --dtypes "$dtypes" --resume --out "$out/$name" --models "$out/models" --size-m-slots "$out/locks:4" \
    >"$out/$name.tables" 2>>"$out/$name.log" &
done
wait
cat "$out"/*/results.jsonl 2>/dev/null >"$out/results.jsonl"
python3 benchmarks/noise_corpus.py --from "$out/results.jsonl"
