"""Run the CPU benchmarks and print every ratio with its target and PASS/FAIL (``make bench``).

Each benchmark measures its own baseline in the same run, on the same machine and disk, and
prints ``RESULT {json}`` lines; this script collects them into one table. The GPU benchmark
(benchmarks/bench_gpu.py) needs a CUDA device and is run separately.

    python benchmarks/run_all.py [--quick] [--only off,write,rows,analyze] [--json results.json]

--quick shrinks the analyzer benchmark's dump pair (about 1.5 GB instead of 5.7 GB); the
5 GB target of the analysis benchmark then is not what is measured, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

BENCHMARKS = {
    "off": ["bench_off.py"],
    "write": ["bench_write.py"],
    "rows": ["bench_rows.py"],
    "analyze": ["bench_analyze.py"],
}


def run(name: str, argv: list) -> list:
    print(f"--- {name}: python benchmarks/{' '.join(argv)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, argv[0]), *argv[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=HERE,
    )
    rows = []
    for line in proc.stdout:
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT ") :])
            row["bench"] = name
            rows.append(row)
        else:
            print("   " + line.rstrip(), flush=True)
    code = proc.wait()
    if code:
        rows.append(
            {
                "bench": name,
                "name": f"{name}: benchmark exited {code}",
                "value": code,
                "unit": "",
                "target": "exit 0",
                "pass": False,
                "detail": "",
            }
        )
    print(f"--- {name}: {time.perf_counter() - start:.0f}s", flush=True)
    return rows


def table(rows: list) -> str:
    lines = [f"{'':4}  {'value':>10}  {'target':<30}  measured", "-" * 110]
    for row in rows:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[row["pass"]]
        value = row["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{verdict:4}  {shown + ' ' + row['unit']:>10}  {row['target']:<30}  {row['name']}")
        if row.get("detail"):
            lines.append(f"{'':48}{row['detail']}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHMARKS))
    ap.add_argument("--quick", action="store_true", help="smaller dumps for the analyzer benchmark")
    ap.add_argument("--json", default=None, help="also write every result to this file")
    args = ap.parse_args(argv)
    chosen = [n for n in (args.only.split(",") if args.only else BENCHMARKS) if n]
    rows = []
    for name in chosen:
        argv = list(BENCHMARKS[name])
        if name == "analyze" and args.quick:
            argv += ["--layers", "4"]
        rows += run(name, argv)
    print()
    print(table(rows))
    failed = sum(1 for r in rows if r["pass"] is False)
    print(
        f"\n{sum(1 for r in rows if r['pass'])} PASS, {failed} FAIL, {sum(1 for r in rows if r['pass'] is None)} info"
        + ("  (--quick: the analyzer ran on a dump pair under 5 GB)" if args.quick else "")
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
