"""Between torch tensors and the numpy bits the analyzer works on (torch imported on first use:
the first-divergence path never needs it)."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .dtypes import DType, of_torch

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy types torch.from_numpy accepts


def from_torch(tensor) -> Tuple[np.ndarray, DType]:
    """A torch tensor -> (its elements as unsigned-int bits in numpy, same shape; its DType)."""
    import torch

    dtype = of_torch(tensor.dtype)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.size]
    flat = tensor.detach().cpu().contiguous()
    return flat.view(signed).numpy().view(dtype.bits), dtype


def to_torch(bits: np.ndarray, dtype: DType):
    """Bits held in numpy -> a torch tensor of the element type (sharing memory)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(_SIGNED[dtype.size])).view(getattr(torch, dtype.name))
