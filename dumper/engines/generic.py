"""Adapter for any torch.nn.Module: token rows from its token-id argument, positions from its
position argument.

The forward's arguments are matched to its parameter names. Token ids: the argument named
input_ids, ids, tokens, token_ids or idx, else the first integer tensor ([B, S] or [T]; not a
bool mask). Positions: position_ids, positions, cache_position or input_pos (a tensor like
the ids), or start_pos / start / offset (a number: the first row's position, as in llama's
reference code). With positions, one dump's passes continue each batch row's sequence (a
decode step after its prefill), so decode rows pair with a reference prefill. Without them
every forward is a fresh prefill at positions 0..S-1, right for a plain prefill. A forward
that gets a cache or state (past_key_values, cache, kv_cache, state, ...) but no positions,
or whose positions restart within a row (packed sequences), cannot be placed: it is dumped
with no alignable rows (with a warning), never at guessed positions. Anything else needs an
adapter of one's own: dumper.install(model, adapter=...) with a pass_info(model, args,
kwargs) that returns a PassInfo (see dense_pass).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from typing import Optional

import torch

from ..passinfo import PassInfo, UndescribedPass

TOKEN_NAMES = ("input_ids", "ids", "tokens", "token_ids", "idx")
POSITION_NAMES = ("position_ids", "positions", "cache_position", "input_pos")
START_NAMES = ("start_pos", "start", "offset")
# arguments that carry earlier tokens' state (a flag such as use_cache=False does not)
STATE_NAMES = (
    "past_key_values",
    "past_key_value",
    "past",
    "cache",
    "caches",
    "kv_cache",
    "kv_caches",
    "cache_params",
    "state",
    "states",
    "inference_params",
)

log = logging.getLogger("dumper")


def _token_like(value) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
        and value.dim() in (1, 2)
    )


def first_token_tensor(args, kwargs):
    for value in itertools.chain(args, kwargs.values()):
        if _token_like(value):
            return value
    return None


def dense_pass(ids: torch.Tensor, group: str, mode: str, pos=None, valid=None, prefix_ids=None, keys=None) -> PassInfo:
    """PassInfo for a [B, S] (or [S]) batch: row b*S+s is sequence ``keys[b]``, by default f'{group}.{b}'."""
    ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
    batch, seq_len = ids2.shape
    if pos is None:
        pos = torch.arange(seq_len).expand(batch, seq_len)
    if valid is None:
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
    keys = keys or [f"{group}.{b}" for b in range(batch)]
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

    def __init__(self, model) -> None:
        self._passes = 0
        self._warned = False
        try:
            self._signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self._signature = None

    def _named(self, args, kwargs) -> dict:
        """The call's arguments by parameter name (positional ones as #i where unnamed)."""
        if self._signature is not None:
            try:
                bound = self._signature.bind_partial(*args, **kwargs).arguments
                named = {}
                for name, value in bound.items():
                    kind = self._signature.parameters[name].kind
                    if kind is inspect.Parameter.VAR_KEYWORD:
                        named.update(value)
                    elif kind is inspect.Parameter.VAR_POSITIONAL:
                        named.update((f"#{i}", v) for i, v in enumerate(value))
                    else:
                        named[name] = value
                return named
            except TypeError:
                pass
        return {**{f"#{i}": value for i, value in enumerate(args)}, **kwargs}

    def pass_info(self, model, args, kwargs) -> PassInfo:
        self._passes += 1
        named = self._named(args, kwargs)
        ids = next((named[n] for n in TOKEN_NAMES if _token_like(named.get(n))), None)
        ids = ids if ids is not None else first_token_tensor(named.values(), {})
        if ids is None:
            raise UndescribedPass(
                f"no token ids among the arguments of {type(model).__name__}.forward (an integer "
                "tensor named input_ids, ids or tokens); give dumper.install(model, adapter=...) "
                "an adapter whose pass_info returns a PassInfo"
            )
        ids = ids.detach().cpu()
        pos = _positions(named, ids)
        if pos is not None and bool((pos[:, 1:] <= pos[:, :-1]).any()):
            return self._unplaced(model, ids, "packs several sequences in a row (its positions restart)")
        if pos is not None:  # one dump's passes continue each row's sequence
            mode = "prefill" if int(pos.min()) == 0 else "decode" if ids.shape[-1] == 1 else "extend"
            return dense_pass(ids, "s", mode, pos=pos)
        state = next(
            (n for n in STATE_NAMES if named.get(n) is not None and not isinstance(named[n], (bool, int, float, str))),
            None,
        )
        if state is not None:
            return self._unplaced(model, ids, f"gets {state!r} but no positions")
        return dense_pass(ids, f"p{self._passes}", "prefill")

    def _unplaced(self, model, ids: torch.Tensor, why: str) -> PassInfo:
        """A pass whose rows cannot be placed: dumped with no alignable row, never at guessed positions."""
        if not self._warned:
            self._warned = True
            log.warning(
                "dumper: %s.forward %s: its token rows cannot be placed and are dumped unaligned; pass "
                "position_ids= (or start_pos=) to forward, or give dumper.install(model, adapter=...)",
                type(model).__name__,
                why,
            )
        ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
        return dense_pass(ids, f"p{self._passes}", "unknown", valid=torch.zeros(ids2.shape, dtype=torch.bool))

    def after_pass(self, model, info, output) -> None:
        pass

    def run_info(self, model) -> dict:
        return {"model": type(model).__name__, "dtype": _param_dtype(model), "device": _param_device(model)}


def _positions(named: dict, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Each row's position, shaped like the ids as [B, S], from a positions argument; None when the
    forward gets none."""
    ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
    for name in POSITION_NAMES:
        value = named.get(name)
        if (
            isinstance(value, torch.Tensor)
            and not value.is_floating_point()
            and value.numel() in (ids2.shape[1], ids2.numel())
        ):
            return value.detach().cpu().reshape(-1, ids2.shape[1]).expand(ids2.shape).to(torch.int64)
    for name in START_NAMES:
        value = named.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return (value + torch.arange(ids2.shape[1])).expand(ids2.shape)
    return None


def _param_dtype(model) -> str:
    for param in model.parameters():
        return str(param.dtype).replace("torch.", "")
    return "unknown"


def _param_device(model) -> str:
    for param in model.parameters():
        return str(param.device)
    return "unknown"
