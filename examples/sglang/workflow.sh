#!/usr/bin/env bash
# The standard sglang dumper workflow with dumpdiff, end to end, with curl.
#
#   examples/sglang/workflow.sh MODEL_PATH [PORT]
#
# Starts a server with dumping installed but idle (warm-up is never dumped), dumps the decode
# run of one prompt into exp "dec" and the reference prefill of prompt+output into exp "ref",
# then runs dumpdiff first-divergence. On a GPU drop the CPU-only flags; keep CUDA graphs off.
# Run it with the environment that has sglang and dumpdiff active (here: . .venv/bin/activate
# after make test); the server's log goes to /tmp/sglang-dumpdiff.log.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_PATH [PORT]}
PORT=${2:-30000}
URL=http://127.0.0.1:$PORT
export DUMPER_DIR=${DUMPER_DIR:-/tmp/dumper}

# 1. launch: dumper installed, idle; /dumper/* served on the engine's own port
CPU_FLAGS=()
if python -c 'import torch, sys; sys.exit(torch.cuda.is_available())'; then  # no GPU: the CPU rig
    export SGLANG_USE_CPU_ENGINE=1
    # sglang imports the CUDA-only sgl_kernel at start-up: the stand-in of tests/sglang_rig/README.md
    export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/tests/sglang_rig${PYTHONPATH:+:$PYTHONPATH}"
    CPU_FLAGS=(--device cpu --attention-backend torch_native --sampling-backend pytorch --grammar-backend none
               --dtype float32 --mem-fraction-static 0.05 --max-total-tokens 4096
               --sleep-on-idle)  # an idle scheduler would spin a whole core
fi
DUMPER_ENABLE=0 DUMPER_SERVER_PORT=reuse DUMPER_NON_INTRUSIVE_MODE=all \
    python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --skip-tokenizer-init --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled \
    "${CPU_FLAGS[@]}" > /tmp/sglang-dumpdiff.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "$URL/health" > /dev/null; do sleep 1; kill -0 $SERVER || { tail -20 /tmp/sglang-dumpdiff.log; exit 2; }; done

PROMPT='[1, 17, 93, 250, 4, 77, 301, 12, 8, 560, 33, 71, 402, 19, 5, 640]'
generate() {  # $1: input_ids JSON, $2: max_new_tokens
    curl -sf "$URL/generate" -H 'Content-Type: application/json' -d "{\"input_ids\": $1,
      \"sampling_params\": {\"temperature\": 0, \"max_new_tokens\": $2, \"ignore_eos\": true},
      \"return_logprob\": true, \"logprob_start_len\": 0}"
}

# 2. the decode run (prefill + decode steps) into exp "dec"
curl -sf -X POST "$URL/flush_cache" > /dev/null
# cleanup_previous: a rerun replaces the experiment's passes instead of adding to them
curl -sf -X POST "$URL/dumper/configure" -d '{"enable": true, "exp_name": "dec", "cleanup_previous": true}' > /dev/null
OUTPUT=$(generate "$PROMPT" 16 | python -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])')

# 3. the reference: one prefill of prompt+output, cache flushed, into exp "ref"
curl -sf -X POST "$URL/dumper/configure" -d '{"exp_name": "ref", "cleanup_previous": true}' > /dev/null
curl -sf -X POST "$URL/flush_cache" > /dev/null
FULL=$(python -c "import json; print(json.dumps($PROMPT + $OUTPUT))")
generate "$FULL" 0 > /dev/null
curl -sf -X POST "$URL/dumper/configure" -d '{"enable": false}' > /dev/null
curl -sf -X POST "$URL/dumper/get_state"; echo

# 4. the verdict (exit 1 = divergence found); attach the markdown to the ticket
dumpdiff first-divergence "$DUMPER_DIR/ref" "$DUMPER_DIR/dec" || true
dumpdiff first-divergence "$DUMPER_DIR/ref" "$DUMPER_DIR/dec" --format md -o report.md || true
