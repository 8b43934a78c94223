import json, sys
print("| model | dtype | prompts | DC/offset | outlier ratio | sink mass L2/L3 | plant | verdict (noise-aware) | largest jump vs line |")
print("|---|---|---|---|---|---|---|---|---|")
for f in sys.argv[1:]:
    for l in open(f):
        r = json.loads(l)
        cul = "; ".join(f"{c[0]} ({c[1]} rows, {c[3]}x)" for c in r["culprits"]) or "nothing named"
        j = r["top_jumps"][0] if r["top_jumps"] else ["-", 0, False]
        print(f"| {r['arch']} | {r['dtype']} | {'+'.join(map(str, r['lengths']))} | {r.get('dc',0):g}/{r.get('offset',0):g} | {r['ratio']} | {r['sink_mass'][2]}/{r['sink_mass'][3]} | {r['plant']} | {cul} | {j[0].replace('model.layers.','L')}{' (gap)' if j[2] else ''} {j[1]}x / {r['line']:.3g}x |")
