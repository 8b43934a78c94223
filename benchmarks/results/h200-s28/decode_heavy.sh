# Run from the repository root with $OUT set. Stop 28 on the H200: the decode-heavy pair (1.07B bf16, 512-token prompt,
# 256 decode steps), index build from the command line and in-process, both with worker processes now.
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_analyze.py --work /tmp/dh --hidden 2048 --layers 20 --inter 5632 --tokens 512 \
    --new-tokens 256 --device cuda --dtype bfloat16 > $OUT/bench-analyze-decode-heavy.log 2>&1
grep -E "^(PASS|FAIL|info|#)" $OUT/bench-analyze-decode-heavy.log | cut -c1-170
