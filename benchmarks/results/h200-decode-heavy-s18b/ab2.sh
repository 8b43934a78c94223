bash compile.sh > /dev/null 2>&1
(cd new && python3 -m compileall -q analyzer dumper > /dev/null; cd ../old && python3 -m compileall -q analyzer dumper > /dev/null)
(cd new && python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-dec', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1)
python3 ab2.py /tmp/w-dec 6 2>&1 | tee $OUT/ab-dump-order.txt
