set -x
LAYERS=4 /work/main/.venv/bin/python train.py llama 900
LAYERS=3 /work/main/.venv/bin/python train.py qwen3 700
LAYERS=3 /work/main/.venv/bin/python train.py gemma2 700
LAYERS=3 /work/main/.venv/bin/python train.py qwen3_moe 500
