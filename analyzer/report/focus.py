"""From a verdict (typically of fingerprint dumps), the settings of a second run that dumps full
tensors only where the verdict needs them.

A fingerprint run names the culprit for a few bytes per row; its error figures, the noise-aware
verdict and a repro need the culprit's values. The second run dumps, in mode all:

- the culprit's module and the module whose call holds it (its inputs and outputs; the parent
  for a difference made in its own code),
- the hooked calls just before and just after it (what fed it, what it fed),
- those same ops in every layer (the noise-aware verdict judges an op against its peers),
- the embedding (the alignment proof needs its output),

and only the positions of the rows that differ (DUMPER_POSITIONS), in both runs.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Dict, List, Optional

from dumper import format as fmt


def neighbourhood(verdict: dict) -> List[str]:
    """Module paths of the culprit, its parent, and the calls just before and after it."""
    culprit = verdict["culprit"]
    module = culprit["module"]
    timeline = verdict.get("calls_timeline") or []
    calls = [entry["call"] for entry in timeline]
    found = [module]
    if "." in module:
        found.append(module.rsplit(".", 1)[0])
    if culprit["call"] in calls:
        at = calls.index(culprit["call"])
        for near in (at - 1, at + 1):
            if 0 <= near < len(calls):
                found.append(calls[near].rsplit("#", 1)[0])
    return list(dict.fromkeys(m for m in found if m and m != fmt.ROOT_PATH))


def module_filter(modules: List[str], embedding: Optional[str]) -> str:
    """A DUMPER_FILTER regex selecting exactly these modules in every layer (each numeric part of
    a path, a layer or expert index, stands for any), and the embedding."""
    parts = [r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in m.split(".")) for m in modules]
    if embedding:
        parts.insert(0, re.escape(embedding))
    return "^(?:" + "|".join(dict.fromkeys(parts)) + ")$"


def positions_text(positions: List[int]) -> str:
    """'12:15,20' for positions 12, 13, 14, 20 (DUMPER_POSITIONS syntax)."""
    spans: List[List[int]] = []
    for p in sorted(set(positions)):
        if spans and spans[-1][1] == p:
            spans[-1][1] = p + 1
        else:
            spans.append([p, p + 1])
    return ",".join(f"{a}" if b == a + 1 else f"{a}:{b}" for a, b in spans)


def focus_settings(result: dict) -> Dict[str, str]:
    """The DUMPER_* settings of the focused run for a first-divergence result with a culprit."""
    verdict = next(v for v in result["ranks"].values() if v.get("culprit"))
    embedding = verdict["alignment"].get("embedding")  # the module the alignment proof used
    return {
        "DUMPER_NON_INTRUSIVE_MODE": "all",
        "DUMPER_FILTER": module_filter(neighbourhood(verdict), embedding),
        "DUMPER_POSITIONS": positions_text([row["pos"] for row in verdict["per_row"]]),
    }


def render(settings: Dict[str, str], result: dict) -> str:
    culprit = result["culprit"]
    lines = [
        f"# culprit {culprit['call']} [{culprit['cls']}]; dump both runs again with these settings (its "
        "neighbourhood and the rows that differ, full tensors), then run first-divergence on the new dumps:"
    ]
    lines += [f"{key}={shlex.quote(value)}" for key, value in settings.items()]
    args = " ".join(
        f"{k.replace('DUMPER_', '').lower()}={shlex.quote(json.dumps(v))}"
        for k, v in settings.items()
        if k != "DUMPER_NON_INTRUSIVE_MODE"
    )  # JSON strings: ctl reads a bare 24 as a number
    lines.append(
        f"# on a running server: dumpdiff ctl configure non_intrusive_mode=all {args}"
        "  (vLLM: add --url http://127.0.0.1:<DUMPER_SERVER_PORT>)"
    )
    return "\n".join(lines) + "\n"
