#!/bin/bash
# planted decode-only bugs at massive 1000 / sink 8
PY=/work/main/.venv/bin/python
OUT=${OUT:-results_plants.jsonl}
for cfg in "llama float32 250" "llama bfloat16 250" "llama float32 33,120,250" "qwen2 float32 250"; do
set -- $cfg
for plant in attn:2:1.01 attn:2:1.1 stale:2:240:239 stale:2:0:1 mlp:3:1.01 mlp:1:1.1; do
  nice -n 10 $PY run_one.py $1 $2 $3 ${MS:-1000 8} $plant 2>/dev/null | tail -1 >> $OUT
done; done
