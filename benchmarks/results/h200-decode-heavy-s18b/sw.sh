bash compile.sh > /dev/null 2>&1
python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import bench_analyze as b, torch
b.build_dumps('/tmp/w-dec', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')
" 2>&1 | tail -1
W=/tmp/w-dec N=5 python3 ab_sw.py 0.005 0.0005 0.001 2>&1 | tee $OUT/ab-switch-interval.txt
