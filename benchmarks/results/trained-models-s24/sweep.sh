# sweep.sh MODEL PLANT_LAYER
M=$1; L=$2
cd /tmp/tm
for dt in float32 bfloat16; do for mode in single padded; do for s in 0 1; do
  /work/main/.venv/bin/python tm.py --model $M --dtype $dt --mode $mode --seed $s 2>&1 | grep -v -e Warn -e Loading
done; done; done
for dt in float32 bfloat16; do for p in attn:0:0.1 attn:$L:0.01 attn:$L:0.1 mlp:$L:0.01 mlp:$L:0.1 stale:$L:80 kv:$L:80:0.5; do
  /work/main/.venv/bin/python tm.py --model $M --dtype $dt --mode padded --plant $p --out /tmp/tm/planted.jsonl 2>&1 | grep -v -e Warn -e Loading
done; done
