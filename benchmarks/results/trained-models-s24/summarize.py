import json
def rows(f):
    for l in open(f):
        yield json.loads(l)
out = ["| model | dtype | batch | run | exit | strict culprit | noise-aware verdict (rows, amp) | largest jump (call / gap) | line / gap line | margin (max/line) | outcome |",
       "|---|---|---|---|---|---|---|---|---|---|---|"]
for f in ["/tmp/tm/results.jsonl", "/tmp/tm/planted.jsonl"]:
    for r in rows(f):
        a, res = r["args"], r["res"]
        rule = res.get("rule") or {}
        line, gline = rule.get("amplification") or 30, rule.get("gap_amplification") or 100
        cul = res.get("culprits") or []
        v = "; ".join(f"{'gap in ' if c.get('gap_before') else ''}{c['call']}{' before ' + c['gap_before'] if c.get('gap_before') else ''} ({c['rows']}, {c['amplification']:.3g}x)" for c in cul) or "none"
        tj = res.get("top_jumps") or []
        calls = [j for j in tj if not j.get("gap")]; gaps = [j for j in tj if j.get("gap")]
        big = max([(j["amplification"] / line, j) for j in calls] + [(j["amplification"] / gline, j) for j in gaps], key=lambda x: x[0], default=(0, None))
        jm = f"{calls[0]['amplification']:.3g} / {gaps[0]['amplification']:.3g}" if calls and gaps else ""
        if not r.get("planted"):
            outcome = "FALSE POSITIVE" if cul else "ok"
        else:
            p = a["plant"]; kind, L = p.split(":")[0], p.split(":")[1]
            want = f"layers.{L}.self_attn" if kind in ("attn", "kv", "stale") else f"layers.{L}.mlp"
            hit = [c for c in cul if want in c["call"]]
            outcome = ("named" if hit else "MISS") + (f" ({hit[0]['rows']} rows)" if hit else "")
            if cul and not hit: outcome += " + WRONG culprit"
        out.append(f"| {a['model']} | {a['dtype']} | {a['mode']} | {'s'+str(a['seed']) if not r.get('planted') else a['plant']} | {res.get('exit')} | "
                   f"{(res.get('strict_culprit') or '').replace('model.layers.', 'L')} | {v} | {jm} | {line:.3g} / {gline:.3g} | {big[0]:.2f} | {outcome} |")
print("\n".join(out))
