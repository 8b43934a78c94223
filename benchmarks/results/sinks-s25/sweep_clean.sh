#!/bin/bash
# clean runs: arch x dtype x lengths x (massive, sink)
PY=/work/main/.venv/bin/python
for arch in llama qwen2; do for dtype in float32 bfloat16; do for lengths in 250 24 33,120,250; do
for ms in "100 6" "1000 8" "1000 12" "3000 16"; do
  nice -n 10 $PY run_one.py $arch $dtype $lengths $ms none 2>/dev/null | tail -1 >> results_clean.jsonl
done; done; done; done
