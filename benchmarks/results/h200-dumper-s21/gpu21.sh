# Run from a copy of the repository at commit dd0b9ce with compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh) beside it.
# Stop 21 on the H200: the dumper's GPU path after this stop's dumper changes (stored-type and
# subclass checks, one pass per thread, the dumping branch eager under torch.compile): the GPU
# tests, off cost, dump throughput and forward stall, at the 1.07B shape.
bash compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip rows,analyze --out $OUT > $OUT/bench-gpu-dumper.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-gpu-dumper.log | cut -c1-200
grep -E "passed|failed" $OUT/bench-gpu-dumper.log | tail -3
