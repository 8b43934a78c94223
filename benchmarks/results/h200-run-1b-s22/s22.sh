# Run from a copy of the repository at commit eede079 with compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh) beside it.
# Stop 22 on the H200: tests/test_gpu.py and bench_gpu.py's analysis at the 1.07B shape (bf16,
# natural prefill/decode divergence) after this stop's noise-aware rule for calls with bit-identical
# inputs: the natural GPU divergence must still be called noise.
set -x
nproc
bash compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip off,on,steady --work /tmp/w --keep --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "PASS|FAIL|info|passed|failed" $OUT/bench-1b.log | cut -c1-220
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -m analyzer.cli first-divergence $R $D --no-progress > $OUT/first-divergence-gpu.txt 2>&1; echo "exit $?" >> $OUT/first-divergence-gpu.txt
python3 -m analyzer.cli first-divergence $R $D --no-progress --format json > $OUT/first-divergence-gpu.json 2>/dev/null
cat $OUT/first-divergence-gpu.txt | head -40
rm -rf /tmp/w
