#!/usr/bin/env bash
# The dumper workflow on a vLLM server with dumpdiff, end to end, with curl.
#
#   examples/vllm/workflow.sh MODEL_PATH [PORT] [DUMPER_PORT]
#
# Starts a server with dumping installed but idle (start-up passes are never dumped), dumps the
# decode run of one prompt into exp "dec" and the reference prefill of prompt+output into exp
# "ref", then runs dumpdiff first-divergence. vLLM's API server has no /dumper route: the
# dumper serves its own on 127.0.0.1:DUMPER_PORT. Run it with the environment that has vLLM and
# dumpdiff (here: .venv-vllm after make test; dumpdiff's analyzer is installed there too);
# the server's log goes to /tmp/vllm-dumpdiff.log.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_PATH [PORT] [DUMPER_PORT]}
PORT=${2:-8000}
DUMPER_PORT=${3:-40000}
URL=http://127.0.0.1:$PORT
CONTROL=http://127.0.0.1:$DUMPER_PORT
export DUMPER_DIR=${DUMPER_DIR:-/tmp/dumper}

# 1. launch: dumper installed, idle; --enforce-eager (hooks do not run in compiled code or graphs);
#    dev mode serves /reset_prefix_cache. On a CPU, VLLM_CPU_KVCACHE_SPACE sizes the KV cache (GiB).
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_SERVER_DEV_MODE=1 \
DUMPER_ENABLE=0 DUMPER_SERVER_PORT=$DUMPER_PORT DUMPER_NON_INTRUSIVE_MODE=all \
    python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --skip-tokenizer-init --enforce-eager --dtype float32 --max-model-len 512 > /tmp/vllm-dumpdiff.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "$URL/health" > /dev/null; do sleep 1; kill -0 $SERVER || { tail -20 /tmp/vllm-dumpdiff.log; exit 2; }; done

PROMPT='[1, 17, 93, 250, 4, 77, 301, 12, 8, 560, 33, 71, 402, 19, 5, 640]'
complete() {  # $1: prompt ids JSON, $2: max_tokens
    curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' -d "{\"model\": \"$MODEL\",
      \"prompt\": [$1], \"max_tokens\": $2, \"temperature\": 0, \"ignore_eos\": true, \"logprobs\": 1,
      \"return_tokens_as_token_ids\": true}"
}

# 2. the decode run (prefill + decode steps) into exp "dec"
curl -sf -X POST "$URL/reset_prefix_cache" > /dev/null
# cleanup_previous: a rerun replaces the experiment's passes instead of adding to them
curl -sf -X POST "$CONTROL/dumper/configure" -d '{"enable": true, "exp_name": "dec", "cleanup_previous": true}' > /dev/null
OUTPUT=$(complete "$PROMPT" 16 | python -c 'import json,sys
print([int(t.split(":")[1]) for t in json.load(sys.stdin)["choices"][0]["logprobs"]["tokens"]])')

# 3. the reference: one prefill of prompt+output (one token asked: no decode step), cache reset,
#    into exp "ref"
curl -sf -X POST "$CONTROL/dumper/configure" -d '{"exp_name": "ref", "cleanup_previous": true}' > /dev/null
curl -sf -X POST "$URL/reset_prefix_cache" > /dev/null
FULL=$(python -c "import json; print(json.dumps($PROMPT + $OUTPUT))")
complete "$FULL" 1 > /dev/null
curl -sf -X POST "$CONTROL/dumper/configure" -d '{"enable": false}' > /dev/null
curl -sf -X POST "$CONTROL/dumper/get_state"; echo

# 4. the verdict (exit 1 = divergence found); attach the markdown to the ticket
dumpdiff first-divergence "$DUMPER_DIR/ref" "$DUMPER_DIR/dec" || true
dumpdiff first-divergence "$DUMPER_DIR/ref" "$DUMPER_DIR/dec" --format md -o report.md || true
