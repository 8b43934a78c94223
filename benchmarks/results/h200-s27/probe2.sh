# Stop 27 on the H200: the strict verdict's steps timed (phases2.py) with 1..16 join threads; import costs.
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -m analyzer.cli index $R $D > /dev/null 2>&1
for i in 1 2 3 4; do for jt in 1 2 4 8 16; do JT=$jt python3 benchmarks/results/h200-s27/phases2.py $R $D; done; done > $OUT/phases2.txt 2>&1
for m in "pyarrow" "pyarrow._parquet" "pyarrow.parquet" "numpy" "click" "numpy, pyarrow._parquet, click" "numpy, pyarrow.parquet, click"; do
  for i in 1 2 3 4 5; do python3 -c "import time; t=time.perf_counter(); import $m; print(round(1000*(time.perf_counter()-t),1))"; done | tr '\n' ' '; echo " <- import $m"; done > $OUT/imports.txt
cat $OUT/imports.txt; grep -c . $OUT/phases2.txt
