# Stop 27 on the H200: --strict-only in-process (benchmarks/_measure.py, as bench_analyze times it), warm,
# the baseline tree (base.snap.tar: git archive of the last commit) and this working tree interleaved.
bash benchmarks/results/h200-run-1b-s16/compile.sh > /dev/null 2>&1
mkdir -p /tmp/base && tar -xf benchmarks/results/h200-s27/base.snap.tar -C /tmp/base
python3 -m compileall -q analyzer dumper /tmp/base/analyzer /tmp/base/dumper > /dev/null
python3 benchmarks/bench_gpu.py --model 1b --skip tests,off,on,steady,analyze --work /tmp/w --keep --out $OUT > $OUT/make-pair.log 2>&1
R=/tmp/w/rows/full/ref; D=/tmp/w/rows/full/dec
python3 -m analyzer.cli index $R $D > /dev/null 2>&1
HERE=$PWD
for r in $(seq 1 ${ROUNDS:-10}); do for t in base new cold-base cold-new; do
  case $t in *base) cd /tmp/base;; *) cd $HERE;; esac
  case $t in cold*) python3 -c "import sys; sys.path.insert(0, '$HERE/benchmarks'); from common import evict; evict('$R', '$D')";; esac
  python3 benchmarks/_measure.py /tmp/m.json analyzer.cli first-divergence --strict-only --format json --no-progress $R $D > /tmp/$t.json 2>/dev/null
  echo "$t $(python3 -c "import json; print(round(json.load(open('/tmp/m.json'))['seconds'], 4))")"
done; done > $OUT/ab.txt
cd $HERE
python3 - <<'PY' > $OUT/ab-summary.txt
import json
print("same verdict JSON:", json.load(open("/tmp/base.json")) == json.load(open("/tmp/new.json")) == json.load(open("/tmp/cold-new.json")))
t = {}
for line in open("/tmp/ab-out.txt" if False else __import__("os").environ["OUT"] + "/ab.txt"):
    k, v = line.split(); t.setdefault(k, []).append(float(v))
for k, v in t.items(): v.sort(); print(k, "median", v[len(v)//2], "min", v[0], "all", v)
med = lambda k: sorted(t[k])[len(t[k]) // 2]
print("new/base median, warm:", round(med("new") / med("base"), 3), "cold:", round(med("cold-new") / med("cold-base"), 3))
PY
for t in base new new-swi; do case $t in base) cd /tmp/base;; *) cd $HERE;; esac; for i in 1 2 3; do
  SWI=$([ $t = new-swi ] && echo 0.0005) python3 $HERE/benchmarks/results/h200-s27/phases2.py $R $D; done; done > $OUT/phases2.txt 2>&1
cd $HERE; cat $OUT/ab-summary.txt
for i in 1 2 3; do python3 -c "import sys; sys.path.insert(0, '$HERE/benchmarks'); from common import evict; evict('$R', '$D')"
  s=$(date +%s.%N); find $R $D -name "*.safetensors" -print0 | xargs -0 cat > /dev/null; e=$(date +%s.%N); echo "cold cat of both dumps: $(echo "$e - $s" | bc) s"; done | tee -a $OUT/ab-summary.txt
