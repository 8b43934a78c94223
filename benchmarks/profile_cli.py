"""Where a dumpdiff command spends its time: the top of a cProfile, cumulative.

python benchmarks/profile_cli.py [N] -- first-divergence REF DEC --strict-only
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    argv = sys.argv[1:]
    top = 25
    if argv and argv[0].isdigit():
        top, argv = int(argv[0]), argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    sys.argv = ["dumpdiff.analyzer.cli"] + argv
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    try:
        runpy.run_module("dumpdiff.analyzer.cli", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    # our own functions, the parquet reads, pandas merges and the heavy imports
    stats.sort_stats("cumulative").print_stats(
        r"analyzer/|read_parquet|merge.py.*\(merge\)|torch/__init__.py:1\(|pandas/__init__.py:1\(|pyarrow/__init__.py:1\(|numpy/__init__.py:1\(",
        top,
    )
    print(f"\n# wall {time.perf_counter() - start:.2f}s", file=sys.stderr)
    print(out.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main()
