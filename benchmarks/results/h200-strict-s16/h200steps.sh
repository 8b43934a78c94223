bash compile.sh > /dev/null 2>&1
W=/tmp/w-prof
if [ ! -f $W/dec/index/stamp.json ]; then python3 - <<'PY' > /dev/null
import sys, torch; sys.path.insert(0, "benchmarks")
import bench_analyze
bench_analyze.build_dumps("/tmp/w-prof", 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device="cuda")
PY
python3 -m analyzer.cli index $W/ref $W/dec --no-progress; fi
python3 rtsteps.py $W | tee $OUT/rtsteps.txt
python3 -c "import numpy; numpy.show_config()" 2>&1 | grep -i -A3 "simd\|cpu" | head -20
