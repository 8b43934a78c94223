# A/B of the index build, stop 18 code (old) vs large passes hashed in pieces by worker processes (new); ab2.py is benchmarks/results/h200-decode-heavy-s18b/ab2.py
bash compile.sh > /dev/null 2>&1
(cd new && python3 -m compileall -q analyzer dumper > /dev/null; cd ../old && python3 -m compileall -q analyzer dumper > /dev/null)
(cd new && python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-dec', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1)
python3 ab2.py /tmp/w-dec 6 2>&1 | tee $OUT/ab-large-pass-pieces.txt
(cd new && python3 -m analyzer.cli -v index /tmp/w-dec/ref /tmp/w-dec/dec --rebuild 2>&1 | tail -3; python3 -m analyzer.cli first-divergence /tmp/w-dec/ref /tmp/w-dec/dec --strict-only --format json | python3 -c "import json,sys; print(json.load(sys.stdin)['culprit']['call'])")
