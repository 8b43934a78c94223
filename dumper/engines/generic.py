"""Adapter for any torch.nn.Module: token rows from the first integer tensor argument.

Every forward is a fresh set of sequences at positions 0..S-1 (no cache is known), which is
right for a plain prefill and for models whose forward takes token ids as [B, S] or [T].
"""

from __future__ import annotations

import itertools

import torch

from ..passinfo import PassInfo


def first_token_tensor(args, kwargs):
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() in (1, 2):
            return value
    return None


def dense_pass(ids: torch.Tensor, group: str, mode: str, pos=None, valid=None, prefix_ids=None) -> PassInfo:
    """PassInfo for a [B, S] (or [S]) batch: row b*S+s is sequence f'{group}.{b}'."""
    ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
    batch, seq_len = ids2.shape
    if pos is None:
        pos = torch.arange(seq_len).expand(batch, seq_len)
    if valid is None:
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
    keys = [f"{group}.{b}" for b in range(batch)]
    valid_list = valid.reshape(-1).tolist()
    seq = [keys[row // seq_len] if ok else "" for row, ok in enumerate(valid_list)]
    return PassInfo(
        mode=mode,
        token_shape=list(ids.shape),
        ids=ids2.reshape(-1).tolist(),
        pos=pos.reshape(-1).tolist(),
        seq=seq,
        valid=valid_list,
        last_rows=[b * seq_len + seq_len - 1 for b in range(batch)],
        prefix_ids=prefix_ids or {},
    )


class GenericAdapter:
    engine = "torch"

    def __init__(self, model):
        self._passes = 0

    def pass_info(self, model, args, kwargs) -> PassInfo:
        self._passes += 1
        ids = first_token_tensor(args, kwargs)
        if ids is None:
            raise ValueError(
                f"dumper: cannot find token ids among the arguments of {type(model).__name__}.forward; "
                "pass an adapter to dumper.install(model, adapter=...) that returns a PassInfo")
        return dense_pass(ids.detach().cpu(), f"p{self._passes}", "prefill")

    def after_pass(self, model, info, output):
        pass

    def run_info(self, model) -> dict:
        return {"model": type(model).__name__, "dtype": _param_dtype(model), "device": _param_device(model)}


def _param_dtype(model) -> str:
    for param in model.parameters():
        return str(param.dtype).replace("torch.", "")
    return "unknown"


def _param_device(model) -> str:
    for param in model.parameters():
        return str(param.device)
    return "unknown"
