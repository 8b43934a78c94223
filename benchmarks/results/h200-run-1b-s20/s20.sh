# Run from a copy of the repository at commit 4183237 with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh).
# Stop 20 on the H200: bench_gpu.py's analysis section at the 1.07B shape with this stop's code
# (malloc tuning of stop 19 and no numpy.ma import on the verdict path: neither measured here before).
set -x
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
bash compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "^# |PASS|FAIL|info" $OUT/bench-1b.log | cut -c1-250 | tail -45
