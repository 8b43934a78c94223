import sys, numpy as np
MIN=30.0
def line_of(amp, mask):
    a = amp[mask]; l = np.log10(np.maximum(a, 1e-12)); m = np.median(l); mad = np.median(np.abs(l - m)) or 0.05
    return 10**m, mad, max(MIN, 10**(m + 8*mad)), len(a)
for f in sys.argv[1:]:
    d = np.load(f); names = d["names"][d["ccode"]]
    amp, oe, car = d["amplification"], d["out_err"], d["carried"]
    act = (oe > 0) & (car > 0)
    print(f)
    print("  derived (all carrying cells): median %.3g mad %.3f line %.1f n=%d" % line_of(amp, act))
    for cap in (1e-5, 1e-4, 1e-3):
        print("  carried < %g: median %.3g mad %.3f line %.1f n=%d" % ((cap,) + line_of(amp, act & (car < cap))))
    import os; tgt = os.environ.get("TGT", "model.layers.2.self_attn.attn#0")
    sel = names == tgt
    kinds = d["kind"][d["pair"][sel]]
    a = amp[sel]
    print("  %s rows %d: amp quantiles 0/10/50/90/100%%:" % (tgt, sel.sum()), np.round(np.quantile(a, [0, .1, .5, .9, 1]), 2))
    print("    in_err quantiles:", np.quantile(d["in_err"][sel], [0, .5, 1]), " out_err:", np.quantile(oe[sel], [0, .5, 1]))
    for k in np.unique(kinds):
        ak = a[kinds == k]
        print(f"    {k}: n={len(ak)} >30: {(ak>30).sum()} >100: {(ak>100).sum()} >line-ish(named): see report; min {ak.min():.3g} median {np.median(ak):.3g}")
