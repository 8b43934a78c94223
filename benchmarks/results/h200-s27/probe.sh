# Stop 27 on the H200: where --strict-only's time goes on this host (phases, imports, profile), at the 1.07B shape.
bash benchmarks/results/h200-run-1b-s16/compile.sh > $OUT/python-start.txt 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
nproc > $OUT/host.txt; lscpu | grep -E "Model name|MHz|^CPU\(s\)" >> $OUT/host.txt
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec; du -sh $R $D >> $OUT/host.txt
python3 -m analyzer.cli index $R $D > /dev/null 2>&1
for i in 1 2 3 4 5 6; do /usr/bin/time -f "%e s wall %U user %S sys" python3 -m analyzer.cli first-divergence --strict-only $R $D > /dev/null 2>>$OUT/strict-times.txt; done
for i in 1 2 3 4 5 6; do python3 benchmarks/results/h200-s27/phases.py $R $D; done > $OUT/phases.txt 2>&1
for i in 1 2 3; do python3 -X importtime -m analyzer.cli first-divergence --strict-only $R $D 2> $OUT/importtime.txt > /dev/null; done
python3 benchmarks/results/h200-s27/prof.py $R $D > /dev/null 2> $OUT/prof.txt
for i in 1 2 3; do /usr/bin/time -f "%e s" python3 -c "import numpy, pyarrow.parquet, click"; done 2> $OUT/floor.txt
for i in 1 2 3; do /usr/bin/time -f "%e s" python3 -c "pass"; done 2> $OUT/bare.txt
cat $OUT/host.txt $OUT/strict-times.txt $OUT/phases.txt $OUT/floor.txt $OUT/bare.txt
