"""Launch the real sglang CPU server the rig's way, dump dec/ref pairs, analyse with /work/main.
python drive.py MODEL DTYPE PLANT(none|prefix_kv:L|batch_variant:L) SCEN[,SCEN...]"""
import json, os, shutil, subprocess, sys, time
sys.path.insert(0, "/tmp/sgt/repo/tests")
import torch
from sglang_server import SglangServer

model, dtype, plant, scens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
NEW = int(os.environ.get("NEW", 24))
mdir = f"/tmp/sgt/models/{model}"
hold = torch.load(f"{mdir}/heldout_ids.pt").tolist()
tag = f"{model}-{dtype}-{plant.replace(':', '')}"
root = f"/tmp/sgt/dumps/{tag}"
shutil.rmtree(root, ignore_errors=True)
env = {"DUMPER_ENABLE": "0", "DUMPER_SERVER_PORT": "reuse", "DUMPER_NON_INTRUSIVE_MODE": "all", "DUMPER_DIR": root}
if plant != "none":
    env["DUMPDIFF_PLANT"] = plant
extra = ["--dtype", dtype] + (["--disable-radix-cache"] if os.environ.get("NORADIX") else [])
srv = SglangServer(mdir, env=env, extra_args=extra, python="/tmp/sgt/repo/.venv/bin/python",
                   log_path=f"/tmp/sgt/logs/{tag}.log")
os.makedirs("/tmp/sgt/logs", exist_ok=True)

def ctl(**kw):
    return srv.request("/dumper/configure", kw)

def prompts_for(scen):
    if scen == "b1":
        return [hold[1000:1096]], None
    if scen == "b3":
        return [hold[3000:3033], hold[5000:5053], hold[7000:7096]], None
    if scen == "hit":  # shared 64-byte prefix warmed first, three suffixes of different lengths
        p = hold[9000:9064]
        return [p + hold[11000:11010], p + hold[12000:12025], p + hold[13000:13040]], [p]
    if scen == "hit1":
        p = hold[9000:9064]
        return [p + hold[11000:11020]], [p]
    if scen == "turn2v2":  # multi-turn: turn 1 = generate on p (not dumped), turn 2 = p + output + a new message
        return None, [hold[5500:5570], hold[6500:6550]]
    if scen == "b3long":
        return [hold[15000:15100], hold[16000:16180], hold[17000:17250]], None
    if scen == "b5v2":
        return [hold[2000 + 1100*i:2000 + 1100*i + n] for i, n in enumerate((20, 47, 64, 90, 128))], None
    raise ValueError(scen)

def analyse(name):
    ref, dec = f"{root}/{name}-ref", f"{root}/{name}-dec"
    t = time.time()
    p = subprocess.run(["/work/main/.venv/bin/dumpdiff", "first-divergence", ref, dec, "--format", "json", "--no-progress"],
                       cwd="/work/main", capture_output=True, text=True)
    rec = {"model": model, "dtype": dtype, "plant": plant, "scen": name, "exit": p.returncode, "secs": round(time.time() - t, 1)}
    if p.returncode not in (0, 1):
        rec["err"] = p.stderr[-2000:]
        return rec, None
    res = json.loads(p.stdout)
    v = res["ranks"]["0"]
    nz = v["noise"]
    rec.update(rows_compared=v.get("rows_compared"), rows_differing=v.get("rows_differing"),
               strict=(res.get("culprit") or {}).get("call"),
               strict_calls=sorted({r["culprit"] for r in v["per_row"]}),
               align={k: v["alignment"].get(k) for k in ("rows_b", "unaligned_b", "unkeyed_b")},
               line=nz["rule"].get("amplification"), gap_line=nz["rule"].get("gap_amplification"),
               line_median=nz["rule"].get("median"), line_mad=nz["rule"].get("mad"),
               noise_culprits=[{k: c.get(k) for k in ("call", "rows", "kinds", "amplification", "in_err", "out_err", "gap_after", "gap_before", "inside_err")} for c in nz["culprits"]],
               top_jumps=[{k: j.get(k) for k in ("call", "amplification", "in_err", "out_err", "gap")} for j in nz["top_jumps"][:5]],
               rows_examined=nz.get("rows_examined"), summary=v.get("summary", "")[:400])
    return rec, res

KEEP = os.environ.get("KEEP")
srv.start()
try:
    for scen in scens:
        prompts, warm = prompts_for(scen)
        name = scen
        srv.flush_cache()
        if scen == "turn2v2":
            t1 = srv.generate(warm, max_new_tokens=16)
            prompts = [p + r["output_ids"] + hold[8000 + 100*i:8000 + 100*i + 12] for i, (p, r) in enumerate(zip(warm, t1))]
        elif warm:
            srv.generate(warm, max_new_tokens=1)
        ctl(enable=True, exp_name=f"{name}-dec")
        out = srv.generate(prompts, max_new_tokens=NEW)
        ctl(exp_name=f"{name}-ref")
        srv.flush_cache()
        full = [p + r["output_ids"] for p, r in zip(prompts, out)]
        srv.generate(full, max_new_tokens=0, logprob_start_len=0)
        ctl(enable=False)
        cached = [r["meta_info"].get("cached_tokens") for r in out]
        rec, res = analyse(name)
        rec["cached_tokens"] = cached; rec["new"] = NEW
        rec["gen_sample"] = bytes(max(0, min(255, t - 3)) for t in out[0]["output_ids"]).decode("latin1")
        problem = (plant == "none" and rec.get("noise_culprits")) or (plant != "none" and not rec.get("noise_culprits")) or rec["exit"] not in (0, 1)
        rec["problem"] = bool(problem)
        with open("/tmp/sgt/results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: rec.get(k) for k in ("model", "dtype", "plant", "scen", "exit", "strict", "noise_culprits", "line", "gap_line", "cached_tokens", "problem")}), flush=True)
        print("   top:", [(j["call"], round(j["amplification"], 2), j.get("gap")) for j in rec.get("top_jumps", [])], flush=True)
        if problem or KEEP:
            json.dump(res, open(f"{root}/{name}-result.json", "w"))
        else:
            shutil.rmtree(f"{root}/{name}-ref", ignore_errors=True); shutil.rmtree(f"{root}/{name}-dec", ignore_errors=True)
finally:
    srv.stop()
