"""python run_one.py ARCH DTYPE LENGTHS MASSIVE SINK [PLANT] -> one json line.
PLANT: none | attn:L:F | mlp:L:F | stale:L:SLOT:SRC | stalek:L:SLOT:SRC"""
import json, sys, time, torch, shutil
from common import *
arch, dtype, lengths, massive, sink = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")], float(sys.argv[4]), float(sys.argv[5])
plant = sys.argv[6] if len(sys.argv) > 6 else "none"
seed = int(sys.argv[7]) if len(sys.argv) > 7 else 0
layers = int(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8].isdigit() else 4
import os
offset = float(os.environ.get("OFFSET", 0))
dcv = float(os.environ.get("DC", 0))
t0 = time.time()
m = make_model(arch, massive=massive, sink_logit=sink, seed=seed, layers=layers, offset=offset, dc=dcv).to(getattr(torch, dtype))
ps = prompts_of(lengths, seed=seed)
ids, mask = left_padded(ps)
ratio, ratios, sinks = measure(m, ids, mask)
p = plant.split(":")
if p[0] == "attn":
    decode_only(m.model.layers[int(p[1])].self_attn, float(p[2]))
elif p[0] == "mlp":
    decode_only(m.model.layers[int(p[1])].mlp, float(p[2]))
elif p[0] in ("stale", "stalek"):
    width = ids.shape[1]
    stale_slot(m, int(p[1]), int(p[2]), int(p[3]), values=(p[0] == "stale"))
root = f"/tmp/rt-sink/dumps/{arch}-{dtype}-{sys.argv[3]}-{int(massive)}-{sink:g}-{plant.replace(':','_')}-{seed}-o{offset:g}-dc{dcv:g}"
ref, dec = dump(m, root, ps, new_tokens=16)
code, result = analyze(ref, dec)
s = summarize(code, result)
keep = "--keep" in sys.argv
if not keep:
    shutil.rmtree(root, ignore_errors=True)
else:
    json.dump(result, open(root + ".json", "w"), indent=1)
print(json.dumps({"arch": arch, "dtype": dtype, "lengths": lengths, "massive": massive, "sink": sink, "plant": plant, "seed": seed, "offset": offset, "dc": dcv,
                  "ratio": round(ratio), "sink_mass": [round(x, 2) for x in sinks], **s, "secs": round(time.time() - t0)}))
