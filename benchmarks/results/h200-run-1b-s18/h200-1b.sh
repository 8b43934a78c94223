bash compile.sh 2>&1 | tee $OUT/python-start.txt
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "^# |PASS|FAIL|info" $OUT/bench-1b.log | cut -c1-250 | tail -40
