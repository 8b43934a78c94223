"""Test-only sglang plugin: plant a known bug in a real sglang server (never ship this).

DUMPDIFF_PLANT=prefix_kv:L       a cache-restore bug: when an extend pass restores a request's
                                 prefix from the radix cache, one cached key of layer L is
                                 corrupted (+0.5) before attention reads it.
DUMPDIFF_PLANT=batch_variant:L   a batch-variant kernel: layer L's mlp.down_proj output is
                                 computed differently (scaled by 1 + 2**-9) when the pass has
                                 exactly one token row, as a GEMM kernel chosen by M would.
DUMPDIFF_PLANT=q_norm:L          a decode-only error in a per-head norm: layer L's
                                 self_attn.q_norm output (Qwen3: [T*heads, head_dim]) is scaled
                                 by 1 + 2**-7 in decode passes.
DUMPDIFF_PLANT=gate_up_swap:L    a porting bug in every pass: layer L's gated activation takes
                                 the up half of gate_up_proj as the gate and the gate half as up
                                 (act(up) * gate), as a port that loads the fused weight's halves
                                 the wrong way round would.

Without DUMPDIFF_PLANT the plugin does nothing.
"""

import os

_runner = {}


def load():
    spec = os.environ.get("DUMPDIFF_PLANT")
    if not spec:
        return
    kind, _, layer = spec.partition(":")
    if kind not in ("prefix_kv", "batch_variant", "q_norm", "gate_up_swap") or not layer.isdigit():
        raise ValueError(
            f"DUMPDIFF_PLANT={spec!r}: expected prefix_kv:<layer>, batch_variant:<layer>, q_norm:<layer> or "
            "gate_up_swap:<layer>"
        )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_load(result, model_runner, *args, **kwargs):
        model_layer = model_runner.model.model.layers[int(layer)]
        if kind == "prefix_kv":
            model_layer.self_attn.attn.register_forward_pre_hook(
                _corrupt_restored_prefix(model_runner, int(layer)), with_kwargs=True
            )
        elif kind == "q_norm":
            decoding = _decode_flag(
                model_runner.model.model
            )  # the runner calls the outer model's forward: no hooks run
            model_layer.self_attn.q_norm.register_forward_hook(
                lambda module, args, output: output * (1 + 2**-7) if decoding[0] else None
            )
        elif kind == "gate_up_swap":
            model_layer.mlp.act_fn.register_forward_pre_hook(_swap_halves)
        else:
            model_layer.mlp.down_proj.register_forward_hook(_batch_variant)
        return result

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model", after_load, HookType.AFTER)


def _corrupt_restored_prefix(model_runner, layer):
    # The bug bites once per cached entry: slot -> the key it holds once corrupted.  A slot
    # whose key differs from that was rewritten (a flush hands slots out again), so it is a
    # new entry and is corrupted again on its first restore.
    corrupted = {}

    def hook(module, args, kwargs):
        batch = args[3] if len(args) > 3 else kwargs.get("forward_batch")
        prefix_lens = getattr(batch, "extend_prefix_lens_cpu", None)
        if batch is None or not batch.forward_mode.is_extend() or not prefix_lens:
            return
        keys = model_runner.token_to_kv_pool.get_key_buffer(module.layer_id)
        table = model_runner.req_to_token_pool.req_to_token
        for row, prefix in enumerate(prefix_lens):
            if prefix > 0:
                slot = int(table[batch.req_pool_indices[row], min(3, prefix - 1)])
                if slot not in corrupted or not bool((keys[slot] == corrupted[slot]).all()):
                    keys[slot] += 0.5
                    corrupted[slot] = keys[slot].clone()

    return hook


def _decode_flag(model):
    """[whether the pass running now is a decode pass], kept by a pre-hook on the decoder stack."""
    flag = [False]

    def hook(module, args, kwargs):
        batch = kwargs.get("forward_batch") or next((a for a in args if hasattr(a, "forward_mode")), None)
        flag[0] = batch is not None and batch.forward_mode.is_decode()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return flag


def _batch_variant(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    if out.shape[0] == 1:
        scaled = out * (1 + 2**-9)
        return (scaled,) + tuple(output[1:]) if isinstance(output, tuple) else scaled
    return None


def _swap_halves(module, args):
    import torch

    x = args[0]
    half = x.shape[-1] // 2
    return (torch.cat([x[..., half:], x[..., :half]], dim=-1),) + tuple(args[1:])
