# Stop 27 on the H200: the in-process index build (threads only) with 1, 2, 4 and 8 hashing threads, warm.
python3 -m compileall -q analyzer dumper > /dev/null 2>&1
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
cat $R/rank0/*.safetensors $D/rank0/*.safetensors > /dev/null
for t in 8 2 4 1 8 2 4; do DUMPDIFF_HASH_THREADS=$t python3 benchmarks/results/h200-s27/build_inproc.py $R $D threads$t; done > $OUT/build-threads.txt 2>&1
cat $OUT/build-threads.txt
