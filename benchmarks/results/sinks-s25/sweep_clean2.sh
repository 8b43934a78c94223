#!/bin/bash
# the rest of the clean sweep (qwen2 after the first 29)
PY=/work/main/.venv/bin/python
for arch in qwen2; do for dtype in float32 bfloat16; do for lengths in 250 24 33,120,250; do
for ms in "100 6" "1000 8" "1000 12" "3000 16"; do
  if [ $dtype = float32 ] && [ $lengths = 250 ]; then continue; fi
  if [ $dtype = float32 ] && [ $lengths = 24 ] && [ "$ms" = "100 6" ]; then continue; fi
  nice -n 10 $PY run_one.py $arch $dtype $lengths $ms none 2>/dev/null | tail -1 >> results_clean.jsonl
done; done; done; done
