# Run from the repository root with $OUT set and .snap.tar (git archive of the commit under test) beside it.
# Stop 26 on the H200, after the streamed index build (f4671ad): the analysis at the 1.07B shape, then
# the decode-heavy pair (512-token prompt, 256 decode steps).
rm -rf /tmp/clean && mkdir -p /tmp/clean && tar -xf .snap.tar -C /tmp/clean && cd /tmp/clean
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --work /tmp/w --out $OUT > $OUT/bench-gpu-analysis-stream.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-gpu-analysis-stream.log | grep -v "rows:" | cut -c1-150
rm -rf /tmp/w
python3 benchmarks/bench_analyze.py --work /tmp/dh --hidden 2048 --layers 20 --inter 5632 --tokens 512 --new-tokens 256 \
    --device cuda --dtype bfloat16 > $OUT/bench-analyze-decode-heavy-stream.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-analyze-decode-heavy-stream.log | cut -c1-150
