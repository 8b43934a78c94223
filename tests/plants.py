"""Decode-only state bugs planted with hooks into an HF causal LM, for the tests and for
benchmarks/noise_corpus.py.

Every plant acts only in generate's decode passes (query length 1), so the reference prefill of
prompt+output stays clean and the true culprit is known: layer L's self_attn, or its mlp.

    kv-page      at the first decode pass, 16 cached slots of layer L's K and V get the contents of
                 the 16 slots before them (a page table pointing at the wrong page)
    kv-garbage   the same page holds random values of 4x the cache's spread (memory never written
                 for this layer)
    stale-slot   at the first decode pass, one cached key of layer L moves by half the keys' std
    attn-1pct    layer L's attention output on decode passes is 1% off (10pct: 10%)
    mlp-1pct     layer L's mlp output on decode passes is 1% off (10pct: 10%)
    wrong-layer  at the first decode pass, layer L's cache gets layer L-1's K and V (a layer index
                 off by one in a cache restore)

Cache plants index slots from the end of the cache: prompts are left-padded to one width, so the
last slots hold real tokens in every row, and a sliding-window layer keeps only the last ones.
"""

from __future__ import annotations

import torch

PLANTS = ("kv-page", "kv-garbage", "stale-slot", "attn-1pct", "attn-10pct", "mlp-1pct", "mlp-10pct", "wrong-layer")


def expected_module(plant: str) -> str:
    """The module name a right verdict names in layer L."""
    return "mlp" if plant.startswith("mlp") else "self_attn"


def plant(model, kind: str, layer: int) -> list:
    """Install the bug on decoder layer ``layer``; returns the hook handles."""
    block = model.model.layers[layer]
    if kind in ("attn-1pct", "attn-10pct", "mlp-1pct", "mlp-10pct"):
        factor = 1.01 if kind.endswith("-1pct") else 1.1
        target = block.mlp if kind.startswith("mlp") else block.self_attn
        return [target.register_forward_hook(_scale_on_decode(factor))]
    edit = {
        "kv-page": _kv_page,
        "kv-garbage": lambda at: _kv_page(at, spread=4.0),
        "stale-slot": _stale_slot,
        "wrong-layer": _wrong_layer,
    }[kind](layer)
    return [block.self_attn.register_forward_pre_hook(_once_on_decode(edit), with_kwargs=True)]


def _scale_on_decode(factor: float):
    def hook(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out  # attention returns (output, weights)
        if hidden.shape[1] != 1:
            return None
        return (hidden * factor, *out[1:]) if isinstance(out, tuple) else hidden * factor

    return hook


def _once_on_decode(edit):
    """A pre-hook on an attention module: ``edit(cache.layers)`` at the first decode pass of a
    generate call. Once per cache object: generate makes a new one each call, and the damaged
    slots stay in it for the later steps, as a real corrupted cache would."""

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # renamed in transformers 5.2x
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if cache is None or hidden is None or hidden.shape[1] != 1 or getattr(cache, "_corpus_planted", False):
            return
        edit(cache.layers)
        cache._corpus_planted = True

    return hook


def _kv_page(layer: int, spread: float = 0.0):
    """Slots n-20..n-4 get the page before them, or (``spread``) random values of that many
    times the cache's spread; a short sliding window with no page before gets random values of
    the cache's own spread."""

    def edit(layers):
        for t in (layers[layer].keys, layers[layer].values):
            n = t.shape[2]
            assert n >= 24, f"a kv page plant needs 24 cached slots, layer {layer} holds {n}"
            page = t[:, :, n - 20 : n - 4]
            if n >= 36 and not spread:
                page.copy_(t[:, :, n - 36 : n - 20].clone())
            else:
                page.copy_(torch.randn_like(page) * ((spread or 1.0) * t.float().std()).to(t.dtype))

    return edit


def _stale_slot(layer: int):
    def edit(layers):
        keys = layers[layer].keys
        keys[:, :, keys.shape[2] - 10] += 0.5 * keys.float().std().to(keys.dtype)

    return edit


def _wrong_layer(layer: int):
    def edit(layers):
        # Layer L-1 already holds this step's token; layer L not yet: align the two on their last positions.
        below, here = layers[layer - 1], layers[layer]
        for src, dst in ((below.keys, here.keys), (below.values, here.values)):
            m = min(dst.shape[2], src.shape[2] - 1)
            dst[:, :, -m:] = src[:, :, -m - 1 : -1]

    return edit
