while kill -0 $(cat logs/train.pid) 2>/dev/null; do sleep 5; done
for m in llama qwen3 gemma2 qwen3_moe; do /work/main/.venv/bin/python peaky.py $m 2>/dev/null | tail -1 >> peaky.jsonl; done
bash sweep.sh llama 2
bash sweep.sh qwen3 1
bash sweep.sh gemma2 1
bash sweep.sh qwen3_moe 1
