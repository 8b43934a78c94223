"""Stand-in for the CUDA-only ``sgl_kernel`` package, for running sglang's CPU path in tests.

sglang imports ``sgl_kernel`` (and some submodules) at start-up even on CPU, and no CPU
build of it is published.  Here every attribute resolves to a function that raises
NotImplementedError, so imports succeed and any kernel that is really reached fails loudly.
The one kernel the dense CPU path calls, ``assign_req_to_token_pool_cpu``, is implemented.
Put on the path only for tests (PYTHONPATH=tests/sglang_rig); see ../README.md.
"""

import sys
import types

# Submodules sglang imports from on the way to a dense model on CPU.  Anything else stays an
# ImportError, so sglang's own "kernel missing" fallbacks still trigger for it.
_SUBMODULES = (
    "mamba",
    "kvcacheio",
    "elementwise",
    "speculative",
    "sampling",
    "top_k",
    "moe",
    "gemm",
    "attention",
    "allreduce",
    "memory",
    "flash_attn",
)


def _missing(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} needs the CUDA kernel")

    stub.__name__ = stub.__qualname__ = name.rpartition(".")[2]
    return stub


def _module_getattr(prefix):
    def __getattr__(name):
        # Dunders (__path__, __all__, __version__, ...) must stay missing, or importlib and
        # feature probes would mistake the stand-in for something it is not.
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(prefix + name)

    return __getattr__


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """For each request r (in order) with slots [s, e), write the next e - s entries of
    out_cache_loc into req_to_token[r, s:e].  pool_len is the row length of req_to_token
    (the C kernel's stride); here it only bounds-checks."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if not 0 <= s <= e <= pool_len:
            raise IndexError(f"slots [{s}, {e}) outside a pool row of {pool_len}")
        req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s]
        pos += e - s


__getattr__ = _module_getattr("")

for _name in _SUBMODULES:
    _mod = types.ModuleType(f"{__name__}.{_name}", "sgl_kernel stand-in submodule")
    _mod.__getattr__ = _module_getattr(f"{_name}.")
    sys.modules[_mod.__name__] = _mod
    globals()[_name] = _mod
del _name, _mod
