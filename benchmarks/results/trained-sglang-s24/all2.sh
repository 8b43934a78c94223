cd /tmp/sgt
P=/tmp/sgt/repo/.venv/bin/python
for m in llama qwen2; do for d in float32 bfloat16; do NEW=32 $P drive.py $m $d none b3long,b5,hit; done; done
$P drive.py llama float32 prefix_kv:1 hit,hit1
$P drive.py llama float32 prefix_kv:3 hit,hit1
$P drive.py qwen2 float32 prefix_kv:1 hit
$P drive.py qwen2 float32 prefix_kv:3 hit
$P drive.py llama bfloat16 prefix_kv:1 hit
