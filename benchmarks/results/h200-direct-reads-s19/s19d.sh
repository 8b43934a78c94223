# Run from a copy of the repository with, beside this script: compile.sh (benchmarks/results/h200-run-1b-s16/compile.sh), ab2.py (benchmarks/results/h200-decode-heavy-s18b/ab2.py).
# Stop 19 on the H200: A/B of the index build, old = plain reads through the page cache, new = direct reads
# (O_DIRECT) of large passes when the file is not cached; decode-heavy pair, then the 1.07B pair.
bash compile.sh > $OUT/python-start.txt 2>&1
(cd new && python3 -m compileall -q analyzer dumper > /dev/null; cd ../old && python3 -m compileall -q analyzer dumper > /dev/null)
findmnt -T /tmp -n -o FSTYPE,OPTIONS; cat /sys/block/*/queue/read_ahead_kb 2>/dev/null | sort | uniq -c
(cd new && python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-dec', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1)
python3 ab2.py /tmp/w-dec 6 2>&1 | tee $OUT/ab-direct-reads-decode-heavy.txt
rm -rf /tmp/w-dec
(cd new && python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-1b', 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1)
python3 ab2.py /tmp/w-1b 4 2>&1 | tee $OUT/ab-direct-reads-1b.txt
(cd new && python3 -m analyzer.cli first-divergence /tmp/w-1b/ref /tmp/w-1b/dec --strict-only --format json | python3 -c "import json,sys; print('culprit', json.load(sys.stdin)['culprit']['call'])")
