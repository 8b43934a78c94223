"""Render a first-divergence result as ONE self-contained HTML page, to attach to a bug ticket.

The page loads nothing: styles are inline, charts are inline SVG drawn in Python, there is no
script, and a Content-Security-Policy forbids every fetch and every script, so even a string
that slipped past escaping could neither run nor phone home. Every string from the dumps goes
through esc() (html.escape): a dump attached to a public ticket may be hostile.
"""

from __future__ import annotations

from typing import Iterable, List

from ..verdict.result import FirstDivergence
from . import common as rc
from . import svg
from .seqnames import for_reading
from .svg import esc

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; base-uri 'none'"

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#212529;margin:24px auto;max-width:1080px;padding:0 16px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dee2e6;padding-bottom:4px}
code,pre{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;overflow-wrap:anywhere}
.verdict{padding:10px 14px;border-radius:6px;background:#fff5f5;border-left:5px solid #c92a2a}
.verdict.ok{background:#ebfbee;border-left-color:#2b8a3e}.warn{background:#fff9db;padding:6px 10px;border-radius:4px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #dee2e6;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f8f9fa}dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 14px}dt{font-weight:600}dd{margin:0}
ul.proof{list-style:none;padding-left:4px}.ok-mark{color:#2b8a3e;font-weight:700}.caveat{color:#e67700;font-weight:700}
pre{background:#f1f3f5;padding:10px;border-radius:4px;white-space:pre-wrap}.more{color:#868e96;font-style:italic}
svg{max-width:100%;height:auto}.legend span{display:inline-block;width:11px;height:11px;margin:0 4px 0 12px;vertical-align:-1px}
"""


def code(value) -> str:
    return f"<code>{esc(value)}</code>"


def pieces_html(parts) -> str:
    """(text, is_name) pieces as HTML: names as code, everything escaped."""
    return "".join(code(piece) if is_name else esc(piece) for piece, is_name in parts)


def table(header: List[str], rows: Iterable[List[str]], total: int, what: str) -> str:
    """Cells must already be escaped. Shows at most MAX_TABLE_ROWS and says how many were left out."""
    rows = list(rows)[: rc.MAX_TABLE_ROWS]
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    more = rc.left_out(total, len(rows), what)
    return f"<table><tr>{head}</tr>{body}</table>" + (f'<p class="more">{esc(more)}</p>' if more else "")


def culprit_section(result: dict, rank: str, verdict: dict) -> str:
    c = verdict["culprit"]
    rows = ", ".join(f"{code(rc.row_name(r))} ({esc(r['kind'])})" for r in c["rows"])
    if c["n_rows"] > len(c["rows"]):
        rows += f", \u2026 {c['n_rows'] - len(c['rows'])} more"
    shapes = "<br>".join(
        f"{esc(s['label'])}: pass {esc(s['pass'])}, <b>M={esc(s['M'])}</b>: "
        + ", ".join(f"{code(slot)} {esc(shape)}" for slot, shape in s["tensors"])
        for s in rc.shape_sides(result, c)
    )
    errors = table([esc(name) for name, _ in rc.error_items(c)], [[esc(v) for _, v in rc.error_items(c)]], 1, "")
    items = [
        ("Call", code(c["call"])),
        ("Module", f"{code(c['module'])}, class {code(c['cls'])}"),
        ("Token rows", f"{c['n_rows']} of {rc.plural(verdict['rows_compared'], 'compared row')}: {rows}"),
        ("Shapes", f"(M = token rows in the pass)<br>{shapes}"),
        ("Error", f"on {code(c['tensor'])}{errors}"),
        ("Victims", f"{rc.plural(c['victims'], 'later call', 'differ')} because of it"),
    ]
    if c.get("note"):
        items.append(("Note", esc(c["note"])))
    body = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in items)
    return f"<h2>Culprit{esc(rc.rank_label(result, rank))}</h2><dl>{body}</dl>"


def noise_section(result: dict, rank: str, verdict: dict) -> str:
    noise = verdict["noise"]
    items = [("Rule", esc(rc.noise_rule(noise)))]
    if rc.noise_sampled(noise):
        items.append(("Rows", esc(rc.noise_sampled(noise))))
    out = [
        f"<h2>Noise-aware verdict{esc(rc.rank_label(result, rank))}</h2>",
        "<p>Where a real error is introduced: a call whose output error is far beyond its input error.</p>",
        "<dl>" + "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in items) + "</dl>",
    ]
    if noise["culprits"]:
        out.append(
            table(
                ["call", "class", "rows", "input error", "output error", "amplification", "sample rows"],
                (
                    [
                        code(c["call"]) + esc(rc.gap_note(c)),
                        code(c["cls"]),
                        f"{c['rows']} ({esc(rc.kinds_text(c['kinds']))})",
                        esc(rc.input_error(c)),
                        esc(rc.fmt_num(c["out_err"])),
                        f"&ge; {esc(rc.fmt_num(c['amplification']))}x",
                        ", ".join(code(rc.row_name(r)) for r in c.get("sample_rows", [])),
                    ]
                    for c in noise["culprits"]
                ),
                len(noise["culprits"]),
                "call",
            )
        )
    else:
        out.append(f"<p>{esc(rc.NO_NOISE_CULPRIT)}</p>")
    if noise.get("top_jumps"):
        jumps = ", ".join(f"{code(j['call'])} {esc(rc.jump_text(j))}" for j in noise["top_jumps"][:8])
        out.append(f"<p>Largest jumps against their lines (jump/line; introduced or not): {jumps}</p>")
    return "".join(out)


def routing_section(result: dict, rank: str, verdict: dict) -> str:
    flips = verdict["routing_flips"]
    out = [
        f"<h2>Routing flips (MoE){esc(rc.rank_label(result, rank))}</h2>",
        f"<p>{esc(rc.routing_headline(flips))}</p>",
    ]
    flipped = [f for f in flips if f.get("rows_flipped")]
    if flipped:

        def rows(f):
            shown = ", ".join(f"{code(name)} {esc(what)}" for name, what in map(rc.flip_example, f["examples"]))
            extra = f["rows_flipped"] - len(f["examples"])
            return shown + (f", \u2026 {extra} more" if extra > 0 else "")

        out.append(
            table(
                ["layer", "router call", "rows flipped", "top-k", "rows (experts in A &rarr; in B)"],
                (
                    [
                        esc(rc.fmt_num(f["layer"])),
                        code(f["call"]),
                        f"{f['rows_flipped']} of {f['rows_compared']}",
                        esc(rc.k_text(f)),
                        rows(f),
                    ]
                    for f in flipped
                ),
                len(flipped),
                "router call",
            )
        )
    unknown = [f for f in flips if f.get("rows_flipped") is None]
    if unknown:
        out.append(
            "<ul>"
            + "".join(f"<li>{code(f['call'])}: {esc(f.get('note', 'top-k unknown'))}</li>" for f in unknown)
            + "</ul>"
        )
    return "".join(out)


def charts(result: dict, rank: str, verdict: dict) -> str:
    suffix = esc(rc.rank_label(result, rank))
    culprit = verdict["culprit"]["call"] if verdict.get("culprit") else None
    out = []
    if verdict["groups"]:
        bars = svg.bar_chart(
            [(g["call"], g["rows"]) for g in verdict["groups"]], "token rows per first culprit", culprit
        )
        out.append(f"<h2>Per-row culprit counts{suffix}</h2>{bars}")
        if len(verdict["groups"]) > svg.MAX_BARS:
            out.append(
                f'<p class="more">{rc.plural(len(verdict["groups"]) - svg.MAX_BARS, "more culprit")} in the table '
                "below</p>"
            )
    calls = verdict.get("calls_timeline") or []
    if calls:
        total = verdict.get("calls_timeline_total", len(calls))
        legend = (
            f'<p class="legend"><span style="background:{svg.DIRTY}"></span>output differs'
            f'<span style="background:{svg.ORIGIN}"></span>difference arises inside (inputs identical)'
            f'<span style="background:{svg.CULPRIT}"></span>culprit</p>'
        )
        out.append(
            f"<h2>Calls in execution order{suffix}</h2>{legend}"
            + svg.timeline(calls, culprit, "differing token rows per hooked call")
        )
        more = rc.left_out(total, len(calls), "call")
        out.append(f'<p class="more">{esc(more)}</p>' if more else "")
    return "".join(out)


def rank_sections(result: dict, rank: str, verdict: dict) -> str:
    suffix = esc(rc.rank_label(result, rank))
    out = [f"<p><b>Summary{suffix}:</b> {esc(verdict['summary'])}</p>" if verdict.get("summary") else ""]
    out += [
        culprit_section(result, rank, verdict)
        if verdict.get("culprit")
        else (f"<p><b>Note{suffix}:</b> {esc(verdict['note'])}</p>" if verdict.get("note") else "")
    ]
    if verdict.get("noise"):
        out.append(noise_section(result, rank, verdict))
    if verdict.get("routing_flips"):
        out.append(routing_section(result, rank, verdict))
    proof = "".join(
        f'<li><span class="{"ok-mark" if ok else "caveat"}">{"&#x2611;" if ok else "&#x2610;"}</span> {esc(line)}</li>'
        for ok, line in rc.alignment_items(result, verdict)
    )
    out.append(
        f'<h2>Alignment proof{suffix}</h2><ul class="proof">{proof}</ul>'
        f"<p>Rows differing: <b>{verdict['rows_differing']} of {verdict['rows_compared']}</b> compared token "
        f"{rc.noun(verdict['rows_compared'], 'row')}.</p>"
    )
    out.append(charts(result, rank, verdict))
    groups = verdict["groups"]
    if groups:
        out.append(
            f"<h2>Per-row culprits{suffix}</h2>"
            + table(
                ["rows", "call", "class"],
                ([str(g["rows"]), code(g["call"]), code(g["cls"])] for g in groups),
                len(groups),
                "culprit group",
            )
        )
    if verdict["not_comparable"]:
        items = verdict["not_comparable"]
        out.append(
            f"<h2>Not comparable{suffix} ({rc.plural(len(items), 'call')}: {esc(rc.NOT_COMPARABLE_NOTE)})</h2>"
            + table(["call", "why"], ([code(n["call"]), code(n["why"])] for n in items), len(items), "call")
        )
    if verdict["nonfinite"]:
        items = verdict["nonfinite"]
        out.append(
            f"<h2>Non-finite values{suffix} (NaN/Inf, compared bit by bit)</h2>"
            + table(
                ["tensor", "rows", "in A", "in B"],
                ([code(n["tensor"]), str(n["rows"]), str(n["nonfinite_a"]), str(n["nonfinite_b"])] for n in items),
                len(items),
                "tensor",
            )
        )
    return "".join(out)


def to_html(result: FirstDivergence) -> str:
    result, note = for_reading(result)
    head = rc.headline_parts(result)
    place = None if rc.headline_names_place(result) else rc.title_place(result)
    title = "dumpdiff: " + "".join(piece for piece, _ in head) + (f" {place[0]} {place[1]}" if place else "")
    verdict = pieces_html(rc.verdict_parts(result))
    body = [
        f"<h1>dumpdiff first-divergence: {pieces_html(head)}</h1>",
        f'<p class="verdict{"" if result["divergence"] else " ok"}">{verdict}</p>',
    ]
    body += [f'<p class="warn"><b>Warning:</b> {esc(w)}</p>' for w in result.get("warnings", [])]
    body += [f"<p><b>Note:</b> {esc(note)}</p>"] if note else []
    body += [rank_sections(result, rank, v) for rank, v in result["ranks"].items()]
    if len(result["ranks"]) > 1:
        body.append(f"<p>Ranks that diverge: {pieces_html(rc.diverged_rank_parts(result)) or 'none'}</p>")
    env = table(
        ["", f"A (reference): {code(result['a']['label'])}", f"B (under test): {code(result['b']['label'])}"],
        ([esc(name), code(a), code(b)] for name, a, b in rc.environment_rows(result)),
        0,
        "",
    )
    body.append(f"<h2>Environment</h2>{env}")
    body.append(f"<h2>Reproduce</h2><pre><code>{esc(rc.reproduce_command(result))}</code></pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
