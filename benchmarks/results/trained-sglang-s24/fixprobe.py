"""python fixprobe.py REF DEC : first-divergence with derive_threshold patched so victims don't vote:
cells carrying an error at least (smallest error made by a floor-beating jump) / MIN_AMPLIFICATION are left out."""
import sys, json, numpy as np
sys.path.insert(0, "/work/main")
import analyzer.noise as N
orig = N.derive_threshold
def derive(calls):
    amp, out, car, eps = calls["amplification"], calls["out_err"], calls["carried"], calls["eps"]
    made = np.r_[out[(amp > N.MIN_AMPLIFICATION) & (out > N.MIN_ULPS * eps)],
                 calls["in_err"][(calls["gap_amplification"] > N.MIN_GAP_AMPLIFICATION) & (calls["in_err"] > N.MIN_ULPS * eps)]]
    if not len(made):
        return orig(calls)
    level = made.min() / N.MIN_AMPLIFICATION
    keep = car < level
    sub = N.Columns({k: calls[k][keep] for k in ("amplification", "out_err", "carried")})
    rule = orig(sub)
    rule["victims_left_out"] = int((~keep).sum())
    return rule
N.derive_threshold = derive
from analyzer.cli import entry
sys.argv = ["dumpdiff", "first-divergence", sys.argv[1], sys.argv[2], "--format", "json", "--no-progress", "--output", "/tmp/sgt/fix_out.json"]
try:
    entry()
except SystemExit:
    pass
r = json.load(open("/tmp/sgt/fix_out.json"))["ranks"]["0"]
n = r["noise"]
print(json.dumps({"rows_compared": r["rows_compared"], "line": n["rule"]["amplification"], "left_out": n["rule"].get("victims_left_out"),
                  "culprits": [(c["call"], c["rows"], c["kinds"], round(c["amplification"])) for c in n["culprits"]]}))
