"""FP hunt for dumpdiff's nesting-aware noise verdict (e11a082) vs the old one (7e4f2be).

One configuration per call: build a random-weight HF model, dump a (ref prefill, dec generate)
pair with /work/main's dumper (unchanged between the two commits), analyze it with both the old
analyzer (cwd /tmp/fp-hunt/old) and the new one (cwd /work/main), append a JSON line to
/tmp/fp-hunt/results.jsonl, delete the dumps.

  python hunt.py --arch llama --dtype float32 --hidden 256 --layers 4 --std 0.02 \
      --mode padded --new 16 --seed 0 [--plant mlp:1:0.01 | attn:1:0.05 | kv:1:3:0.5] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, "/work/main")
sys.path.insert(0, "/work/main/examples")
import torch  # noqa: E402

import dumper  # noqa: E402

PY = "/work/main/.venv/bin/python"
OLD, NEW = "/tmp/fp-hunt/old", "/tmp/fp-hunt/new"
VOCAB = 1024


def build(arch, hidden, layers, std, dtype, seed, attn_impl=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    heads = 4 if hidden <= 128 else 8
    hd = hidden // heads
    kw = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=hidden,
              num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden,
              max_position_embeddings=512, initializer_range=std)
    gqa = dict(num_key_value_heads=max(1, heads // 2))
    extra = {
        "llama": gqa, "qwen2": gqa, "mistral": {**gqa, "sliding_window": 4096}, "phi3": gqa, "olmo2": gqa,
        "starcoder2": gqa, "cohere": gqa, "granite": gqa, "stablelm": gqa,
        "qwen3": {**gqa, "head_dim": hd},
        "gemma2": {**gqa, "head_dim": hd, "sliding_window": 16, "query_pre_attn_scalar": hd},
        "gemma3_text": {**gqa, "head_dim": hd, "sliding_window": 16, "query_pre_attn_scalar": hd},
        "mixtral": {**gqa, "num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen3_moe": {**gqa, "head_dim": hd, "moe_intermediate_size": hidden // 2, "num_experts": 4,
                      "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []},
        "olmoe": {**gqa, "num_experts": 4, "num_experts_per_tok": 2},
        "gpt2": dict(n_positions=512, n_inner=2 * hidden),
        "gpt_neox": dict(),
        "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=False),
        "bloom": dict(),
        "opt": dict(ffn_dim=2 * hidden, word_embed_proj_dim=hidden, init_std=std),
        "phi": dict(),
    }[arch]
    cfg = AutoConfig.for_model(arch, **kw, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, **({"attn_implementation": attn_impl} if attn_impl else {}))
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def layer_modules(model):
    """name of each decoder layer, in order."""
    found = {}
    for name, _ in model.named_modules():
        m = re.fullmatch(r"(.*\.(?:layers|h))\.(\d+)", name)
        if m:
            found[int(m.group(2))] = name
    return [found[i] for i in sorted(found)]


def sub(model, layer_name, kinds):
    for kind in kinds:
        name = f"{layer_name}.{kind}"
        try:
            model.get_submodule(name)
            return name
        except AttributeError:
            continue
    raise SystemExit(f"no {kinds} under {layer_name}")


def plant(model, spec):
    """mlp:L:scale / attn:L:scale: decode-only (1-token calls) relative error at the module output.
    kv:L:pos:delta: at the first decode step, cached key at pos of layer L += delta (once)."""
    kind, *args = spec.split(":")
    layers = layer_modules(model)
    if kind in ("mlp", "attn"):
        layer, scale = int(args[0]), float(args[1])
        path = sub(model, layers[layer], ["mlp", "block_sparse_moe", "feed_forward", "fc2"] if kind == "mlp"
                   else ["self_attn", "attn", "attention", "self_attention"])

        def perturb(module, a, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.shape[-2] != 1 or hidden.dim() < 3 and hidden.shape[0] != 1:
                return None
            hidden = hidden * (1 + scale)
            return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
        model.get_submodule(path).register_forward_hook(perturb)
        return path
    if kind == "kv":
        layer, position, delta = int(args[0]), int(args[1]), float(args[2])

        def corrupt(module, a, kwargs):
            cache = kwargs.get("past_key_values")
            if cache is None or getattr(cache, "_corrupted", False) or not hasattr(cache, "layers"):
                return
            ids = kwargs.get("input_ids")
            if ids is None or ids.shape[-1] != 1:
                return
            keys = getattr(cache.layers[layer], "keys", None)
            if keys is not None and keys.dim() == 4 and keys.shape[2] > position:
                keys[:, :, position, :] += delta
                cache._corrupted = True
        model.register_forward_pre_hook(corrupt, with_kwargs=True)
        return f"kv cache layer {layer} pos {position}"
    raise SystemExit(spec)


def prompt(length, seed):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))[0].tolist()


def dump(model, root, mode, new, seed, plen):
    handle = dumper.install(model, dumper.DumperConfig(dir=root, enable=True, exp_name="dec", cleanup_previous=True))
    try:
        with torch.no_grad():
            sample = dict(do_sample=True, top_k=0, temperature=1.0) if "sample" in mode else dict(do_sample=False)
            torch.manual_seed(seed)
            if mode.startswith("padded"):
                lengths = [plen // 4 + 1, plen // 2 + 3, plen, plen // 3 + 2]
                prompts = [prompt(n, seed * 100 + n) for n in lengths]
                width = max(map(len, prompts))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = (ids != 0).long()
                for i, p in enumerate(prompts):
                    mask[i, width - len(p):] = 1
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0, **sample)
                handle.configure(exp_name="ref")
                for p, row in zip(prompts, out):
                    model(torch.tensor([p + row[width:].tolist()]))
            else:
                ids = torch.tensor([prompt(plen, seed)])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, pad_token_id=0,
                                     **sample)
                handle.configure(exp_name="ref")
                model(out)
    finally:
        handle.remove()
    return os.path.join(root, "ref"), os.path.join(root, "dec")


def analyze(cwd, ref, dec):
    t = time.time()
    p = subprocess.run([PY, "-m", "analyzer.cli", "first-divergence", ref, dec, "--format", "json", "--no-progress"],
                       cwd=cwd, capture_output=True, text=True, timeout=900)
    try:
        res = json.loads(p.stdout)
    except Exception:
        return {"exit": p.returncode, "error": (p.stderr or p.stdout)[-800:]}
    r = res.get("ranks", {}).get("0", {})
    noise = r.get("noise", {}) or {}
    culprits = [{k: c.get(k) for k in ("call", "cls", "rows", "kinds", "in_err", "out_err", "amplification",
                                       "gap_after", "gap_before", "inside_err") if c.get(k) is not None}
                for c in noise.get("culprits", [])]
    jumps = noise.get("top_jumps", [])
    return {"exit": p.returncode, "secs": round(time.time() - t, 1), "culprits": culprits,
            "rule": noise.get("rule"), "top_jumps": jumps[:8], "strict_culprit": (res.get("culprit") or {}).get("call"),
            "summary": (r.get("summary") or "")[:600]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--mode", default="single", help="single | padded | sample | padded-sample")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--plen", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn", default=None)
    ap.add_argument("--plant", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default="/tmp/fp-hunt/results.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tag = f"{a.arch}-{a.dtype}-h{a.hidden}-L{a.layers}-std{a.std}-{a.mode}-n{a.new}-s{a.seed}" + \
        (f"-{a.attn}" if a.attn else "") + (f"-P{a.plant}" if a.plant else "")
    root = f"/tmp/fp-hunt/dumps/{tag.replace(':', '_')}"
    model = build(a.arch, a.hidden, a.layers, a.std, a.dtype, a.seed, a.attn)
    planted = plant(model, a.plant) if a.plant else None
    t = time.time()
    ref, dec = dump(model, root, a.mode, a.new, a.seed, a.plen)
    rec = {"tag": tag, "args": vars(a), "planted": planted, "dump_s": round(time.time() - t, 1),
           "dump_mb": round(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs) / 1e6, 1)}
    rec["old"] = analyze(OLD, ref, dec)
    rec["new"] = analyze(NEW, ref, dec)
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    short = lambda r: r.get("error") or [(c["call"], c.get("gap_before"), round(c["amplification"], 1)) for c in r["culprits"]]
    print(tag, "| dump", rec["dump_mb"], "MB | old exit", rec["old"]["exit"], short(rec["old"]),
          "| new exit", rec["new"]["exit"], short(rec["new"]))
    tj = rec["new"].get("top_jumps") or []
    print("   new top:", [(j["call"], round(j["amplification"], 1), j.get("gap", False)) for j in tj[:4]],
          "line", (rec["new"].get("rule") or {}).get("amplification"))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
