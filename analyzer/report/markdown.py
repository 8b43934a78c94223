"""Render a first-divergence result as GitHub-flavoured Markdown, to paste into a bug ticket.

Names from the dump (modules, calls, tensors, sequence keys, paths) go into code spans: there
`_`, `#`, `<root>`, `@user` and `#123` stay literal, where in prose GitHub would turn them into
emphasis, headings, HTML, mentions and issue links. Prose that embeds names (proof lines, notes,
warnings) is backslash-escaped, except that a word holding `@` or `#` (a call name, or a
hostile `@someone`) becomes a code span too: backslashes do not stop mentions or issue links.
"""

from __future__ import annotations

import re
from typing import List

from ..verdict.result import FirstDivergence
from . import common as rc
from .seqnames import for_reading

# What GitHub-flavoured Markdown reads as syntax anywhere in a line of prose: code, emphasis,
# strikethrough, links (so "(" and "!" after them are plain), HTML and entities, and "|", which
# ends a table cell. "#", "+" and "-" matter only at a line's start (text(line_start=True)), and
# a word holding "#" becomes a code span; (), {} and ! are never escaped: "\(" is only noise.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&])")
_LINE_START_MARKER = re.compile(r"^(\s*)(\d+)([.)])|^(\s*)([-+=])")
_REFERENCE_WORD = re.compile(r"[^\s()]*[@#][^\s(),;]*")


def _escape(prose: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", prose)


def text(value, line_start: bool = False) -> str:
    """Prose with Markdown syntax neutralised; at the start of a list item also a leading list
    marker ("1." or "-"), which would otherwise open a nested list."""
    raw, pieces, last = rc.clean(value), [], 0
    for word in _REFERENCE_WORD.finditer(raw):
        name = word.group().rstrip(".:")  # sentence punctuation stays prose
        if name:
            pieces += [_escape(raw[last : word.start()]), code(name)]
            last = word.start() + len(name)
    pieces.append(_escape(raw[last:]))
    escaped = "".join(pieces)
    if not line_start:
        return escaped
    return _LINE_START_MARKER.sub(
        lambda m: f"{m.group(1)}{m.group(2)}\\{m.group(3)}" if m.group(2) else f"{m.group(4)}\\{m.group(5)}", escaped
    )


def code(value, table: bool = False) -> str:
    """A code span that holds any string: the fence is longer than any backtick run inside."""
    raw = rc.clean(value)
    if not raw:
        return "*(empty)*"
    fence = "`" * (max((len(run) for run in re.findall(r"`+", raw)), default=0) + 1)
    if raw[0] in "` " or raw[-1] in "` ":
        raw = f" {raw} "  # a leading/trailing backtick would merge with the fence
    if table:
        raw = raw.replace("|", "\\|")  # GFM splits table cells on | even inside code spans
    return f"{fence}{raw}{fence}"


def pieces_md(parts) -> str:
    """(text, is_name) pieces as Markdown: names as code spans."""
    return "".join(code(piece) if is_name else text(piece) for piece, is_name in parts)


def verdict_md(result: dict) -> str:
    return pieces_md(rc.verdict_parts(result))


def table(header: List[str], rows: List[List[str]]) -> List[str]:
    """Cells must already be escaped (with table=True for code spans)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def capped(items: list, what: str) -> tuple:
    shown = items[: rc.MAX_TABLE_ROWS]
    note = rc.left_out(len(items), len(shown), what)
    return shown, (["", f"*{note}*"] if note else [])


def culprit_section(result: dict, rank: str, verdict: dict) -> List[str]:
    c = verdict["culprit"]
    rows = ", ".join(f"{code(rc.row_name(r))} ({text(r['kind'])})" for r in c["rows"])
    if c["n_rows"] > len(c["rows"]):
        rows += f", ... {c['n_rows'] - len(c['rows'])} more"
    out = [
        f"### Culprit{rc.rank_label(result, rank)}",
        "",
        f"- **Call:** {code(c['call'])}",
        f"- **Module:** {code(c['module'])}, class {code(c['cls'])}",
        f"- **Token rows:** {c['n_rows']} of {rc.plural(verdict['rows_compared'], 'compared row')}: {rows}",
        "- **Shapes** (M = token rows in the pass):",
    ]
    for side in rc.shape_sides(result, c):
        tensors = ", ".join(f"{code(slot)} {text(shape)}" for slot, shape in side["tensors"])
        out.append(f"  - {text(side['label'], line_start=True)}: pass {side['pass']}, **M={side['M']}**: {tensors}")
    figures = " · ".join(f"{name} **{text(value)}**" for name, value in rc.error_items(c))
    out.append(f"- **Error** on {code(c['tensor'])}: {figures}")
    out.append(f"- **Victims:** {rc.plural(c['victims'], 'later call', 'differ')} because of it")
    if c.get("note"):
        out.append(f"- **Note:** {text(c['note'])}")
    return out + [""]


def noise_section(result: dict, rank: str, verdict: dict) -> List[str]:
    noise = verdict["noise"]
    out = [
        f"### Noise-aware verdict{rc.rank_label(result, rank)}",
        "",
        "Where a real error is introduced: a call whose output error is far beyond its input error.",
        "",
        f"- **Rule:** {text(rc.noise_rule(noise))}",
    ]
    sampled = rc.noise_sampled(noise)
    out += [f"- **Rows:** {text(sampled)}"] if sampled else []
    out.append("")
    if noise["culprits"]:
        items, more = capped(noise["culprits"], "call")
        out += (
            table(
                ["call", "class", "rows", "input error", "output error", "amplification", "sample rows"],
                [
                    [
                        code(c["call"], True) + text(rc.gap_note(c)),
                        code(c["cls"], True),
                        f"{c['rows']} ({text(rc.kinds_text(c['kinds']))})",
                        text(rc.input_error(c)),
                        text(rc.fmt_num(c["out_err"])),
                        f"≥ {text(rc.fmt_num(c['amplification']))}x",
                        ", ".join(code(rc.row_name(r), True) for r in c.get("sample_rows", [])),
                    ]
                    for c in items
                ],
            )
            + more
        )
    else:
        out.append(text(rc.NO_NOISE_CULPRIT))
    if noise.get("top_jumps"):
        jumps = ", ".join(f"{code(j['call'])} {text(rc.jump_text(j))}" for j in noise["top_jumps"][:8])
        out += ["", f"Largest jumps against their lines (jump/line; introduced or not): {jumps}"]
    return out + [""]


def routing_section(result: dict, rank: str, verdict: dict) -> List[str]:
    flips = verdict["routing_flips"]
    out = [f"### Routing flips (MoE){rc.rank_label(result, rank)}", "", text(rc.routing_headline(flips)), ""]
    flipped = [f for f in flips if f.get("rows_flipped")]
    if flipped:
        items, more = capped(flipped, "router call")
        out += (
            table(
                ["layer", "router call", "rows flipped", "top-k", "rows (experts in A -> in B)"],
                [
                    [
                        text(rc.fmt_num(f["layer"])),
                        code(f["call"], True),
                        f"{f['rows_flipped']} of {f['rows_compared']}",
                        text(rc.k_text(f)),
                        ", ".join(
                            f"{code(name, True)} {text(what)}" for name, what in map(rc.flip_example, f["examples"])
                        )
                        + (
                            f", ... {f['rows_flipped'] - len(f['examples'])} more"
                            if f["rows_flipped"] > len(f["examples"])
                            else ""
                        ),
                    ]
                    for f in items
                ],
            )
            + more
            + [""]
        )
    unknown = [f for f in flips if f.get("rows_flipped") is None]
    out += [f"- {code(f['call'])}: {text(f.get('note', 'top-k unknown'))}" for f in unknown]
    return out + ([""] if unknown else [])


def rank_sections(result: dict, rank: str, verdict: dict) -> List[str]:
    suffix = rc.rank_label(result, rank)
    # The analyzer's own reading of the verdict (strict vs noise-aware), when it gives one.
    out = [f"**Summary{suffix}:** {text(verdict['summary'])}", ""] if verdict.get("summary") else []
    if verdict.get("culprit"):
        out += culprit_section(result, rank, verdict)
    elif verdict.get("note"):
        out += [f"**Note{suffix}:** {text(verdict['note'])}", ""]
    if verdict.get("noise"):
        out += noise_section(result, rank, verdict)
    if verdict.get("routing_flips"):
        out += routing_section(result, rank, verdict)
    out += [f"### Alignment proof{suffix}", ""]
    out += [
        f"- [{'x' if ok else ' '}] {text(line, line_start=True)}" for ok, line in rc.alignment_items(result, verdict)
    ]
    out += [
        "",
        f"Rows differing: **{verdict['rows_differing']} of {verdict['rows_compared']}** compared token "
        f"{rc.noun(verdict['rows_compared'], 'row')}.",
        "",
    ]
    if verdict["groups"]:
        groups, more = capped(verdict["groups"], "culprit group")
        out += [
            f"### Per-row culprits{suffix}",
            "",
            "Each differing token row has its own first culprit; "
            "rows of different kinds (prompt, decode) often meet different ones.",
            "",
        ]
        out += (
            table(
                ["rows", "call", "class"],
                [[str(g["rows"]), code(g["call"], True), code(g["cls"], True)] for g in groups],
            )
            + more
            + [""]
        )
    if verdict["not_comparable"]:
        items, more = capped(verdict["not_comparable"], "call")
        calls = rc.plural(len(verdict["not_comparable"]), "call")
        out += [f"### Not comparable{suffix} ({calls}: {rc.NOT_COMPARABLE_NOTE})", ""]
        out += table(["call", "why"], [[code(n["call"], True), code(n["why"], True)] for n in items]) + more + [""]
    if verdict["nonfinite"]:
        items, more = capped(verdict["nonfinite"], "tensor")
        out += [f"### Non-finite values{suffix} (NaN/Inf, compared bit by bit)", ""]
        out += (
            table(
                ["tensor", "rows", "in A", "in B"],
                [
                    [code(n["tensor"], True), str(n["rows"]), str(n["nonfinite_a"]), str(n["nonfinite_b"])]
                    for n in items
                ],
            )
            + more
            + [""]
        )
    return out


def to_markdown(result: FirstDivergence) -> str:
    result, note = for_reading(result)
    place = None if rc.headline_names_place(result) else rc.title_place(result)
    title = f"{place[0]} {code(place[1])}" if place else ""
    out = [
        f"## dumpdiff first-divergence: {pieces_md(rc.headline_parts(result))} {title}".rstrip(),
        "",
        f"**Verdict:** {verdict_md(result)}",
        "",
    ]
    out += [f"> **Warning:** {text(w)}" for w in result.get("warnings", [])]
    out += [f"> **Note:** {text(note)}"] if note else []
    out += [""] if result.get("warnings") or note else []
    for rank, verdict in result["ranks"].items():
        out += rank_sections(result, rank, verdict)
    if len(result["ranks"]) > 1:
        out += [f"Ranks that diverge: {pieces_md(rc.diverged_rank_parts(result)) or 'none'}", ""]
    out += ["### Environment", ""]
    header = [
        "",
        f"A (reference): {code(result['a']['label'], True)}",
        f"B (under test): {code(result['b']['label'], True)}",
    ]
    out += table(header, [[name, code(a, True), code(b, True)] for name, a, b in rc.environment_rows(result)])
    command = rc.reproduce_command(result)
    fence = "`" * max(3, max((len(run) + 1 for run in re.findall(r"`+", command)), default=0))
    out += ["", "### Reproduce", "", f"{fence}sh", command, fence, ""]
    return "\n".join(out)
