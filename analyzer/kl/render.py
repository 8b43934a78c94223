"""Render a KL check result (helpers.check_server / inprocess.check_model) as text,
Markdown or JSON. Nothing here computes: every figure comes from the result dict."""

from __future__ import annotations

import json
import math

from ..wording import plural
from . import score as kl
from .result import JSON_VERSION, KLResult

TITLES = {
    kl.PASS: "PASS",
    kl.BATCH: "BATCH-INVARIANCE PROBLEM",
    kl.STATE: "STATE BUG (cache-restore path)",
    kl.MIXED: "NO-CACHE PATH DIRTY (batch-variance near the threshold)",
    kl.INCONCLUSIVE: "INCONCLUSIVE",
    kl.UNCLASSIFIED: "OVER THRESHOLD (cannot tell batch-variance from a state bug)",
}
COLUMNS = ("helper", "status", "avg_kl_div", "max_kl", "tokens>thr", "bit-identical", "cache hits", "time")


def g(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (x == 0 or math.isfinite(x)):
        return "0" if x == 0 else f"{x:.{digits}g}"
    return str(x)


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t < 10 else f"{t:.1f} s"


def rows(result: dict) -> list:
    out = []
    for name, h in result["helpers"].items():
        tokens = h.get("tokens") or 0
        hits = "-" if h.get("cache_hits") is None else f"{h['cache_hits']}/{h['prompts']} ({h['cache_hit_rate']:.0%})"
        out.append(
            (
                name,
                h["status"].upper() if h["status"] == "dirty" else h["status"],
                g(h.get("avg_kl_div")),
                g(h.get("max_kl")),
                "-" if h.get("frac_over") is None else f"{h['frac_over']:.1%}",
                f"{h['bit_identical']}/{tokens} ({h['bit_identical'] / tokens:.0%})" if tokens else "-",
                hits,
                _seconds(result.get("timings", {}).get(name, 0)),
            )
        )
    return out


def _header_lines(result: dict) -> list:
    t, p, s, th = result["target"], result["prompts"], result["settings"], result["threshold"]
    if t.get("engine") == "sglang":
        server = (
            f"server: {t['url']}  sglang {t.get('version')}  model {t['model']}  tp={t['tp']}  {t.get('dtype')}  "
            f"radix cache {'on' if t.get('radix_cache') else 'off'}  "
            f"chunked prefill {t.get('chunked_prefill_size') or 'off'}"
        )
    else:
        server = f"model: {t.get('model')} ({t.get('model_class')}, in-process)  {t.get('dtype')}  {t.get('device')}"
    lines = [
        server,
        f"prompts: {p['count']} from {p['source']}, {p.get('min_len')}..{p.get('max_len')} tokens, "
        f"{plural(s['max_new_tokens'], 'new token')} each, temperature {s['temperature']:g}",
        f"threshold: {g(th['value'])} on avg_kl_div ({th['source']}{': ' + repr(th['key']) if th.get('key') else ''})"
        + ("; per helper " + ", ".join(f"{k} {g(v)}" for k, v in th["helpers"].items()) if th.get("helpers") else ""),
    ]
    return lines


def _tail(result: dict) -> tuple:
    verdict = result["verdict"]
    worst = []
    for name, h in result["helpers"].items():
        if h.get("worst") is None:
            continue
        row = next((r for r in h["per_prompt"] if r.get("index") == h["worst"]), None)
        if row and row.get("tokens"):
            first = row.get("first_over")
            worst.append(
                f"{name}: worst prompt {h['worst']} (mean k3 {g(row['mean_kl'])}, max {g(row['max_kl'])} at "
                f"output token {row['max_pos']}"
                + (f", first over the threshold at output token {first}" if first is not None else "")
                + ")"
            )
    notes = list(verdict.get("notes", []))
    if result["threshold"].get("note"):
        notes.append(result["threshold"]["note"])
    notes += result.get("notes", [])
    for name, h in result["helpers"].items():
        notes += [f"{name}: {n}" for n in h.get("notes", [])]
    return worst, notes


def to_text(result: KLResult) -> str:
    verdict = result["verdict"]
    lines = [f"dumpdiff kl: {TITLES[verdict['kind']]}"] + _header_lines(result) + [""]
    table = [COLUMNS] + rows(result)
    widths = [max(len(str(r[i])) for r in table) for i in range(len(COLUMNS))]
    for r in table:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    worst, notes = _tail(result)
    lines += ["", f"verdict: {verdict['text']}"]
    lines += worst
    choice = verdict.get("localize")
    if choice and result["target"].get("engine") == "sglang":
        lines.append(
            f"next: dumpdiff localize --url {result['target']['url']} --helper {choice['helper']}  "
            "(server started with DUMPER_SERVER_PORT=reuse)"
        )
    if notes:
        lines += ["notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(result: KLResult) -> str:
    verdict = result["verdict"]
    lines = (
        [f"## dumpdiff kl: {TITLES[verdict['kind']]}", ""] + [f"- {_md_cell(x)}" for x in _header_lines(result)] + [""]
    )
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for r in rows(result):
        lines.append("| " + " | ".join(_md_cell(c) for c in r) + " |")
    worst, notes = _tail(result)
    lines += ["", f"**Verdict:** {_md_cell(verdict['text'])}", ""]
    lines += [f"- {_md_cell(w)}" for w in worst]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {_md_cell(n)}" for n in notes]
    return "\n".join(lines) + "\n"


def _finite(x):
    """JSON has no inf/nan: say them as strings rather than write invalid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def to_json(result: dict, name: str = None) -> str:
    """``name``: the format marker, when the result has no "kind" (localize's)."""
    marked = {"format": name or result.get("kind", "dumpdiff-kl"), "version": JSON_VERSION, **result}
    return json.dumps(_finite(marked), indent=2, default=str, allow_nan=False) + "\n"


def render(result: dict, fmt: str) -> str:
    return {"json": to_json, "md": to_markdown}.get(fmt, to_text)(result)
