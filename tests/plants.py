"""Decode-only state bugs planted in HF models, the kind a page table or a layer index mix-up
makes. Each acts in generate's decode steps only (one new token row), so the reference prefill
stays clean and the verdict must name the layer that holds the bug."""

from __future__ import annotations

import torch

PAGE = 16  # cached slots in one page


def _cache_of(kwargs):
    return kwargs.get("cache", kwargs.get("past_key_values"))  # renamed in transformers 5.2x


def _decoding(args, kwargs) -> bool:
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden is not None and hidden.shape[1] == 1


def plant_kv_page(model, layer: int, page: int = PAGE, seed: int = 0):
    """At the first decode step, one page of ``page`` cached slots of ``layer`` (keys and values)
    holds another page's contents: the page the table should have pointed to is replaced by the
    one before it. The page is the last whole page of the prompt, real tokens in every row of a
    left-padded batch."""
    attn = model.model.layers[layer].self_attn
    state = {"done": False}

    def corrupt(module, args, kwargs):
        cache = _cache_of(kwargs)
        if state["done"] or cache is None or not _decoding(args, kwargs):
            return
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        length = keys.shape[2]
        start = (length // page - 1) * page
        if start < page:
            return
        for held in (keys, values):
            held[:, :, start:start + page] = held[:, :, start - page:start].clone()
        state["done"] = True

    return attn.register_forward_pre_hook(corrupt, with_kwargs=True)
