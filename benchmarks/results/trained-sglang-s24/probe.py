"""python probe.py REF DEC OUT.npz : run first-divergence with /work/main's analyzer, saving the per-(row, call) cells."""
import sys, numpy as np
sys.path.insert(0, "/work/main")
import analyzer.noise as N
saved = {}
orig_pce, orig_wn = N.per_call_errors, N.with_nesting
def pce(errors, table, pairs, traits, floor):
    saved["names"] = np.asarray(table.calls).astype(str); return orig_pce(errors, table, pairs, traits, floor)
def wn(calls, pre, post, pairs, fi):
    out = orig_wn(calls, pre, post, pairs, fi)
    for k in ("pair", "ccode", "in_err", "out_err", "inside", "before", "carried", "carries", "amplification",
              "gap_amplification", "floor", "eps", "clean_gap"):
        saved[k] = np.asarray(out[k])
    saved["kind"] = np.asarray(pairs["mode_b"]).astype(str); saved["pos"] = np.asarray(pairs["pos"])
    saved["seq"] = np.asarray(pairs["seq"]).astype(str)
    return out
N.per_call_errors, N.with_nesting = pce, wn
from analyzer.cli import entry
ref, dec, out = sys.argv[1:4]
sys.argv = ["dumpdiff", "first-divergence", ref, dec, "--format", "json", "--no-progress", "--output", "/tmp/sgt/probe_out.json"]
try:
    entry()
except SystemExit:
    pass
np.savez(out, **saved)
print("saved", out, len(saved.get("pair", [])))
