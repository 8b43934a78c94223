import json
rows = [json.loads(l) for l in open("/tmp/sgt/results.jsonl")]
print("| # | model | dtype | plant | scenario | new | cached | exit | strict culprit | noise culprits (rows, min amp) | line / gap line | largest jumps (amp) | outcome |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
short = lambda s: (s or "").replace("model.layers.", "L").replace("model.", "")
prev = None
for i, r in enumerate(rows, 1):
    new = r.get("new") or (32 if r["scen"] in ("b3long", "b5") or (r["scen"] == "hit" and prev == "b5") else 24); prev = r["scen"]
    note = {"b5": " (prompts 4-5 empty: slicing bug in my script)", "turn2": " (turn-1 prompt 2 empty and no new message: slicing bug; still 2 decode-cache hits)"}.get(r["scen"], "")
    nc = "; ".join(f"{short(c['call'])}{' (gap)' if c.get('gap_before') else ''} ({c['rows']} rows: {', '.join(f'{k} {v}' for k, v in c['kinds'].items())}; {c['amplification']:.0f}x)" for c in r.get("noise_culprits", [])) or "none"
    tj = ", ".join(f"{'gap before ' if j.get('gap') else ''}{short(j['call']).replace('before ', '')} {j['amplification']:.3g}" for j in r.get("top_jumps", [])[:3])
    if r["plant"] == "none":
        out = "FALSE CULPRIT" if r.get("noise_culprits") else "ok"
    else:
        L = r["plant"].split(":")[1]
        hit = any(c["call"].startswith(f"model.layers.{L}.") for c in r.get("noise_culprits", []))
        out = ("named" if hit else "MISSED") + (f" (line raised to {r['line']:.0f})" if r.get("line", 30) > 30 else "")
    print(f"| {i} | {r['model']} | {r['dtype']} | {r['plant']} | {r['scen']} | {new} | {r.get('cached_tokens')} | {r['exit']} | {short(r.get('strict'))} | {nc} | {r.get('line', 0):.0f} / {r.get('gap_line', 0):.0f} | {tj} | {out}{note} |")
