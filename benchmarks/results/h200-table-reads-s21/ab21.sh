# Stop 21, H200: an A/B of reading saved index tables, warm, on one host: the stop-20 tree (old/,
# commit 927274b: pyarrow reads through Python file objects, the rows table's columns decoded on
# pyarrow's thread pool) against this stop's (files mapped into memory, columns decoded on our own
# threads, a ParquetFile per read, no pyarrow thread pool).
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out /tmp/x > $OUT/ab-build.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -m compileall -q analyzer dumper old/analyzer old/dumper > /dev/null
python3 -m analyzer.cli index $R $D --no-progress
for i in $(seq 12); do
  for t in old new; do
    d=.; [ $t = old ] && d=old
    for mode in strict default; do
      extra=--strict-only; [ $mode = default ] && extra=
      s=$(date +%s%N); (cd $d && python3 -m analyzer.cli first-divergence $R $D $extra --no-progress > /dev/null 2>&1); e=$(date +%s%N)
      echo "$t $mode $(( (e - s) / 1000000 ))"
    done
  done
done > $OUT/ab-table-reads.txt
awk '{k=$1" "$2; t[k]=t[k]" "$3} END {for (k in t) print k, t[k]}' $OUT/ab-table-reads.txt | sort | while read a b rest; do echo "$a $b median $(echo $rest | tr ' ' '\n' | sort -n | awk '{x[NR]=$1} END {print x[int((NR+1)/2)]}'): $rest"; done
rm -rf /tmp/w
