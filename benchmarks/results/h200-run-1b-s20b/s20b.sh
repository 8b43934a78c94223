# Run from a copy of the repository at commit 14745ca with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh) and phases.py (in this folder).
# Stop 20 on the H200, second run: bench_gpu.py's analysis at the 1.07B shape again (another sample
# of the strict ratio), then where --strict-only spends its time on this host (warm).
set -x
nproc; lscpu | grep -i "model name"
bash compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --work /tmp/w --keep --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "PASS|FAIL|info" $OUT/bench-1b.log | grep -i "strict\|index build bandwidth\|starting" | cut -c1-200
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -X importtime -m analyzer.cli first-divergence $R $D --strict-only --no-progress > /dev/null 2> $OUT/importtime.txt
python3 benchmarks/profile_cli.py 45 -- first-divergence $R $D --strict-only --no-progress > /dev/null 2> $OUT/profile-strict.txt
for i in 1 2 3 4 5; do python3 phases.py $R $D; done > $OUT/phases.txt 2>&1
for i in 1 2 3 4 5 6 7; do /usr/bin/time -f "%e s wall %U s user %S s sys %R minor faults %M KB" python3 -m analyzer.cli first-divergence $R $D --strict-only --no-progress > /dev/null; done 2> $OUT/strict-warm-times.txt
for i in 1 2 3 4 5; do /usr/bin/time -f "%e s wall %U s user %S s sys" python3 -c "import numpy, pyarrow.parquet, click"; done 2> $OUT/imports-times.txt
cat $OUT/phases.txt $OUT/strict-warm-times.txt $OUT/imports-times.txt
sort -t'|' -k2 -n $OUT/importtime.txt | tail -25
rm -rf /tmp/w
