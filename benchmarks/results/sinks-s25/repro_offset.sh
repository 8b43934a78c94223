#!/bin/bash
# False culprit on a clean float32 run: a large query-dependent logit offset shared by all keys
# (softmax-invariant; q and k components computed through the GEMMs from a DC feature present in
# every token). Named: model.layers.2.self_attn#0 (carried line), while the inlined core's gap is 25x.
# Second run: the same without the massive activation (massive=0): is the massive channel needed?
cd /tmp/rt-sink
DC=20 OFFSET=1000 nice -n 10 /work/main/.venv/bin/python run_one.py llama float32 250 1000 6 none 0 --keep 2>/dev/null | tail -1
DC=20 OFFSET=1000 nice -n 10 /work/main/.venv/bin/python run_one.py llama float32 250 0 6 none 0 --keep 2>/dev/null | tail -1
DC=20 OFFSET=1000 nice -n 10 /work/main/.venv/bin/python run_one.py llama float32 250 0 6 none 1 --keep 2>/dev/null | tail -1
