# Stop 27 on the H200: why the in-process index build (threads only) is slower than the command line's.
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
for r in 1 2; do for v in default swi block8 swi+block8; do python3 benchmarks/results/h200-s27/build_inproc.py $R $D $v; done; done > $OUT/build-inproc.txt 2>&1
for v in default swi; do python3 benchmarks/results/h200-s27/build_inproc.py $R $D $v cold; done >> $OUT/build-inproc.txt 2>&1
s=$(date +%s.%N); python3 -m analyzer.cli index $R $D --rebuild --no-progress > /dev/null; e=$(date +%s.%N); python3 -c "print('cli warm', round($e - $s, 2))" >> $OUT/build-inproc.txt
cat $OUT/build-inproc.txt
