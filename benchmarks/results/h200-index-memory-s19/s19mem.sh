# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh).
bash compile.sh > /dev/null 2>&1
python3 -m compileall -q analyzer dumper > /dev/null
python3 mem.py 1b 2>&1 | grep -v Warning | tee $OUT/index-memory.txt
python3 mem.py 8b 2>&1 | grep -v Warning | tee -a $OUT/index-memory.txt
df -h /tmp | tail -1
