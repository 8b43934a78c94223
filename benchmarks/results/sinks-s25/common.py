"""Red-team helpers: tiny HF models with planted massive activations and attention sinks,
dumping (in process, as tests/helpers.py does) and running dumpdiff's CLI."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import torch

MAIN = "/work/main"
sys.path.insert(0, MAIN)
import dumper  # noqa: E402

BOS, PAD = 1, 0
VOCAB = 512


def make_model(arch="llama", layers=4, hidden=256, heads=4, kv_heads=2, inter=512, seed=0,
               massive=1000.0, massive_layer=1, sink_logit=12.0, sink_from=2, sink_value_zero=True,
               channels=(17, 201), state=None, offset=0.0, head_scale=(0.6, 0.8), dc=0.0):
    """Random (or given state) model; then plant a massive activation and attention sinks.

    massive: target value of the first massive channel, in units of the median row RMS of the
    residual stream (measured before the edit). sink_logit: the planted q.k/sqrt(hd) for the BOS
    key (before other terms). sink layers: sink_from .. layers-1."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=1024,
              bos_token_id=BOS, eos_token_id=2, pad_token_id=PAD, tie_word_embeddings=False)
    if arch == "llama":
        kw["attention_bias"] = True  # a query bias: the direction every query shares
    config = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if state is not None:
        model.load_state_dict(state)
    model.config._attn_implementation = "eager"
    hd = hidden // heads
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        typical = emb[3:].norm(dim=-1).median()
        b = 100  # BOS's own channel: nothing else writes it, so the massive neuron fires on BOS only
        u = torch.zeros(hidden)
        u[b] = 1.0
        emb[:, b] = 0
        emb[BOS] = typical * u  # BOS: one direction, that the massive MLP neuron keys on
        DC = 50  # dc: a feature every token carries (channel DC = dc x the embedding RMS): queries read the sink direction from it
        if dc:
            emb[2:, DC] = dc * emb[3:].pow(2).mean().sqrt()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[b] = 0
            layer.mlp.down_proj.weight[b] = 0
            if getattr(layer.self_attn.o_proj, "bias", None) is not None:
                layer.self_attn.o_proj.bias[b] = 0
        # residual RMS scale, measured without the edit
        probe = torch.randint(3, VOCAB, (4, 64), generator=g)
        probe[:, 0] = BOS
        hs = model(probe, output_hidden_states=True).hidden_states
        rms = hs[massive_layer + 1][:, 1:].pow(2).mean(-1).sqrt().median().item()
        if massive:
            mlp = model.model.layers[massive_layer].mlp
            n = 7  # one neuron
            norm_w = model.model.layers[massive_layer].post_attention_layernorm.weight
            mlp.gate_proj.weight[n] = u / norm_w
            mlp.up_proj.weight[n] = u / norm_w
            # BOS's normalized input along u, before the edit's own effect: measure
            h_mid = {}
            hook = model.model.layers[massive_layer].post_attention_layernorm.register_forward_hook(
                lambda m, a, o: h_mid.__setitem__("x", o))
            model(probe[:, :8])
            hook.remove()
            s = (h_mid["x"][:, 0] @ mlp.gate_proj.weight[n]).mean().item()
            act = s * s / (1 + math.exp(-s))
            mlp.down_proj.weight[:, n] = 0
            target = massive * rms
            mlp.down_proj.weight[channels[0], n] = target / act
            mlp.down_proj.weight[channels[1], n] = -0.5 * target / act
            for _ in range(2):  # correct to the measured ratio (BOS value / median row RMS)
                hs = model(probe, output_hidden_states=True).hidden_states[massive_layer + 1]
                got = hs[:, 0, channels[0]].abs().mean() / hs[:, 1:].pow(2).mean(-1).sqrt().median()
                mlp.down_proj.weight[channels, n] *= massive / got
        if sink_logit:
            # BOS's normalized row is ~ sqrt(d/1.25) on channel 0, -half on channel 1
            big = math.sqrt(hidden / 1.25)
            lowfreq = hd // 2 - 1  # RoPE pair (hd/2-1, hd-1): the slowest rotation
            kappa = 2.0
            beta = sink_logit * math.sqrt(hd) / (kappa * big)
            for i in range(sink_from, layers):
                attn = model.model.layers[i].self_attn
                lnw = model.model.layers[i].input_layernorm.weight
                for kh in range(kv_heads):
                    attn.k_proj.weight[kh * hd + lowfreq, :] *= 0.1
                    attn.k_proj.weight[kh * hd + lowfreq, channels[0]] = kappa / lnw[channels[0]]
                if dc:  # the query's sink component through the GEMM, from the DC feature (measured at this layer, edits above in place)
                    cap = {}
                    hk = model.model.layers[i].input_layernorm.register_forward_hook(lambda m_, a_, o_: cap.__setitem__("x", o_))
                    model(probe)
                    hk.remove()
                    xdc = cap["x"][:, 1:, DC].median().item() * lnw[DC].item()
                for h in range(heads):  # heads differ in how strongly they sink
                    want = beta * (head_scale[0] + head_scale[1] * h / max(heads - 1, 1))
                    if dc:
                        attn.q_proj.weight[h * hd + lowfreq, :] *= 0.1
                        attn.q_proj.weight[h * hd + lowfreq, DC] = want / xdc / lnw[DC]
                    else:
                        attn.q_proj.bias[h * hd + lowfreq] = want
                if offset:  # a logit offset every key shares (a key bias), softmax-invariant: L = offset
                    lf2 = hd // 2 - 2
                    for kh in range(kv_heads):
                        if dc:
                            attn.k_proj.weight[kh * hd + lf2, :] *= 0.1
                            attn.k_proj.weight[kh * hd + lf2, DC] = 4.0 / xdc / lnw[DC]
                            attn.k_proj.weight[kh * hd + lf2, channels[0]] = 4.0 / big / lnw[channels[0]]  # BOS's key shares it
                        else:
                            attn.k_proj.bias[kh * hd + lf2] = 4.0
                    for h in range(heads):
                        if dc:
                            attn.q_proj.weight[h * hd + lf2, :] *= 0.1
                            attn.q_proj.weight[h * hd + lf2, DC] = offset * math.sqrt(hd) / 4.0 / xdc / lnw[DC]
                        else:
                            attn.q_proj.bias[h * hd + lf2] = offset * math.sqrt(hd) / 4.0
                if sink_value_zero:
                    attn.v_proj.weight[:, channels[0]] = 0
                    attn.v_proj.weight[:, channels[1]] = 0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


@torch.no_grad()
def measure(model, ids, mask=None, skip=8):
    """(outlier ratio: max |h| / median row RMS over the residual stream after every layer,
    per-layer sink mass: mean attention on the first real token over heads and query rows >= skip)."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    out = model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    model.config._attn_implementation = impl
    first = (mask.argmax(-1) if mask is not None else torch.zeros(ids.shape[0], dtype=torch.long))
    valid = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    ratios = []
    for h in out.hidden_states[1:]:
        h = h.float()
        rms = h.pow(2).mean(-1).sqrt()[valid]
        ratios.append((h.abs().amax(-1)[valid].max() / rms.median()).item())
    sinks = []
    for a in out.attentions:
        a = a.float()
        vals = []
        for b in range(ids.shape[0]):
            f = first[b].item()
            vals.append(a[b, :, f + skip:, f].mean().item())
        sinks.append(sum(vals) / len(vals))
    return max(ratios), ratios, sinks


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        p = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        p[0] = BOS
        out.append(p)
    return out


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    return ids, mask


def dump(model, root, prompts, new_tokens=16):
    """'dec' = generate (left-padded when several prompts), 'ref' = each prompt+output alone."""
    shutil.rmtree(root, ignore_errors=True)
    model.config._attn_implementation = "sdpa"
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="dec"))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=PAD)
            handle.configure(exp_name="ref")
            for prompt, row in zip(prompts, out):
                model(torch.tensor([prompt + row[width:].tolist()]))
    finally:
        handle.remove()
    return os.path.join(root, "ref"), os.path.join(root, "dec")


def analyze(ref, dec, *extra):
    proc = subprocess.run([os.path.join(MAIN, ".venv/bin/python"), "-m", "analyzer.cli", "first-divergence", ref, dec,
                           "--format", "json", "--no-progress", *extra], capture_output=True, text=True, cwd=MAIN)
    if proc.returncode not in (0, 1):
        return proc.returncode, {"error": proc.stderr[-2000:]}
    return proc.returncode, json.loads(proc.stdout)


def summarize(code, result):
    if "error" in result:
        return {"exit": code, "error": result["error"]}
    v = result["ranks"]["0"] if "ranks" in result else result
    noise = v.get("noise", {})
    culprits = [(c["call"] + (f" [gap {c.get('gap_after')}->{c.get('gap_before')}]" if c.get("gap_after") else ""),
                 c["rows"], c["kinds"], round(c["amplification"], 1), c["in_err"], c["out_err"])
                for c in noise.get("culprits", [])]
    rule = noise.get("rule", {})
    jumps = [(j["call"], round(j["amplification"], 2), j.get("gap", False)) for j in noise.get("top_jumps", [])[:4]]
    return {"exit": code, "strict": (result.get("culprit") or {}).get("call"), "rows_differing": v.get("rows_differing"),
            "line": rule.get("amplification"), "gap_line": rule.get("gap_amplification"), "culprits": culprits,
            "top_jumps": jumps}


def decode_only(module, factor):
    """Scale the module's (first) output by factor on decode passes (one token row)."""
    def hook(mod, args, output):
        first = output[0] if isinstance(output, tuple) else output
        if first.shape[1] != 1:
            return None
        return (first * factor, *output[1:]) if isinstance(output, tuple) else first * factor
    return module.register_forward_hook(hook)


def stale_slot(model, layer, slot, src, values=True):
    """At the first decode step, layer's cached key (and value) at slot <- src's (every batch row)."""
    def stale(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        lay = getattr(cache, "layers", None)
        ids = kwargs.get("input_ids")
        if lay is None or getattr(cache, "_stale", False) or ids is None or ids.shape[-1] != 1:
            return
        lay = lay[layer]
        for t in ((lay.keys, lay.values) if values else (lay.keys,)):
            t[:, :, slot, :] = t[:, :, src, :]
        cache._stale = True
    return model.register_forward_pre_hook(stale, with_kwargs=True)
