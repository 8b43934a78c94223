#!/usr/bin/env bash
# Install the real sglang engine into an existing venv that already has a CPU torch,
# without ever letting pip fetch a CUDA torch.  Usage: install-sglang-cpu.sh VENV_PYTHON
#
# sglang's published requirements pull CUDA-only packages (sglang-kernel, flashinfer,
# flash-attn, cuda-python, ...) and torch==2.14.1.  So sglang goes in with --no-deps and
# only its pure-Python runtime needs are added, under a constraints file that pins the torch
# already in the venv.  The CUDA-only `sgl_kernel` is replaced at test time by the stand-in
# in tests/sglang_rig/ (PYTHONPATH); see tests/sglang_rig/README.md.
set -euo pipefail

PY=${1:?usage: $0 VENV_PYTHON}
SGLANG_VERSION=0.5.23

# Succeeds when sglang $SGLANG_VERSION and triton are installed; then (idempotently) makes
# two start-up modules tolerate a missing torchvision.  sglang.srt.configs imports them
# eagerly, yet they use torchvision only inside image-preprocessing functions.  PyPI's
# torchvision is a CUDA build that does not import beside CPU torch, so it is not installed.
# Uses find_spec, not `import sglang` (4-5 s), to keep reruns well under 2 s.
finish() {
    "$PY" - "$SGLANG_VERSION" <<'PYEOF'
import importlib.metadata as md, importlib.util as iu, pathlib, re, sys
if md.version("sglang") != sys.argv[1] or not iu.find_spec("triton"):
    sys.exit(1)
root = pathlib.Path(iu.find_spec("sglang").origin).parent
for rel in ("srt/configs/deepseek_ocr.py", "srt/multimodal/internvl_utils.py"):
    path = root / rel
    src = path.read_text()
    new = re.sub(r"^((?:import|from) torchvision\b.*)$",
                 r"try:  # install-sglang-cpu.sh: torchvision is needed for image inputs only\n"
                 r"    \1\nexcept ImportError:\n    pass", src, flags=re.M)
    if new != src:
        compile(new, str(path), "exec")
        path.write_text(new)
PYEOF
}

# Fast path: sglang goes in last, so finding it means the runtime needs went in before it.
if finish 2>/dev/null; then
    echo "sglang $SGLANG_VERSION already installed for $PY"
    exit 0
fi

TORCH_VERSION=$("$PY" -W ignore -c 'import torch; print(torch.__version__)') || {
    echo "error: $PY has no torch; install the CPU build first (pip install torch==2.13.0)" >&2
    exit 1
}
[[ $TORCH_VERSION == *+cpu ]] || echo "warning: torch $TORCH_VERSION is not a +cpu build" >&2

CONSTRAINTS=$(mktemp /tmp/sglang-cpu-constraints.XXXXXX)
trap 'rm -f "$CONSTRAINTS"' EXIT
# Pin the torch that is there: a package asking for another torch then fails to resolve
# instead of silently pulling a multi-GB CUDA build.  torchvision is refused outright.
printf 'torch==%s\ntorchvision<0\n' "$TORCH_VERSION" > "$CONSTRAINTS"

# -qq: errors only (this machine's pip config adds local indexes that warn per package).
PIP=("$PY" -m pip install -qq --disable-pip-version-check --constraint "$CONSTRAINTS")

# Runtime needs that are enough for dense models on CPU (measured; shared/notes/sglang-on-cpu.md).
# triton is imported at start-up by hundreds of modules but never launched on CPU.
"${PIP[@]}" \
    numpy 'transformers==5.19.0' tokenizers safetensors huggingface_hub \
    fastapi 'uvicorn>=0.51' uvloop 'pyzmq>=25.1.2' orjson msgspec psutil setproctitle \
    requests aiohttp pydantic einops packaging tqdm pillow python-multipart pybase64 \
    'prometheus-client>=0.20' partial_json_parser interegular regex scipy xxhash zstandard \
    watchfiles distro easydict python-dateutil IPython dill 'sentencepiece==0.2.1' \
    'apache-tvm-ffi==0.1.11' 'compressed-tensors==0.18.0' gguf 'openai==2.8.0' \
    'xgrammar==0.2.7' jsonschema 'soundfile==0.13.1' 'triton==3.7.1'

"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
finish
echo "installed sglang $SGLANG_VERSION (torch $TORCH_VERSION, no CUDA packages) for $PY"
