"""Run a command-line module in this process and record what it cost.

    python benchmarks/_measure.py OUT.json dumpdiff.analyzer.cli index DUMP --rebuild

Writes {"seconds", "exit", "max_rss_mb", "worker_max_rss_mb", "workers_rss_mb", "read_bytes",
"rchar"} to OUT.json: wall time, peak resident memory of this process, of its largest child
process (the index build's workers, where it starts them; 0 when none) and of all its children
added up (an upper bound of what they held at once), bytes the process and its finished children
read from storage (/proc/self/io read_bytes: page-cache hits are not counted) and bytes asked
read() for (rchar; mmap reads are not counted there).
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import threading
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
    return _vm_hwm_mb("self") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ChildPeaks:
    """Each child process's own peak resident memory (VmHWM), sampled every 20 ms until it ends.
    Not getrusage(RUSAGE_CHILDREN): a child started by fork (or vfork) and exec carries the
    parent's high-water mark at its start into ru_maxrss."""

    def __init__(self):
        self.peaks = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.wait(0.02):
            for pid in _children():
                peak = _vm_hwm_mb(pid)
                if peak:
                    self.peaks[pid] = max(self.peaks.get(pid, 0.0), peak)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"worker_max_rss_mb": max(self.peaks.values(), default=0.0), "workers_rss_mb": sum(self.peaks.values())}


def _children() -> list:
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as handle:
                found += handle.read().split()
        except OSError:
            pass
    return found


def _vm_hwm_mb(pid) -> float:
    """A process's own peak resident memory from /proc (``pid`` may be "self"); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main():
    out, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    sys.argv = [module] + args
    before = proc_io()
    children = ChildPeaks()
    start = time.perf_counter()
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    seconds = time.perf_counter() - start
    after = proc_io()
    record = {
        "seconds": seconds,
        "exit": code,
        "max_rss_mb": peak_rss_mb(),
        **children.stop(),
        "read_bytes": after.get("read_bytes", 0) - before.get("read_bytes", 0),
        "rchar": after.get("rchar", 0) - before.get("rchar", 0),
    }
    with open(out, "w") as handle:
        json.dump(record, handle)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
