set -x
cd /tmp/sgt
P=/tmp/sgt/repo/.venv/bin/python
$P drive.py llama bfloat16 none b1,b3,hit
for m in llama; do for d in float32 bfloat16; do
  $P drive.py $m $d prefix_kv:2 hit,hit1
  $P drive.py $m $d batch_variant:2 b1
done; done
$P drive.py qwen2 float32 none b1,b3,hit
$P drive.py qwen2 bfloat16 none b1,b3,hit
for d in float32 bfloat16; do
  $P drive.py qwen2 $d prefix_kv:2 hit,hit1
  $P drive.py qwen2 $d batch_variant:2 b1
done
