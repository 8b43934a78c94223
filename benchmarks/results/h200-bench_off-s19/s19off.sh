# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh).
# Stop 19 on the H200: the off-cost benchmark (point 1) with this stop's code, twice, then the GPU tests.
bash compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
for i in 1 2; do python3 benchmarks/bench_off.py --device cuda --variants --rounds 20 > $OUT/h200-bench_off-s19-run$i.log 2>&1; done
python3 -m pytest -q tests/test_gpu.py > $OUT/h200-test_gpu-s19.log 2>&1
grep -h -E "^# |RESULT" $OUT/h200-bench_off-s19-run*.log | cut -c1-260; tail -3 $OUT/h200-test_gpu-s19.log
