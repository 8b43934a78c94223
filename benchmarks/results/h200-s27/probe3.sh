# Stop 27 on the H200: does pre-faulting the heap (or glibc huge pages) shorten the strict verdict?
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -m analyzer.cli index $R $D > /dev/null 2>&1
TUN=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:glibc.malloc.top_pad=67108864
for r in 1 2 3 4 5 6 7 8; do for m in base pre pre1; do echo "$m $(MB=256 python3 benchmarks/results/h200-s27/prefault_ab.py $m $R $D)"; done
  echo "hugetlb $(GLIBC_TUNABLES=$TUN:glibc.malloc.hugetlb=1 python3 benchmarks/results/h200-s27/prefault_ab.py none $R $D)"; done > $OUT/prefault.txt 2>&1
sort $OUT/prefault.txt | awk '{t[$1]=t[$1]" "$2; f[$1]=f[$1]" "$3; i[$1]=i[$1]" "$5"/"$7} END {for (k in t) print k, "ms:", t[k], " faults:", f[k], " imp/join:", i[k]}'
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
