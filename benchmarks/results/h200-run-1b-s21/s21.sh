# Run from a copy of the repository at commit ce8c715 with, beside this script: compile.sh
# (benchmarks/results/h200-run-1b-s16/compile.sh) and phases.py (benchmarks/results/h200-run-1b-s20b/phases.py).
# Stop 21 on the H200: bench_gpu.py's analysis at the 1.07B shape with this stop's first reading
# of saved index tables (each file read whole into memory, columns decoded on dumpdiff's own
# threads, no pyarrow thread pool; the final code maps the files instead, see
# h200-table-reads-s21/), then the strict verdict's phases and its warm times on this host.
set -x
nproc; lscpu | grep -i "model name"
bash compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --work /tmp/w --keep --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "PASS|FAIL|info" $OUT/bench-1b.log | cut -c1-200
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
for i in 1 2 3 4 5; do python3 phases.py $R $D; done > $OUT/phases.txt 2>&1
for i in 1 2 3 4 5 6 7; do /usr/bin/time -f "%e s wall %U s user %S s sys %R minor faults %M KB" python3 -m analyzer.cli first-divergence $R $D --strict-only --no-progress > /dev/null; done 2> $OUT/strict-warm-times.txt
cat $OUT/phases.txt $OUT/strict-warm-times.txt
rm -rf /tmp/w
