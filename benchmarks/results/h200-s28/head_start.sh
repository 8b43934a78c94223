# Stop 28 on the H200: storage reading the first pieces while the worker processes start (will_need_first), A/B against
# the last commit (base.snap.tar, a git archive), interleaved, cold: the decode-heavy pair's index build, command line
# and in-process; then the 1.07B pair's the same way.
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
mkdir -p /tmp/base && tar -xf benchmarks/results/h200-s28/base.snap.tar -C /tmp/base
python3 -m compileall -q analyzer dumper /tmp/base/analyzer /tmp/base/dumper > /dev/null
HERE=$PWD
ab() {  # $1: label, $2 $3: the pair
  for r in $(seq 1 ${ROUNDS:-5}); do for t in base new inproc-base inproc-new; do
    case $t in *base) cd /tmp/base;; *) cd $HERE;; esac
    python3 -c "import sys; sys.path.insert(0, '$HERE/benchmarks'); from common import evict; evict('$2', '$3')"
    case $t in inproc*) python3 $HERE/benchmarks/results/h200-s27/build_inproc.py $2 $3 $1-$t | sed 's/^/ /';;
      *) s=$(date +%s.%N); python3 -m analyzer.cli index $2 $3 --rebuild --no-progress > /dev/null; e=$(date +%s.%N)
         echo " $1-$t cold $(echo "$e - $s" | bc)";; esac
  done; done; cd $HERE
  for i in 1 2 3; do python3 -c "import sys; sys.path.insert(0, '$HERE/benchmarks'); from common import evict; evict('$2', '$3')"
    s=$(date +%s.%N); find $2 $3 -name "*.safetensors" -print0 | xargs -0 cat > /dev/null; e=$(date +%s.%N); echo " $1 cold cat $(echo "$e - $s" | bc)"; done
}
python3 -c "import sys, torch; sys.path.insert(0, 'benchmarks'); from bench_analyze import build_dumps
build_dumps('/tmp/dh', 2048, 20, 5632, 512, 256, dtype=torch.bfloat16, device='cuda')" > $OUT/make-decode-heavy.log 2>&1
ab decode-heavy /tmp/dh/ref /tmp/dh/dec > $OUT/ab-decode-heavy.txt 2>&1
cat $OUT/ab-decode-heavy.txt
