# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh), ab2.py (benchmarks/results/h200-decode-heavy-s18b/ab2.py).
# Stop 19 on the H200: A/B of the index build (stop 18 code vs rows hashed a 2 MB block at a time), decode-heavy
# pair, then bench_gpu.py's analysis section at the 1.07B shape with the new code.
set -x
bash compile.sh > $OUT/python-start.txt 2>&1
(cd new && python3 -m compileall -q analyzer dumper > /dev/null; cd ../old && python3 -m compileall -q analyzer dumper > /dev/null)
(cd new && python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-dec', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1)
python3 ab2.py /tmp/w-dec 6 2>&1 | tee $OUT/ab-row-blocks-decode-heavy.txt
rm -rf /tmp/w-dec
cd new && python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady --out $OUT > $OUT/bench-1b.log 2>&1
grep -E "^# |PASS|FAIL|info" $OUT/bench-1b.log | cut -c1-250 | tail -40
