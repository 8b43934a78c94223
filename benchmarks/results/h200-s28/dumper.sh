# Run from the repository root with $OUT set. Stop 28 on the H200, the last commit: the GPU tests (the analyzer on
# bf16 GPU dumps of 7 architectures), off cost, dump throughput and forward stall at the 1.07B shape.
bash benchmarks/results/h200-run-1b-s16/compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
python3 benchmarks/bench_gpu.py --model 1b --skip rows,analyze --out $OUT > $OUT/bench-gpu-dumper.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-gpu-dumper.log | cut -c1-160
grep -E "passed|failed" $OUT/bench-gpu-dumper.log | tail -2
