"""Stop 27 probe: wall time per source line of chosen functions on the main thread, one strict verdict
(first call in a fresh process, as the command line runs it). Line events only in the chosen code."""
import collections, os, sys, time
sys.path.insert(0, os.getcwd())
import analyzer.cli as cli
from analyzer import compare, align, diverge, index, columns
MODULES = {"compare": compare, "align": align, "diverge": diverge, "index": index, "columns": columns}
TARGETS = {getattr(MODULES[m], n).__code__ for m, n in (x.split(".") for x in os.environ.get(
    "LT", "compare.strict_verdict,compare._per_call,compare.calls_timeline,compare.calls_of_b").split(","))}
spent = collections.Counter(); last = {}
def local(frame, event, arg):
    now = time.perf_counter(); key = frame.f_code
    if key in last:
        spent[(key.co_filename, last[key][0])] += now - last[key][1]
    if event == "line":
        last[key] = (frame.f_lineno, now)
    elif event == "return":
        last.pop(key, None)
    return local
def glob(frame, event, arg):
    if frame.f_code in TARGETS:
        last[frame.f_code] = (frame.f_lineno, time.perf_counter())
        return local
    return None
sys.argv = ["dumpdiff", "first-divergence", "--strict-only", sys.argv[1], sys.argv[2]]
out = sys.stdout; sys.stdout = open(os.devnull, "w")
sys.settrace(glob); t = time.perf_counter()
try: cli.entry()
except SystemExit: pass
sys.settrace(None); total = time.perf_counter() - t; sys.stdout = out
print(f"total {1000*total:.0f} ms")
for (f, line), v in spent.most_common(30):
    src = open(f).read().splitlines()[line - 1].strip()[:110]
    print(f"{1000*v:6.1f} ms  {os.path.basename(f)}:{line}  {src}")
