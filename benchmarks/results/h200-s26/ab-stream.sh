# Run from the repository root with $OUT set, .snap.tar (the streamed build, f4671ad) and .snap-old.tar
# (160182e) beside it. Stop 26 on the H200: the index build of both trees, interleaved, cold, on one host:
# a 1.07B bf16 pair (2048-token prompt, 16 new tokens) and a decode-heavy one (512-token prompt, 256 steps).
for t in new old; do rm -rf /tmp/$t && mkdir -p /tmp/$t; done
tar -xf .snap.tar -C /tmp/new && tar -xf .snap-old.tar -C /tmp/old
cd /tmp/new && bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
for t in new old; do (cd /tmp/$t && python3 -m compileall -q analyzer dumper > /dev/null); done
cd /tmp/new/benchmarks && python3 -c "
import torch, bench_analyze as b
b.build_dumps('/tmp/p1b', 2048, 20, 5632, 2048, 16, dtype=torch.bfloat16, device='cuda')
b.build_dumps('/tmp/pdh', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')" > $OUT/dumps.txt 2>&1
evict() { sync; python3 -c "
import os, sys
for b,_,fs in os.walk(sys.argv[1]):
    for f in fs:
        fd=os.open(os.path.join(b,f),os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" $1; }
for pair in p1b pdh; do
  for round in 1 2 3; do
    for t in new old; do
      evict /tmp/$pair; cd /tmp/$t; /usr/bin/time -f "$pair $t cold wall %e user %U sys %S maxrss %MKB" python3 -c "
import sys; sys.argv=['dumpdiff','index','--rebuild','--no-progress','/tmp/$pair/ref','/tmp/$pair/dec']
from analyzer.cli import entry; entry()" > /dev/null 2> /tmp/err.txt; tail -1 /tmp/err.txt
    done
  done
  evict /tmp/$pair; /usr/bin/time -f "$pair cat cold wall %e" sh -c "cat /tmp/$pair/*/rank0/*.safetensors > /dev/null"
done 2>&1 | grep -v "^$" | tee $OUT/ab-stream.txt
