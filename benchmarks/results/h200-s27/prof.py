import cProfile, pstats, runpy, sys, io, os
sys.path.insert(0, os.getcwd())
sys.argv = ["analyzer.cli", "first-divergence", "--strict-only", sys.argv[1], sys.argv[2]]
p = cProfile.Profile(); p.enable()
try: runpy.run_module("analyzer.cli", run_name="__main__", alter_sys=True)
except SystemExit: pass
p.disable()
s = io.StringIO(); st = pstats.Stats(p, stream=s); st.sort_stats("cumulative").print_stats(r"analyzer/", 70); print(s.getvalue(), file=sys.stderr)
s = io.StringIO(); st = pstats.Stats(p, stream=s); st.sort_stats("tottime").print_stats(60); print(s.getvalue(), file=sys.stderr)
