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

Beam search moves rows between sequences: after each step ``generate`` reorders the cache so
batch row i continues the beam that row ``beam_idx[i]`` held. Keyed by batch row alone, such a
row would carry another beam's history and pair with a reference row of a context it never
computed. The adapter stands in for the model's ``_reorder_cache`` (the hook ``generate`` asks
for first) and gives a row that took another row's beam a new sequence key, with that beam's
token ids as its prefix.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import weakref
from typing import List, Optional, Tuple

import torch

from ..passinfo import PassInfo, mode_of
from .generic import _param_device, _param_dtype, dense_pass


def is_hf_model(model) -> bool:
    return any(
        cls.__module__.startswith("transformers.") and cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__
    )


@dataclasses.dataclass
class _CacheState:
    """What the adapter knows of one cache object (one sequence group)."""

    group: str
    fed: int = 0  # tokens that went through it
    next_pos: Optional[torch.Tensor] = None  # each batch row's next position
    reports: bool = False  # it has reported a length (it keeps keys)
    names: Optional[List[str]] = None  # each batch row's sequence key
    history: Optional[List[Optional[List[int]]]] = None  # each row's token ids from position 0 (None: unknown)
    moved: Optional[List[int]] = None  # a reorder since the last pass: row i now holds row moved[i]'s beam
    forks: int = 0
    inherited: bool = False  # the history came from the cache this one is a copy of: say it once

    def rows(self, batch: int) -> Tuple[List[str], dict]:
        """Each batch row's sequence key for the next pass, and the prefix ids of rows that took
        over another row's beam (a new sequence whose history is that beam's), or that go on
        from a copied cache's history."""
        if self.names is None or len(self.names) != batch:
            self.names = [f"{self.group}.{b}" for b in range(batch)]
            self.history = [[] for _ in range(batch)]  # a row's first pass past position 0 makes it unknown
            self.moved = None
        prefixes = {}
        if self.inherited:
            self.inherited = False
            prefixes = {name: list(ids) for name, ids in zip(self.names, self.history) if ids}
        if self.moved is not None and len(self.moved) == batch:
            names, history = list(self.names), list(self.history)
            for row, parent in enumerate(self.moved):
                if parent != row:
                    self.forks += 1
                    names[row] = f"{self.group}.{row}~{self.forks}"
                    history[row] = None if self.history[parent] is None else list(self.history[parent])
                    if history[row] is not None:
                        prefixes[names[row]] = list(history[row])
            self.names, self.history = names, history
        self.moved = None
        return self.names, prefixes

    def extend(self, ids: torch.Tensor, pos: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Add a pass's token ids to each row's history, which stays known only while each pass
        continues it at the next position."""
        for row, known in enumerate(self.history):
            keep = valid[row] if valid is not None else slice(None)
            row_ids, row_pos = ids[row][keep].tolist(), pos[row][keep].tolist()
            if (
                known is not None
                and row_pos
                and row_pos[0] == len(known)
                and min(row_ids) >= 0
                and row_pos == list(range(row_pos[0], row_pos[0] + len(row_pos)))
            ):  # (-1: from inputs_embeds, ids unknown)
                known.extend(row_ids)
            elif row_pos:
                self.history[row] = None

    def history_copy(self) -> Optional[List[Optional[List[int]]]]:
        """Each row's ids, in lists of their own: a state that goes on from this one must not
        grow this one's history."""
        return None if self.history is None else [None if ids is None else list(ids) for ids in self.history]

    def reorder(self, beam_idx) -> None:
        order = [int(i) for i in beam_idx.tolist()]
        self.moved = order if self.moved is None else [self.moved[i] for i in order]


class HFAdapter:
    engine = "hf"

    def __init__(self, model) -> None:
        self._signature = inspect.signature(model.forward)
        # the **catch-all's own name (a patched forward may call it **kw): names passed through it
        self._var_keyword = next(
            (p.name for p in self._signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        self._caches = weakref.WeakKeyDictionary()  # cache object -> _CacheState
        self._counter = itertools.count(1)
        self._last: Optional[_CacheState] = None  # the state of the pass being dumped

    def attach(self, model) -> None:
        """Stand in for ``_reorder_cache``, which ``generate``'s beam search calls when a model has
        one (the few that define their own keep it, and their beams are not followed)."""
        if not hasattr(model, "_reorder_cache"):
            model._reorder_cache = self._reorder_cache

    def detach(self, model) -> None:
        if model.__dict__.get("_reorder_cache") == self._reorder_cache:
            del model._reorder_cache

    def _reorder_cache(self, cache, beam_idx):
        if not callable(getattr(cache, "reorder_cache", None)):  # as generate says without the stand-in
            raise ValueError(f"{type(cache).__name__} cannot be reordered, so beam search cannot use it")
        state = self._known(cache)
        if state is not None:
            state.reorder(beam_idx)
        cache.reorder_cache(beam_idx)
        return cache

    def capture_shape(self, model, args, kwargs) -> List[int]:
        """[B, S] of a forward captured into a CUDA graph, from shapes alone (no sync)."""
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        if self._var_keyword:
            bound.update(bound.pop(self._var_keyword, None) or {})
        for name in ("decoder_input_ids", "input_ids"):
            if bound.get(name) is not None:
                return list(bound[name].shape)
        if bound.get("inputs_embeds") is not None:
            return list(bound["inputs_embeds"].shape[:2])
        raise ValueError("HF forward captured without input_ids or inputs_embeds")

    def pass_info(self, model, args, kwargs) -> PassInfo:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        if self._var_keyword:  # names passed through the forward's **catch-all
            bound.update(bound.pop(self._var_keyword, None) or {})
        # an encoder-decoder's rows are its decoder's: generate runs the encoder itself, then
        # calls forward with decoder_input_ids and encoder_outputs only
        decoder = bound.get("decoder_input_ids") is not None
        ids = bound.get("decoder_input_ids" if decoder else "input_ids")
        mask = bound.get("decoder_attention_mask" if decoder else "attention_mask")
        cache = _first(bound, CACHE_NAMES)
        if ids is None:
            embeds = bound.get("inputs_embeds")
            if embeds is None:
                raise ValueError("dumper: HF forward called without input_ids or inputs_embeds")
            ids = torch.full(embeds.shape[:2], -1, dtype=torch.long)  # unknown ids: not alignable
        ids = ids.detach().cpu()
        batch, seq_len = ids.shape
        state, past = self._state_and_past(cache)
        state.fed = past + seq_len
        pos, valid = self._positions(bound, mask, past, batch, seq_len, state.next_pos)
        if seq_len:
            state.next_pos = pos[:, -1] + 1
        keys, prefixes = state.rows(batch)
        state.extend(ids, pos, valid)
        self._last = state
        info = dense_pass(
            ids, state.group, mode_of(past, past, seq_len), pos=pos, valid=valid, prefix_ids=prefixes, keys=keys
        )
        info.extra = {"past_len": past, "new_len": seq_len}
        return info

    def _state_and_past(self, cache):
        """The cache's state and the tokens already in it: its own length when it keeps keys; the
        tokens counted through it when it has never reported one (state kept elsewhere). A cache
        that did report a length and now says 0 was reset: a new sequence (and group) starts."""
        state = self._known(cache)
        length = _cache_length(cache)
        if state is None and length:
            state = self._copy_of_known(cache, length)
        if state is None or (state.reports and not length):
            state = self._register(cache, _CacheState(f"g{next(self._counter)}"))
        if length:
            state.reports = True
            return state, length
        return state, state.fed

    def _copy_of_known(self, cache, length: int) -> Optional[_CacheState]:
        """A filled cache never seen before that holds what a followed one holds: a copy (HF's
        prompt reuse, generate(past_key_values=copy.deepcopy(prompt_cache))). Its sequences go on
        from that history, under a new group; else its rows would start at an unknown prefix."""
        known = sorted(self._caches.items(), key=lambda item: not all(item[1].history or [None]))  # known ids first
        for other, state in known:
            if state.history and _cache_length(other) == length and _same_keys(other, cache):
                copied = _CacheState(
                    f"g{next(self._counter)}",
                    fed=state.fed,
                    reports=True,
                    inherited=True,
                    next_pos=None if state.next_pos is None else state.next_pos.clone(),
                    history=state.history_copy(),
                )
                copied.names = [f"{copied.group}.{b}" for b in range(len(copied.history))]
                return self._register(cache, copied)
        return None

    def _known(self, cache) -> Optional[_CacheState]:
        try:
            return self._caches.get(cache) if cache is not None else None
        except TypeError:  # not weak-referenceable: every pass is its own group
            return None

    def _register(self, cache, state: _CacheState) -> _CacheState:
        try:
            if cache is not None:
                self._caches[cache] = state
        except TypeError:
            pass
        return state

    def _positions(self, bound, mask, past, batch, seq_len, next_pos=None):
        mask = _full_attention_mask(mask)
        valid = (
            _own_slot_visible(mask, bound, past, batch, seq_len)
            if isinstance(mask, torch.Tensor) and mask.dim() == 4
            else None
        )
        if valid is not None and not past:  # a prefill: the padding the 4D mask hides is all the history there is
            mask = valid.to(torch.long)
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
                if value.dim() == 3:  # multimodal RoPE ([3 or 4, batch, seq]): the first is the text position
                    value = value[0]
                return value.reshape(-1, seq_len).expand(batch, seq_len), valid
        if next_pos is not None and len(next_pos) == batch:
            return next_pos[:, None] + torch.arange(seq_len), valid
        return (torch.arange(seq_len) + past).expand(batch, seq_len), valid

    def after_pass(self, model, info: PassInfo, output) -> None:
        # A forward called without a cache creates one; the next call may pass it back in.
        cache = None if isinstance(output, tuple) else _first(output, CACHE_NAMES, getattr)
        last, self._last = self._last, None
        if cache is not None and info.seq and self._known(cache) is None and last is not None:
            self._register(
                cache,
                dataclasses.replace(  # its sequences go on in the returned cache
                    last, names=None if last.names is None else list(last.names), history=last.history_copy()
                ),
            )

    def run_info(self, model) -> dict:
        config = getattr(model, "config", None)
        return {
            "model": getattr(config, "_name_or_path", "") or type(model).__name__,
            "model_type": getattr(config, "model_type", None),
            "num_layers": getattr(config, "num_hidden_layers", None),
            "dtype": _param_dtype(model),
            "device": _param_device(model),
            "tp_size": 1,
        }


# transformers renamed past_key_values to cache (5.2x); both spellings are read, and Mamba's.
CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def _first(source, names, get=lambda d, k, default: d.get(k, default)):
    for name in names:
        value = get(source, name, None)
        if value is not None:
            return value
    return None


def _full_attention_mask(mask):
    """A model with per-layer attention types gets one 4D mask per type from generate (a dict):
    the full-attention one, else the first 4D tensor. Anything else passes through."""
    if not isinstance(mask, dict):
        return mask
    tensors = [m for m in mask.values() if isinstance(m, torch.Tensor) and m.dim() == 4]
    full = mask.get("full_attention")
    return full if isinstance(full, torch.Tensor) and full.dim() == 4 else (tensors[0] if tensors else None)


def _own_slot_visible(mask: torch.Tensor, bound, past: int, batch: int, seq_len: int) -> Optional[torch.Tensor]:
    """[B, S]: whether each token attends to its own cache slot in a 4D attention mask (bool:
    True attends; additive: 0 attends). A static cache gets such a mask from generate instead of
    the 2D one, and a padding token is the one key nobody, itself included, may see. None when
    the mask does not have that layout."""
    if not seq_len or mask.shape[-2] != seq_len or mask.shape[1] != 1 or mask.shape[0] not in (1, batch):
        return None
    slots = bound.get("cache_position")
    slots = (
        slots.detach().cpu().to(torch.long).reshape(-1)
        if isinstance(slots, torch.Tensor) and slots.numel() == seq_len
        else torch.arange(seq_len) + past
    )
    if int(slots.max()) >= mask.shape[-1]:
        return None
    rows = mask[:, 0, torch.arange(seq_len).to(mask.device), slots.to(mask.device)].detach().cpu()
    return (rows if rows.dtype == torch.bool else rows == 0).expand(batch, seq_len)


def _same_keys(first, second) -> bool:
    """Whether two caches hold the same keys in every layer (transformers 5's cache.layers; a
    sliding-window layer alone holds only the last tokens, so one layer is not enough)."""
    try:
        layers = list(zip(first.layers, second.layers))
        return (
            bool(layers)
            and len(first.layers) == len(second.layers)
            and all(a.keys.shape == b.keys.shape and bool(torch.equal(a.keys, b.keys)) for a, b in layers)
        )
    except (AttributeError, TypeError, RuntimeError):
        return False


def _cache_length(cache) -> int:
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 - no length (a state-only cache raises ValueError): counted by the adapter
        return 0
