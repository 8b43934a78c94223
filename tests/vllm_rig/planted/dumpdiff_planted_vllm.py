"""Test-only vLLM plugin: plant a known bug in a real vLLM server (never ship this).

DUMPDIFF_PLANT=decode_mlp:L   a decode-only error: layer L's mlp.down_proj output is scaled by
                              1 + 2**-7 in passes where every request decodes one token.
DUMPDIFF_PLANT=prefix_kv:L    a cache-restore bug: when a pass starts a request's prompt on
                              blocks restored from the prefix cache, one cached key of layer L
                              in the first restored block is corrupted (+0.5) before attention
                              reads it (once per cached block).

Without DUMPDIFF_PLANT the plugin does nothing. The model is found as dumpdiff's plugin finds
it: the first module with compute_logits that registers a child.
"""

import os

import torch

_found = {}


def load():
    spec = os.environ.get("DUMPDIFF_PLANT")
    if not spec:
        return
    kind, _, layer = spec.partition(":")
    if kind not in ("decode_mlp", "prefix_kv") or not layer.isdigit():
        raise ValueError(f"DUMPDIFF_PLANT={spec!r}: expected decode_mlp:<layer> or prefix_kv:<layer>")
    if "hook" in _found:
        return

    def on_child(parent, name, child):
        # plant once the layer exists: the decoder stack registers its children before the model does
        if "model" in _found or not hasattr(type(parent), "compute_logits") or name != "model":
            return None
        _found["model"] = parent  # the hook stays (a no-op from now): torch is iterating over the hooks
        target = child.layers[int(layer)]
        if kind == "decode_mlp":
            target.mlp.down_proj.register_forward_hook(_scale_in_decode)
        else:
            target.self_attn.attn.register_forward_pre_hook(_corrupt_restored_prefix())
        return None

    _found["hook"] = torch.nn.modules.module.register_module_module_registration_hook(on_child)


def _metadata():
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict) and metadata:
        return next(iter(metadata.values()))
    return None


def _scale_in_decode(module, args, output):
    meta = _metadata()
    if meta is None or int(meta.max_query_len) != 1:
        return None
    if isinstance(output, tuple):  # vLLM's parallel linear layers return (output, bias)
        return (output[0] * (1 + 2**-7),) + tuple(output[1:])
    return output * (1 + 2**-7)


def _corrupt_restored_prefix():
    corrupted = {}  # block -> its key row once corrupted: a block rewritten since is a new entry

    def hook(module, args):
        meta = _metadata()
        kv = getattr(module, "kv_cache", None)
        if meta is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            return
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        blocks, heads, block_size = kv.shape[0], kv.shape[1], kv.shape[2]
        keys = kv.view(blocks, heads, block_size * 2, -1)
        for i, seq_len in enumerate(seq_lens[: len(starts) - 1]):
            new = starts[i + 1] - starts[i]
            prefix = seq_len - new
            if prefix <= 0 or new <= 1:  # no restored prefix, or a decode step
                continue
            block = int(meta.block_table[i, 0])
            row = keys[block, :, min(3, prefix - 1)]
            if block not in corrupted or not bool((row == corrupted[block]).all()):
                row += 0.5
                corrupted[block] = row.clone()

    return hook
