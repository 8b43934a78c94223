"""Run a command-line module in this process and record what it cost.

    python benchmarks/_measure.py OUT.json analyzer.cli index DUMP --rebuild

Writes {"seconds", "exit", "max_rss_mb", "worker_max_rss_mb", "read_bytes", "rchar"} to OUT.json:
wall time, peak resident memory of this process and of its largest worker process (the index
build's, where it starts them; 0 when none), bytes the process and its finished workers read from
storage (/proc/self/io read_bytes: page-cache hits are not counted) and bytes asked read() for
(rchar; mmap reads are not counted there).
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import time


def proc_io() -> dict:
    try:
        with open("/proc/self/io") as handle:
            return {k: int(v) for k, v in (line.split(":") for line in handle)}
    except OSError:
        return {}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the high-water mark
    of the parent this process was forked from)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    out, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    sys.argv = [module] + args
    before = proc_io()
    start = time.perf_counter()
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    seconds = time.perf_counter() - start
    after = proc_io()
    record = {"seconds": seconds, "exit": code, "max_rss_mb": peak_rss_mb(),
              # the largest of the children waited for (workers are started by fork and exec: no
              # copy of this process's memory counts in theirs)
              "worker_max_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
              "read_bytes": after.get("read_bytes", 0) - before.get("read_bytes", 0),
              "rchar": after.get("rchar", 0) - before.get("rchar", 0)}
    with open(out, "w") as handle:
        json.dump(record, handle)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
