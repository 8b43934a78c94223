"""HF transformers adapter: pass metadata inferred from the model's own forward arguments.

Positions come from the attention mask when there is one (real token count before each token,
so left padding does not shift them), else from position_ids, cache_position or the cache
length. Sequences are keyed by the cache object they live in: every decode step of one
``generate`` call passes the same cache, so its rows join the sequence its prefill started.

A cache that holds recurrent state and no keys (Mamba's ``cache_params``, RecurrentGemma's
layers) reports a length of 0 forever; its length is then the tokens this adapter has seen go
through it, so decode steps are decode steps, not new one-token prompts. Such models also get no
attention mask or positions in decode steps: each row's next position is remembered from the
pass before (left padding excluded), so a padded batch's decode rows keep their positions.
"""

from __future__ import annotations

import inspect
import itertools
import weakref

import torch

from ..passinfo import PassInfo, mode_of
from .generic import _param_device, _param_dtype, dense_pass


def is_hf_model(model) -> bool:
    return any(cls.__module__.startswith("transformers.") and cls.__name__ == "PreTrainedModel"
               for cls in type(model).__mro__)


class HFAdapter:
    engine = "hf"

    def __init__(self, model):
        self._signature = inspect.signature(model.forward)
        self._groups = weakref.WeakKeyDictionary()  # cache object -> sequence group
        self._fed = weakref.WeakKeyDictionary()  # cache object -> tokens that went through it
        self._next_pos = weakref.WeakKeyDictionary()  # cache object -> each batch row's next position
        self._reports = weakref.WeakKeyDictionary()  # cache object -> it has reported a length (keeps keys)
        self._counter = itertools.count(1)

    def pass_info(self, model, args, kwargs) -> PassInfo:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        bound.update(bound.pop("kwargs", None) or {})  # names passed through **kwargs
        ids = bound.get("input_ids")
        mask = bound.get("attention_mask")
        cache = _first(bound, CACHE_NAMES)
        if ids is None:
            embeds = bound.get("inputs_embeds")
            if embeds is None:
                raise ValueError("dumper: HF forward called without input_ids or inputs_embeds")
            ids = torch.full(embeds.shape[:2], -1, dtype=torch.long)  # unknown ids: not alignable
        ids = ids.detach().cpu()
        batch, seq_len = ids.shape
        past = self._past_length(cache)
        group = self._group_of(cache)
        self._weak_set(self._fed, cache, past + seq_len)
        pos, valid = self._positions(bound, mask, past, batch, seq_len, self._weak_get(self._next_pos, cache, None))
        if seq_len:
            self._weak_set(self._next_pos, cache, pos[:, -1] + 1)
        info = dense_pass(ids, group, mode_of(past, past, seq_len), pos=pos, valid=valid)
        info.extra = {"past_len": past, "new_len": seq_len}
        return info

    def _past_length(self, cache) -> int:
        """Tokens already in the cache: its own length when it keeps keys; the tokens counted
        through it when it has never reported one (state kept elsewhere). A cache that did report
        a length and now says 0 was reset: a new sequence (and sequence group) starts."""
        length = _cache_length(cache)
        if length:
            self._weak_set(self._reports, cache, True)
            return length
        if self._weak_get(self._reports, cache, False):
            for table, value in ((self._fed, 0), (self._next_pos, None), (self._groups, None), (self._reports, False)):
                self._weak_set(table, cache, value)  # and a new sequence group
            return 0
        return self._weak_get(self._fed, cache, 0)

    def _positions(self, bound, mask, past, batch, seq_len, next_pos=None):
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= seq_len:
            mask = mask.detach().cpu().to(torch.long)
            real_before = mask.cumsum(-1) - 1
            return real_before[:, -seq_len:].clamp(min=0), mask[:, -seq_len:].bool()
        for key in ("position_ids", "cache_position"):
            value = bound.get(key)
            if key == "cache_position" and next_pos is not None and len(next_pos) == batch:
                break  # cache slots count left padding; the rows' own positions do not
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().to(torch.long)
                return value.reshape(-1, seq_len).expand(batch, seq_len), None
        if next_pos is not None and len(next_pos) == batch:
            return next_pos[:, None] + torch.arange(seq_len), None
        return (torch.arange(seq_len) + past).expand(batch, seq_len), None

    def _group_of(self, cache) -> str:
        group = self._weak_get(self._groups, cache, None)
        if group is None:
            group = f"g{next(self._counter)}"  # no cache, or one not weak-referenceable: its own group
            self._weak_set(self._groups, cache, group)
        return group

    @staticmethod
    def _weak_get(table, cache, default):
        try:
            return table.get(cache, default) if cache is not None else default
        except TypeError:  # not weak-referenceable
            return default

    @staticmethod
    def _weak_set(table, cache, value):
        try:
            if cache is not None:
                table[cache] = value
        except TypeError:
            pass

    def after_pass(self, model, info: PassInfo, output):
        # A forward called without a cache creates one; the next call may pass it back in.
        cache = None if isinstance(output, tuple) else _first(output, CACHE_NAMES, getattr)
        if cache is not None and info.seq and self._weak_get(self._groups, cache, None) is None:
            group = next((s.split(".")[0] for s in info.seq if s), None)
            if group:
                self._weak_set(self._groups, cache, group)
                self._weak_set(self._fed, cache, info.extra["past_len"] + info.extra["new_len"])

    def run_info(self, model) -> dict:
        config = getattr(model, "config", None)
        return {"model": getattr(config, "_name_or_path", "") or type(model).__name__,
                "model_type": getattr(config, "model_type", None),
                "num_layers": getattr(config, "num_hidden_layers", None),
                "dtype": _param_dtype(model), "device": _param_device(model), "tp_size": 1}


# transformers renamed past_key_values to cache (5.2x); both spellings are read, and Mamba's.
CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def _first(source, names, get=lambda d, k, default: d.get(k, default)):
    for name in names:
        value = get(source, name, None)
        if value is not None:
            return value
    return None


def _cache_length(cache) -> int:
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 - no length (a state-only cache raises ValueError): counted by the adapter
        return 0
