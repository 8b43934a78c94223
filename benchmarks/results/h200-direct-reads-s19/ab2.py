"""A/B of two trees' `dumpdiff index REF DEC --rebuild`, cold, the order of the trees alternating."""
import os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "new", "benchmarks"))
from common import evict, files_under
W = sys.argv[1]; ref, dec = W + "/ref", W + "/dec"
files = files_under(ref) + files_under(dec)
trees = ["old", "new"]; res = {t: [] for t in trees}; cat = []
for i in range(int(sys.argv[2])):
    evict(ref, dec); s = time.perf_counter(); subprocess.run(["cat", *files], stdout=subprocess.DEVNULL); cat.append(time.perf_counter() - s)
    for t in (trees if i % 2 == 0 else trees[::-1]):
        evict(ref, dec); s = time.perf_counter()
        subprocess.run([sys.executable, "-m", "analyzer.cli", "index", ref, dec, "--rebuild"], cwd=os.path.join(here, t),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        res[t].append(time.perf_counter() - s)
med = lambda x: sorted(x)[len(x) // 2]
print("cat", [round(x, 2) for x in cat], "median", round(med(cat), 3))
for t in trees:
    print(t, [round(x, 2) for x in res[t]], "median", round(med(res[t]), 3), "ratio", round(med(cat) / med(res[t]), 3))
