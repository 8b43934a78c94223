# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh), ab2.py (benchmarks/results/h200-decode-heavy-s18b/ab2.py).
# Stop 19 on the H200: index build memory at 8B shape with huge tensors read a block of rows at a time, then an
# A/B of the index build, old = whole tensors (HEAD~1), new = blocks of rows, 2 alternating rounds.
bash compile.sh > /dev/null 2>&1
(cd new && python3 -m compileall -q analyzer dumper > /dev/null; cd ../old && python3 -m compileall -q analyzer dumper > /dev/null)
(cd new && python3 mem.py 8b 2>&1 | grep -v Warning | tee $OUT/index-memory-row-blocks.txt)
python3 ab2.py /tmp/w-8b 2 2>&1 | tee $OUT/ab-huge-tensors-in-blocks-8b.txt
rm -rf /tmp/w-8b
