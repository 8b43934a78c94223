# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh).
# Stop 19 on the H200: the off-cost benchmark with the states rotated through every order in a round, twice.
bash compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
for i in 1 2; do python3 benchmarks/bench_off.py --device cuda --variants --rounds 24 > $OUT/h200-bench_off-rotated-run$i.log 2>&1; done
grep -h -E "^# |RESULT" $OUT/h200-bench_off-rotated-run*.log | cut -c1-300
