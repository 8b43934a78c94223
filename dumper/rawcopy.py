"""Staging copies as raw byte copies: the bytes Tensor.copy_ would copy, in less host time.

A fingerprint pass copies each new tensor's rows into a staging block (passprints.py): hundreds
of small copies a decode step, where the host time of each copy is the step's time. torch's
copy_ into a slice of the block makes a view, goes through the dispatcher and checks shapes and
types: about 3 µs on a CPU and 9 µs on an H100's host. A tensor whose elements lie contiguously
is its rows' bytes in order, so those bytes are copied as they lie instead:

* on a CPU by ``memmove`` (about 0.6 µs; tensors above ``CPU_MOST`` bytes take copy_, which
  splits a large copy across threads). CPU kernels have finished when they return, so the bytes
  are the ones the hook sees.
* on a GPU by the driver's ``cuMemcpyDtoDAsync`` (about 5 µs) queued on torch's current stream
  of the rows' device: ordered exactly as copy_ would be, after the kernel that wrote the rows
  and before any that rewrites them. Rows on another device than the current one, and a process
  whose driver cannot be called or once failed, take copy_.

Anything else (strided rows, other devices, a CUDA graph capture, which records copy_'s nodes)
takes copy_.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

log = logging.getLogger("dumper")
CPU_MOST = 1 << 20  # bytes: larger CPU tensors take copy_, which uses several threads
disabled: Optional[str] = None  # why GPU rows take copy_ in this process
_driver: list = []  # (cuMemcpyDtoDAsync, current device's index, a device's current raw stream), once loaded
_memmove = ctypes.memmove


def copy_rows(address: int, rows: torch.Tensor, nbytes: Optional[int] = None) -> bool:
    """Copy tensor ``rows``'s bytes (``nbytes`` of them, where the caller knows) to ``address``
    (memory of its device with room for them); False where nothing was copied (copy_ must do it)."""
    if not rows.is_contiguous():
        return False
    if nbytes is None:
        nbytes = rows.numel() * rows.element_size()
    if rows.is_cpu:
        if nbytes > CPU_MOST:
            return False
        _memmove(address, rows.data_ptr(), nbytes)
        return True
    if not rows.is_cuda or disabled is not None or (not _driver and not _load()):
        return False
    memcpy, current_device, raw_stream = _driver
    device = rows.get_device()
    if device != current_device():  # the driver copies in the current device's context
        return False
    if nbytes:
        error = memcpy(address, rows.data_ptr(), nbytes, raw_stream(device))
        if error:
            disable(f"cuMemcpyDtoDAsync returned CUDA error {error}")
            return False
    return True


def _load() -> bool:
    try:
        memcpy = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
        memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        _driver[:] = [memcpy, torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream]
    except (OSError, AttributeError) as exc:  # no driver library, or a torch without CUDA
        disable(f"the CUDA driver cannot be called here ({exc})")
        return False
    return True


def disable(why: str) -> None:
    """GPU rows take copy_ from now on in this process; said once."""
    global disabled
    if disabled is None:
        disabled = why
        log.warning("dumper: GPU staging copies fall back to torch's copy_ (slower): %s", why)
