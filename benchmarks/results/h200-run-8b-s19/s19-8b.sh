# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh).
# Stop 19 on the H200: bench_gpu.py's analysis section at Llama-3-8B's shape (25 GB pair), the final index code.
bash compile.sh > $OUT/python-start.txt 2>&1
cd new && python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 8b --skip tests,off,on,steady --out $OUT > $OUT/bench-8b.log 2>&1
grep -E "^# |PASS|FAIL|info" $OUT/bench-8b.log | cut -c1-250 | tail -40
