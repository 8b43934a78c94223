"""Dump+analyze a trained tiny model (adapted from /tmp/fp-hunt/hunt.py).
python tm.py --model llama --dtype float32 --mode single|padded [--plant ...] [--keep]"""
import argparse, json, os, shutil, subprocess, sys, time
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/fp-hunt")
import torch
import dumper
from hunt import plant  # noqa: decode-only plants, unchanged
BOS = bool(os.environ.get('BOS'))
PY = "/work/main/.venv/bin/python"
TEXT = open("/usr/lib/python3/dist-packages/" + "six.py", "rb").read() if os.path.exists("/usr/lib/python3/dist-packages/six.py") else None

def text_prompt(length, seed):
    import glob
    files = sorted(glob.glob("/usr/lib/python3/dist-packages/**/*.py", recursive=True))
    src = open(files[(seed * 7919) % len(files)], "rb").read()
    while len(src) < length + 10:
        src += src
    start = (seed * 131) % (len(src) - length)
    return ([1] if BOS else []) + [b + 3 for b in src[start:start + length - (1 if BOS else 0)]]

def load(name, dtype, attn=None):
    from transformers import AutoModelForCausalLM
    kw = {"attn_implementation": attn} if attn else {}
    m = AutoModelForCausalLM.from_pretrained(f"/tmp/tm/models/{name}", dtype=getattr(torch, dtype), **kw).eval()
    m.generation_config.eos_token_id = None; m.generation_config.pad_token_id = 0
    return m

def dump(model, root, mode, new, seed, plen):
    handle = dumper.install(model, dumper.DumperConfig(dir=root, enable=True, exp_name="dec", cleanup_previous=True))
    try:
        with torch.no_grad():
            if mode == "padded":
                lengths = [plen // 3 + 1, plen // 2 + 5, plen]
                prompts = [text_prompt(n, seed * 10 + i) for i, n in enumerate(lengths)]
                width = max(map(len, prompts))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = torch.zeros_like(ids)
                for i, p in enumerate(prompts):
                    mask[i, width - len(p):] = 1
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0, do_sample=False)
                handle.configure(exp_name="ref")
                for p, row in zip(prompts, out):
                    model(torch.tensor([p + row[width:].tolist()]))
            else:
                ids = torch.tensor([text_prompt(plen, seed)])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, pad_token_id=0, do_sample=False)
                handle.configure(exp_name="ref")
                model(out)
    finally:
        handle.remove()
    gen = bytes([max(0, t - 3) for t in out[-1, -new:].tolist()])
    return os.path.join(root, "ref"), os.path.join(root, "dec"), gen

def analyze(ref, dec):
    p = subprocess.run([PY, "-m", "analyzer.cli", "first-divergence", ref, dec, "--format", "json", "--no-progress"],
                       cwd="/work/main", capture_output=True, text=True, timeout=900)
    try:
        res = json.loads(p.stdout)
    except Exception:
        return {"exit": p.returncode, "error": (p.stderr or p.stdout)[-800:]}
    r = res.get("ranks", {}).get("0", {})
    noise = r.get("noise", {}) or {}
    culprits = [{k: c.get(k) for k in ("call", "cls", "rows", "kinds", "in_err", "out_err", "amplification",
                                       "gap_after", "gap_before", "inside_err") if c.get(k) is not None}
                for c in noise.get("culprits", [])]
    return {"exit": p.returncode, "culprits": culprits, "rule": noise.get("rule"), "top_jumps": noise.get("top_jumps", [])[:8],
            "strict_culprit": (res.get("culprit") or {}).get("call"), "summary": (r.get("summary") or "")[:700]}

def stale(model, spec):
    """stale:L:pos: at the first decode step, layer L's cached key and value at pos are replaced by
    those of pos-1 (a stale slot: the previous token's entry), once."""
    _, layer, position = spec.split(":"); layer, position = int(layer), int(position)
    def corrupt(module, a, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or getattr(cache, "_corrupted", False) or not hasattr(cache, "layers"):
            return
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[-1] != 1:
            return
        lay = cache.layers[layer]
        for t in (lay.keys, lay.values):
            t[:, :, position, :] = t[:, :, position - 1, :]
        cache._corrupted = True
    model.register_forward_pre_hook(corrupt, with_kwargs=True)
    return f"stale kv layer {layer} pos {position}"

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama"); ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mode", default="single"); ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--plen", type=int, default=96); ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn", default=None); ap.add_argument("--plant", default=None)
    ap.add_argument("--keep", action="store_true"); ap.add_argument("--out", default="/tmp/tm/results.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tag = f"{a.model}-{a.dtype}-{a.mode}-n{a.new}-p{a.plen}-s{a.seed}" + (f"-{a.attn}" if a.attn else "") + (f"-P{a.plant}" if a.plant else "")
    root = f"/tmp/tm/dumps/{tag.replace(':', '_')}"
    model = load(a.model, a.dtype, a.attn)
    planted = (stale(model, a.plant) if a.plant.startswith("stale") else plant(model, a.plant)) if a.plant else None
    t = time.time()
    ref, dec, gen = dump(model, root, a.mode, a.new, a.seed, a.plen)
    rec = {"tag": tag, "args": vars(a), "planted": planted, "gen": gen.decode("latin1"), "dump_s": round(time.time() - t, 1),
           "dump_mb": round(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs) / 1e6, 1)}
    rec["res"] = analyze(ref, dec)
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    r = rec["res"]
    print(tag, "| gen", repr(rec["gen"]), "| exit", r.get("exit"), "| strict", r.get("strict_culprit"))
    print("   culprits:", r.get("error") or [(c["call"], c.get("gap_before"), c["rows"], round(c["amplification"], 1)) for c in r["culprits"]])
    rule = r.get("rule") or {}
    print("   top:", [(j["call"], round(j["amplification"], 1), j.get("gap", False)) for j in (r.get("top_jumps") or [])[:5]],
          "line", rule.get("amplification"), "16bit", rule.get("clean_input_16bit"), "gapline", rule.get("gap_amplification"))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)

if __name__ == "__main__":
    main()
