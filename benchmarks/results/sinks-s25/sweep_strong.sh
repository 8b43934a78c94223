#!/bin/bash
# stronger sink logits, and a shared logit offset (softmax-invariant)
PY=/work/main/.venv/bin/python
for dtype in float32 bfloat16; do
for s in 24 40; do nice -n 10 $PY run_one.py llama $dtype 250 1000 $s none 2>/dev/null | tail -1 >> results_strong.jsonl; done
for o in 30 100; do OFFSET=$o nice -n 10 $PY run_one.py llama $dtype 250 1000 8 none 2>/dev/null | tail -1 >> results_strong.jsonl; done
done
