# Run from the repository root with $OUT set. Stop 28 on the H200: rows (point 3) and analysis (point 4) at the 1.07B
# shape, with the index build's worker processes started by analyzer/workers.py (a library call gets them too).
bash benchmarks/results/h200-run-1b-s16/compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --work /tmp/w --keep --out $OUT > $OUT/bench-gpu-analysis.log 2>&1
grep -E "^(PASS|FAIL|info)" $OUT/bench-gpu-analysis.log | cut -c1-170
# The in-process build, warm, with worker processes (the default now) and on threads alone, alternating.
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
for r in 1 2 3; do for p in default 0; do
  if [ $p = default ]; then unset DUMPDIFF_INDEX_PROCESSES; else export DUMPDIFF_INDEX_PROCESSES=0; fi
  python3 benchmarks/results/h200-s27/build_inproc.py $R $D processes-$p; done; done > $OUT/build-inproc.txt 2>&1
unset DUMPDIFF_INDEX_PROCESSES; cat $OUT/build-inproc.txt
