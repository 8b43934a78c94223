bash compile.sh > /dev/null 2>&1
W=/tmp/w-prof
python3 - <<'PY'
import sys, torch; sys.path.insert(0, "benchmarks")
import bench_analyze
bench_analyze.build_dumps("/tmp/w-prof", 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device="cuda")
PY
python3 -m compileall -q analyzer dumper
python3 -m analyzer.cli index $W/ref $W/dec --no-progress
nproc
for i in 1 2 3 4 5; do python3 phases.py $W/ref $W/dec cold; done 2>&1 | tee $OUT/phases.txt
for i in 1 2 3; do python3 phases.py $W/ref $W/dec warm; done 2>&1 | tee -a $OUT/phases.txt
python3 -X importtime -m analyzer.cli first-divergence $W/ref $W/dec --strict-only --format json --no-progress 2> $OUT/importtime.txt > /dev/null
python3 -m cProfile -o $OUT/strict.prof -m analyzer.cli first-divergence $W/ref $W/dec --strict-only --format json --no-progress > /dev/null
python3 -c "import pstats; pstats.Stats('$OUT/strict.prof').sort_stats('tottime').print_stats(40)" > $OUT/strict-prof.txt
python3 -c "import pstats; pstats.Stats('$OUT/strict.prof').sort_stats('cumtime').print_stats(60)" >> $OUT/strict-prof.txt
head -60 $OUT/strict-prof.txt | tail -45
