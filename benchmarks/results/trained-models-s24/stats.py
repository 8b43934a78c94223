import sys, numpy as np
z = np.load(sys.argv[1])
act = (z["out_err"] > 0) & (z["carried"] > 0)
amp = z["amplification"][act]; carried = z["carried"][act]
lg = np.log10(np.maximum(amp, 1e-12)); med = np.median(lg); mad = np.median(abs(lg - med))
print("all carried cells", act.sum(), f"median amp {10**med:.3g} mad {mad:.3g} line {10**(med + 8*mad):.3g}")
for thr in [1e-5, 1e-4, 1e-3]:
    k = carried <= thr
    l2 = lg[k]; m2 = np.median(l2); d2 = np.median(abs(l2 - m2))
    print(f"carried<={thr}: n={k.sum()} median {10**m2:.3g} mad {d2:.3g} line {10**(m2+8*d2):.3g}")
print("carried error quantiles .1 .5 .9 .99", np.quantile(carried, [.1,.5,.9,.99]))
kind = z["kind"][z["pair"]][act]
for kd in np.unique(kind):
    l2 = lg[kind == kd]; m2 = np.median(l2); d2 = np.median(abs(l2 - m2)); print(kd, len(l2), f"median {10**m2:.3g} mad {d2:.3g} line {10**(m2+8*d2):.3g}")
