#!/usr/bin/env bash
# Install the real sglang engine into an existing venv that already has a CPU torch,
# without ever letting pip fetch a CUDA torch.  Usage: install-sglang-cpu.sh VENV_PYTHON
#
# sglang's published requirements pull CUDA-only packages (sglang-kernel, flashinfer,
# flash-attn, cuda-python, ...) and torch==2.14.1.  So sglang goes in with --no-deps and
# only its pure-Python runtime needs are added, under a constraints file that pins the torch
# already in the venv.  The CUDA-only `sgl_kernel` is replaced at test time by the stand-in
# in tests/sglang_rig/ (PYTHONPATH), see tests/sglang_rig/README.md.
set -euo pipefail

PY=${1:?usage: $0 VENV_PYTHON}
SGLANG_VERSION=0.5.23

# Fast path (a rerun costs one interpreter start): sglang is installed last, so finding it
# at the right version means the runtime needs before it went in too.
if "$PY" - "$SGLANG_VERSION" 2>/dev/null <<'PYEOF'
import sys, importlib.metadata as md, importlib.util as iu
ok = md.version("sglang") == sys.argv[1] and iu.find_spec("sglang") and iu.find_spec("triton")
sys.exit(0 if ok else 1)
PYEOF
then
    echo "sglang $SGLANG_VERSION already installed in $("$PY" -c 'import sys;print(sys.prefix)')"
    exit 0
fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)') || {
    echo "error: $PY has no torch; install the CPU build first (pip install torch==2.13.0)" >&2
    exit 1
}
case "$TORCH_VERSION" in
    *+cpu) ;;
    *) echo "warning: torch $TORCH_VERSION is not a +cpu build" >&2 ;;
esac

CONSTRAINTS=$(mktemp /tmp/sglang-cpu-constraints.XXXXXX)
trap 'rm -f "$CONSTRAINTS"' EXIT
# Pin the torch that is there: any package asking for another torch fails to resolve
# instead of silently pulling a multi-GB CUDA build.  torchvision is kept out entirely
# (the PyPI build is CUDA-only and fails to import beside CPU torch).
cat > "$CONSTRAINTS" <<CEOF
torch==$TORCH_VERSION
torchvision<0
CEOF

PIP=("$PY" -m pip install --disable-pip-version-check --quiet --constraint "$CONSTRAINTS")

# Runtime needs that are enough for dense models on CPU (measured; see
# shared/notes/sglang-on-cpu.md).  triton is imported at start-up but never launched on CPU.
"${PIP[@]}" \
    numpy 'transformers==5.19.0' tokenizers safetensors huggingface_hub \
    fastapi 'uvicorn>=0.51' uvloop 'pyzmq>=25.1.2' orjson msgspec psutil setproctitle \
    requests aiohttp pydantic einops packaging tqdm pillow python-multipart pybase64 \
    'prometheus-client>=0.20' partial_json_parser interegular regex scipy xxhash zstandard \
    watchfiles distro easydict python-dateutil IPython dill 'sentencepiece==0.2.1' \
    'apache-tvm-ffi==0.1.11' 'compressed-tensors==0.18.0' gguf 'openai==2.8.0' \
    'xgrammar==0.2.7' jsonschema 'soundfile==0.13.1' 'triton==3.7.1'

# Last, so the fast path above only sees a complete install.
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

"$PY" -c 'import torch, sglang; print("installed sglang", sglang.__version__, "with torch", torch.__version__)'
