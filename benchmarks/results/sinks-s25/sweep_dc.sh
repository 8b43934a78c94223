#!/bin/bash
# the query's sink direction and a shared logit offset computed through the GEMMs (DC feature, 20x)
PY=/work/main/.venv/bin/python
for cfg in "float32 6 0" "float32 6 30" "float32 6 300" "float32 6 1000" "bfloat16 6 30" "bfloat16 6 1000"; do
  set -- $cfg
  DC=20 OFFSET=$3 nice -n 10 $PY run_one.py llama $1 250 1000 $2 none 0 --keep 2>/dev/null | tail -1 >> results_dc.jsonl
done
