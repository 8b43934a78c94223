"""Render a `dumpdiff compare` result as text, Markdown, HTML or JSON (the dict is the single
source of truth). Every format says the same: the verdict, the alignment proof, how the two
runs' tensors were mapped, the op beyond its precision (if any) and the one that adds the most,
and each op's figures."""

from __future__ import annotations

import json
from typing import List

from ..verdict.across_result import JSON_FORMAT, JSON_VERSION, Comparison
from ..wording import fmt_num, plural, terminal_safe
from . import html as rh
from . import markdown as rm
from .common import MAX_TABLE_ROWS, left_out
from .text import describe_side

OP_HEADER = ["op", "class (reference / test)", "rows", "in eps", "out eps", "jump", "line", "line from"]


def render(result: Comparison, fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"format": JSON_FORMAT, "version": JSON_VERSION, **result}, indent=2, default=str) + "\n"
    return {"md": to_markdown, "html": to_html}.get(fmt, to_text)(result)


def headline(result: dict) -> str:
    first = result["first"]
    if not first:
        return "within precision"
    return f"beyond precision at {first['call']}" + (" (in code before its input)" if first["kind"] == "gap" else "")


def _classes(op: dict) -> str:
    return op["cls"] if op["cls"] == op["cls_b"] or not op["cls_b"] else f"{op['cls'] or '-'} / {op['cls_b']}"


def _op_cells(op: dict) -> List[str]:
    return [
        op["call"] + ("  <- beyond" if op["over"] else ""),
        _classes(op),
        str(op["rows"]),
        fmt_num(op["in_eps"]),
        fmt_num(op["out_eps"]),
        fmt_num(op["jump"]) + "x",
        fmt_num(op["line"]) + "x",
        op["line_from"],
    ]


def _op_lines(op: dict, what: str) -> List[str]:
    row = op["row"]
    if op["kind"] == "gap":
        where = (
            f"code not compared between {op['after']} and {op['call']}" if op["after"] else f"code before {op['call']}"
        )
        head = [f"{what}: {where}", f"  (the error of {op['call']}'s input jumps beyond all compared before it)"]
        errors = f"  error before it {fmt_num(op['in_eps'])} eps, at the input {fmt_num(op['out_eps'])} eps"
    else:
        head = [
            f"{what}: {op['call']}  [{_classes(op)}]",
            f"  test run's call: {op['source_b']}"
            + (f" (outputs {', '.join(op['outputs_b'])})" if op["outputs_b"] else ""),
        ]
        errors = f"  input error {fmt_num(op['in_eps'])} eps, output error {fmt_num(op['out_eps'])} eps"
    return head + [
        f"  worst row: {row['seq']}@{row['pos']} ({row['kind']}); {op['rows_over']} of {plural(op['rows'], 'row')} "
        "beyond the line",
        f"{errors} (eps {op['eps']:.3g}); jump {fmt_num(op['jump'])}x against a line of {fmt_num(op['line'])}x "
        f"({op['line_from']})",
    ]


def _facts(result: dict) -> List[str]:
    mapping, precision = result["mapping"], result["precision"]
    facts = [
        f"precision: test {precision['test']} against reference {precision['reference']}; errors are relative to the "
        "row's largest value, in epsilons of the coarser output type",
        f"mapping: {plural(mapping['tensors'], 'tensor')} paired"
        + (f" ({'; '.join(mapping['rules'])})" if mapping["rules"] else " (same names)"),
    ]
    facts += [f"paired by role: {b} (test) as {a}" for b, a in list(mapping["renamed"].items())[:4]]
    facts += [f"shards: {note}" for note in mapping["shards"]]
    facts += [f"not comparable: {n['tensor']}: {n['why']}" for n in mapping["not_comparable"][:4]]
    facts.append(f"rows compared: {result['rows_compared']} of {result['alignment']['paired']} paired")
    facts += [_flip_fact(flip) for flip in result["routing_flips"]]
    return facts


def _flip_fact(flip: dict) -> str:
    shown = "; ".join(f"{e['seq']}@{e['pos']}: {e['experts_a']} and {e['experts_b']}" for e in flip["examples"][:2])
    text = (
        f"MoE routing flip: {flip['router']} chose other experts (top {flip['k']}) on {flip['rows_flipped']} of "
        f"{plural(flip['rows_compared'], 'row')}"
        + (f" ({shown})" if shown else "")
        + f"; {flip['block']} and the modules holding it are not judged on those rows"
    )
    if flip["rows_not_top_k"]:
        text += (
            f"; on {plural(flip['rows_not_top_k'], 'more row')} a run's experts are not the top {flip['k']} of its "
            "own scores: no rounding flip, those rows are judged"
        )
    return text


def to_text(result: Comparison) -> str:
    lines = [
        "dumpdiff compare: "
        + ("BEYOND PRECISION" + headline(result)[16:] if result["divergence"] else "WITHIN PRECISION"),
        f"  A (reference):  {describe_side(result['a'])}",
        f"  B (under test): {describe_side(result['b'])}",
        "",
        "alignment proof: OK",
        *(f"  - {line}" for line in result["alignment"]["proof"]),
        *_facts(result),
    ]
    if result["first"]:
        lines += _op_lines(result["first"], "first beyond its precision")
        if len(result["culprits"]) > 1:
            lines.append(
                f"  then: {', '.join(result['culprits'][1:6])}" + (" ..." if len(result["culprits"]) > 6 else "")
            )
    if result["adds_most"]:
        lines += _op_lines(result["adds_most"], "op that adds the most")
    if result["first_difference"]:
        first = result["first_difference"]
        lines.append(
            f"first difference from bit-identical inputs: {first['call']} [{first['cls']} / {first['cls_b']}] on "
            f"{plural(first['rows'], 'row')}"
        )
    lines.append("ops (jump = output error / max(input error, 1 eps); named beyond its line and 8 eps):")
    shown = result["ops"][:MAX_TABLE_ROWS]
    widths = [max(len(c) for c in col) for col in zip(OP_HEADER, *(_op_cells(op) for op in shown))]
    for cells in [OP_HEADER] + [_op_cells(op) for op in shown]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    more = left_out(len(result["ops"]), len(shown), "ops")
    lines += [f"  {more}"] if more else []
    lines += [f"warning: {w}" for w in result["warnings"]]
    lines.append(f"summary: {result['summary']}")
    return terminal_safe("\n".join(lines) + "\n")


def to_markdown(result: Comparison) -> str:
    title = "beyond precision at " + rm.code(result["first"]["call"]) if result["first"] else "within precision"
    lines = [f"# dumpdiff compare: {title}", "", f"**Verdict:** {rm.text(result['summary'])}", ""]
    lines += [f"- **A (reference):** {rm.text(describe_side(result['a']))}"]
    lines += [f"- **B (under test):** {rm.text(describe_side(result['b']))}", ""]
    lines += ["## Alignment proof", ""] + [f"- {rm.text(p, line_start=True)}" for p in result["alignment"]["proof"]]
    lines += ["", "## Mapping and precision", ""] + [f"- {rm.text(f, line_start=True)}" for f in _facts(result)]
    for op, what in (
        (result["first"], "First beyond its precision"),
        (result["adds_most"], "Op that adds the most"),
    ):
        if op:
            lines += ["", f"## {what}", ""] + [
                f"- {rm.text(line.strip(), line_start=True)}" for line in _op_lines(op, "op")
            ]
    rows = [
        [rm.code(c[0], table=True)] + [rm.text(x) for x in c[1:]]
        for c in map(_op_cells, result["ops"][:MAX_TABLE_ROWS])
    ]
    lines += ["", "## Ops", ""] + rm.table(OP_HEADER, rows)
    more = left_out(len(result["ops"]), len(rows), "ops")
    lines += ["", f"*{more}*"] if more else []
    lines += [""] + [f"> **Warning:** {rm.text(w)}" for w in result["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def to_html(result: Comparison) -> str:
    esc, code = rh.esc, rh.code
    title = f"dumpdiff compare: {headline(result)}"
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="verdict{"" if result["divergence"] else " ok"}">{esc(result["summary"])}</p>',
        f"<dl><dt>A (reference)</dt><dd>{esc(describe_side(result['a']))}</dd>"
        f"<dt>B (under test)</dt><dd>{esc(describe_side(result['b']))}</dd></dl>",
        '<h2>Alignment proof</h2><ul class="proof">'
        + "".join(f'<li><span class="ok-mark">&#10003;</span> {esc(p)}</li>' for p in result["alignment"]["proof"])
        + "</ul>",
        "<h2>Mapping and precision</h2><ul>" + "".join(f"<li>{esc(f)}</li>" for f in _facts(result)) + "</ul>",
    ]
    for op, what in (
        (result["first"], "First beyond its precision"),
        (result["adds_most"], "Op that adds the most"),
    ):
        if op:
            body.append(
                f"<h2>{what}</h2><ul>"
                + "".join(f"<li>{esc(line.strip())}</li>" for line in _op_lines(op, "op"))
                + "</ul>"
            )
    rows = ([code(c[0])] + [esc(x) for x in c[1:]] for c in map(_op_cells, result["ops"]))
    body.append("<h2>Ops</h2>" + rh.table([esc(h) for h in OP_HEADER], rows, len(result["ops"]), "ops"))
    body += [f'<p class="warn"><b>Warning:</b> {esc(w)}</p>' for w in result["warnings"]]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{rh.CSP}">'
        f"<title>{esc(title)}</title><style>{rh.STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
