# A decode-heavy pair on the GPU (1.07B shape, bf16, 512-token prompt, 256 new tokens): bench_analyze, cold and warm.
bash compile.sh 2>&1 | tee $OUT/python-start.txt
W=/tmp/w-dec
python3 benchmarks/bench_analyze.py --work $W --hidden 2048 --layers 20 --inter 5632 --tokens 512 --new-tokens 256 \
  --device cuda --dtype bfloat16 --keep > $OUT/bench-decode-heavy.log 2>&1
grep -E "^# |RESULT" $OUT/bench-decode-heavy.log | cut -c1-300 | tail -40
