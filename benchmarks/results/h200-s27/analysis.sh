# Run from the repository root with $OUT set. Stop 27 on the H200: rows (point 3) and analysis (point 4) at the 1.07B shape.
bash benchmarks/results/h200-run-1b-s16/compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --work /tmp/w --out $OUT > $OUT/bench-gpu-analysis.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-gpu-analysis.log | cut -c1-170
