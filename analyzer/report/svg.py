"""Inline SVG charts for the HTML report, drawn in plain Python (no plotting library, no script).

Every string that reaches the SVG is HTML-escaped here: the SVG is parsed by the page's HTML
parser, and the names come from a dump that may be hostile. Hover text uses SVG <title>, which
needs no JavaScript.
"""

from __future__ import annotations

import html
from typing import List, Optional, Tuple

from . import common as rc

MAX_BARS = 40  # bar chart rows; the table below it lists the rest
MAX_COLUMNS = 600  # timeline columns; more calls are merged into buckets (max of each)
ORIGIN, DIRTY, CULPRIT, BAND, INK = "#e8590c", "#f4a3a3", "#c92a2a", "#f1f3f5", "#343a40"


def esc(value) -> str:
    return html.escape(rc.clean(value), quote=True)


def short(name: str, limit: int = 56) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


def bar_chart(items: List[Tuple[str, int]], title: str, highlight: Optional[str] = None) -> str:
    """Horizontal bars, one per (label, count), in the given order."""
    items = items[:MAX_BARS]
    label_w, bar_w, row_h = 400, 460, 22
    width, height = label_w + bar_w + 60, row_h * len(items) + 30
    top = max((count for _, count in items), default=0) or 1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{esc(title)}" font-family="system-ui, sans-serif" font-size="12">',
        f"<title>{esc(title)}</title>",
    ]
    for i, (label, count) in enumerate(items):
        y = 20 + i * row_h
        length = max(1.0, bar_w * count / top)
        color = CULPRIT if label == highlight else ORIGIN
        out.append(
            f"<g><title>{esc(label)}: {rc.plural(count, 'row')}</title>"
            f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end" fill="{INK}">{esc(short(label))}</text>'
            f'<rect x="{label_w}" y="{y + 2}" width="{length:.1f}" height="{row_h - 6}" fill="{color}"/>'
            f'<text x="{label_w + length + 6:.1f}" y="{y + 14}" fill="{INK}">{count}</text></g>'
        )
    out.append(f'<text x="{label_w}" y="12" fill="#868e96">token rows whose first culprit it is</text></svg>')
    return "".join(out)


def _buckets(calls: List[dict]) -> List[dict]:
    """Merge neighbouring calls so at most MAX_COLUMNS columns are drawn (keeps the page small)."""
    size = max(1, -(-len(calls) // MAX_COLUMNS))
    merged = []
    for start in range(0, len(calls), size):
        group = calls[start : start + size]
        merged.append(
            {
                "first": group[0],
                "last": group[-1],
                "calls": group,
                "out": max(c["rows_out_differ"] for c in group),
                "origin": max(c["rows_origin"] for c in group),
                "rows": max(c["rows"] for c in group),
                "layer": rc.layer_of(group[0]["call"]),
            }
        )
    return merged


def timeline(calls: List[dict], culprit: Optional[str], title: str) -> str:
    """Columns in execution order: rows whose output differs (light) and rows where a difference
    arises inside the call (dark); shaded bands mark layers, a red line the culprit."""
    if not calls:
        return ""
    columns = _buckets(calls)
    left, plot_w, plot_h, top_pad = 50, 900, 160, 24
    width, height = left + plot_w + 20, top_pad + plot_h + 44
    step = plot_w / len(columns)
    top = max(c["rows"] for c in columns) or 1
    base = top_pad + plot_h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{esc(title)}" font-family="system-ui, sans-serif" font-size="11">',
        f"<title>{esc(title)}</title>",
    ]
    out += _layer_bands(columns, left, step, top_pad, plot_h, base)
    for i, col in enumerate(columns):
        x = left + i * step
        names = (
            col["first"]["call"] if len(col["calls"]) == 1 else f"{col['first']['call']} \u2026 {col['last']['call']}"
        )
        tip = (
            f"{names}: output differs on {rc.plural(col['out'], 'row')}, arises inside on "
            f"{rc.plural(col['origin'], 'row')}"
        )
        bars = [
            f'<rect x="{x:.2f}" y="{base - plot_h * v / top:.2f}" width="{max(step - 0.5, 0.6):.2f}" '
            f'height="{plot_h * v / top:.2f}" fill="{color}"/>'
            for v, color in ((col["out"], DIRTY), (col["origin"], ORIGIN))
            if v
        ]
        if culprit and any(c["call"] == culprit for c in col["calls"]):
            mid = x + step / 2
            # label on the side with room: a culprit late in the run gets its label to the left
            side = f'x="{mid + 4:.2f}"' if mid < left + plot_w / 2 else f'x="{mid - 4:.2f}" text-anchor="end"'
            bars.append(
                f'<line x1="{mid:.2f}" x2="{mid:.2f}" y1="{top_pad - 6}" y2="{base}" stroke="{CULPRIT}" '
                f'stroke-width="2"/><text {side} y="{top_pad - 10}" fill="{CULPRIT}">'
                f"culprit: {esc(short(culprit, 70))}</text>"
            )
        out.append(
            f"<g><title>{esc(tip)}</title>"
            f'<rect x="{x:.2f}" y="{top_pad}" width="{step:.2f}" height="{plot_h}" fill="transparent"/>'
            + "".join(bars)
            + "</g>"
        )
    out.append(
        f'<line x1="{left}" x2="{left + plot_w}" y1="{base}" y2="{base}" stroke="{INK}"/>'
        f'<text x="{left - 6}" y="{top_pad + 4}" text-anchor="end" fill="{INK}">{top}</text>'
        f'<text x="{left - 6}" y="{base}" text-anchor="end" fill="{INK}">0</text>'
        f'<text x="{left}" y="{height - 4}" fill="#868e96">hooked calls in execution order '
        f"(layer numbers on shaded bands); height = token rows</text></svg>"
    )
    return "".join(out)


def _layer_bands(columns: List[dict], left: float, step: float, top_pad: int, plot_h: int, base: float) -> List[str]:
    """Alternate shading per layer, with the layer number under the axis (thinned out when crowded)."""
    spans, start = [], 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i]["layer"] != columns[start]["layer"]:
            spans.append((start, i, columns[start]["layer"]))
            start = i
    layered = [s for s in spans if s[2] is not None]
    every = max(1, len(layered) // 30)
    out = []
    for n, (begin, end, layer) in enumerate(layered):
        x, w = left + begin * step, (end - begin) * step
        if n % 2 == 0:
            out.append(f'<rect x="{x:.2f}" y="{top_pad}" width="{w:.2f}" height="{plot_h}" fill="{BAND}"/>')
        if n % every == 0:
            out.append(f'<text x="{x + w / 2:.2f}" y="{base + 14}" text-anchor="middle" fill="#868e96">{layer}</text>')
    return out
