"""Render a first-divergence result as text or JSON (the dict is the single source of truth)."""

from __future__ import annotations

import json
from typing import List

from ..verdict.phrases import GAP_CODE, NOT_COMPARABLE_NOTE, clean_unit, noise_errors, noise_place, unstored_text
from ..verdict.result import JSON_FORMAT, JSON_VERSION, FirstDivergence
from ..wording import agree, fmt_num, noun, plural, terminal_safe
from .common import flip_example, headline_parts, k_text, rank_kind_parts, routing_headline
from .seqnames import for_reading


def to_json(result: FirstDivergence) -> str:
    return json.dumps(
        {"format": JSON_FORMAT, "version": JSON_VERSION, **result}, indent=2, default=str, ensure_ascii=True
    )


def describe_side(side: dict) -> str:
    bits = [side.get("engine") or "?", side.get("model") or "?", side.get("dtype") or "?", side.get("device") or ""]
    return (
        f"{side['label']} ({' '.join(b for b in bits if b)}; {plural(side['passes'], 'pass')}, ranks {side['ranks']})"
    )


def shapes_line(culprit: dict, labels) -> str:
    parts = []
    for side, label in zip(("a", "b"), labels):
        info = culprit["shapes"][side]
        tensors = ", ".join(f"{slot} {shape}" for slot, shape in info["tensors"].items())
        parts.append(f"{label} pass {info['pass']} M={info['M']}: {tensors}")
    return "\n    ".join(parts)


def culprit_lines(culprit: dict, labels, rows_compared: int) -> List[str]:
    rows = ", ".join(f"{r['seq']}@{r['pos']} ({r['kind']})" for r in culprit["rows"][:6])
    more = "" if culprit["n_rows"] <= 6 else f", ... {culprit['n_rows'] - 6} more"
    lines = [
        f"culprit: {culprit['call']}  [{culprit['cls']}]",
        f"  module: {culprit['module']}",
        f"  token rows: {culprit['n_rows']} of {plural(rows_compared, 'compared row')}: {rows}{more}",
        f"  shapes (M = token rows in the pass):\n    {shapes_line(culprit, labels)}",
        f"  error on {culprit['tensor']}: "
        + (
            culprit["error_note"]
            if culprit.get("max_abs") is None
            else f"max abs {fmt_num(culprit['max_abs'])}, max ulp {fmt_num(culprit['max_ulp'])}, "
            f"rel {fmt_num(culprit['rel'])}, {culprit['elements_differ']} of "
            f"{culprit.get('elements', '?')} elements differ"
        ),
        f"  victims: {plural(culprit['victims'], 'later call', 'differ')} because of it",
    ]
    if culprit.get("error_note") and culprit.get("max_abs") is not None:
        lines.append(f"  note on the error: {culprit['error_note']}")
    if culprit.get("note"):
        lines.append(f"  note: {culprit['note']}")
    return lines


def noise_lines(noise: dict) -> List[str]:
    rule = noise["rule"]
    if "atol" in rule:
        how = f"tolerance atol={rule['atol']} rtol={rule['rtol']}"
    else:
        samples = plural(rule["samples"], "call error")
        how = (
            f"amplification > {rule['amplification']:.3g}x (derived from {samples} of this run"
            + (
                f", leaving out {rule['left_out']} made after an error introduced on their row"
                if rule.get("left_out")
                else ""
            )
            + (", floor from a repeat run" if rule.get("floor_from_repeat") else "")
            + ")"
            + (
                f"; from bit-identical inputs, a 16-bit output > {rule['clean_input_16bit']:.3g} {clean_unit(rule)}"
                if rule.get("clean_input_16bit")
                else ""
            )
            + (
                f"; from bit-identical inputs, a float32 output > {rule['clean_input_float32']:.3g} {clean_unit(rule)}"
                if rule.get("clean_input_float32")
                else ""
            )
            + (f"; between dumped calls > {rule['gap_amplification']:.3g}x" if rule.get("gap_amplification") else "")
            + (
                f"; where the same op in other layers carried an error too, > {rule['peer_factor']:.3g}x their largest "
                f"jump and {rule['min_peer_jump']:.3g}x"
                if rule.get("peer_factor")
                else ""
            )
        )
    sampled = (
        ""
        if noise["rows_examined"] == noise["rows_total"]
        else f", {noise['rows_examined']} of {plural(noise['rows_total'], 'row')} sampled"
    )
    lines = [f"noise-aware verdict ({how}{sampled}):"]
    if not noise["culprits"]:
        lines.append("  no call introduces an error beyond float noise")
    for c in noise["culprits"]:
        kinds = ", ".join(f"{n} {k}" for k, n in c["kinds"].items())
        where = f"in {noise_place(c)}" if c.get("gap_before") else f"at {c['call']}  [{c['cls']}]"
        lines.append(f"  introduced {where}: {plural(c['rows'], 'row')} ({kinds}); {noise_errors(c)}")
        if c.get("gap_before"):
            lines.append(f"    (code no hook saw: {GAP_CODE})")
    if noise.get("top_jumps"):
        from .common import jump_text

        jumps = ", ".join(f"{j['call']} {jump_text(j)}" for j in noise["top_jumps"][:4])
        lines.append(f"  largest jumps against their lines (jump/line): {jumps}")
    return lines


def routing_lines(flips: List[dict]) -> List[str]:
    lines = [f"routing flips (MoE): {routing_headline(flips)}"]
    for f in flips:
        if f.get("rows_flipped"):
            shown = ", ".join(f"{name} ({what})" for name, what in map(flip_example, f["examples"][:4]))
            more = "" if f["rows_flipped"] <= 4 else f", ... {f['rows_flipped'] - 4} more"
            lines.append(
                f"  layer {fmt_num(f['layer'])} {f['call']}  [{f['cls']}]: {f['rows_flipped']} of "
                f"{plural(f['rows_compared'], 'row')} flipped, {k_text(f)}: {shown}{more}"
            )
        elif f.get("rows_flipped") is None:
            lines.append(f"  layer {fmt_num(f['layer'])} {f['call']}: {f.get('note', 'top-k unknown')}")
    return lines


def to_text(result: FirstDivergence) -> str:
    result, note = for_reading(result)
    labels = (result["a"]["label"], result["b"]["label"])
    head = "".join(piece for piece, _ in headline_parts(result))
    out = [
        f"dumpdiff first-divergence: {head}",
        f"  A (reference):  {describe_side(result['a'])}",
        f"  B (under test): {describe_side(result['b'])}",
    ]
    out += [f"  warning: {w}" for w in result.get("warnings", [])]
    out += [f"  note: {note}"] if note else []
    for rank, verdict in result["ranks"].items():
        out.append("")
        if len(result["ranks"]) > 1:
            kind = "".join(piece for piece, _ in rank_kind_parts(verdict))
            out.append(f"== rank {rank}: {f'diverges ({kind})' if verdict['rows_differing'] else 'identical'}")
        align = verdict["alignment"]
        trusted = any("--trust-alignment" in line for line in align["proof"])
        out.append("alignment proof: ids and positions only (trusted)" if trusted else "alignment proof: OK")
        out += [f"  - {line}" for line in align["proof"]]
        if align["unaligned_b"] or align["unkeyed_b"]:
            unaligned, unkeyed = align["unaligned_b"], align["unkeyed_b"]
            out.append(
                f"  - {plural(unaligned, 'row')} of {labels[1]} {agree(unaligned, 'have')} no partner "
                f"in {labels[0]}, {unkeyed} {agree(unkeyed, 'have')} an unknown prefix; they are not "
                "compared"
            )
        if verdict.get("rows_unstored"):
            out.append(f"  - {unstored_text(verdict)}")
        out.append(f"rows differing: {verdict['rows_differing']} of {verdict['rows_compared']}")
        if verdict["culprit"]:
            out += culprit_lines(verdict["culprit"], labels, verdict["rows_compared"])
        elif verdict.get("note"):
            out.append(f"note: {verdict['note']}")
        if len(verdict["groups"]) > 1 or (
            verdict["groups"] and verdict["groups"][0]["rows"] < verdict["rows_differing"]
        ):
            out.append("per-row culprits (rows can meet different culprits):")
            out += [
                f"  {g['rows']:6d} {noun(g['rows'], 'row'):4}  {g['call']}  [{g['cls']}]" for g in verdict["groups"]
            ]
        if verdict.get("noise"):
            out += noise_lines(verdict["noise"])
        if verdict.get("summary"):
            out.append(f"summary: {verdict['summary']}")
        if verdict.get("routing_flips"):
            out += routing_lines(verdict["routing_flips"])
        if verdict["not_comparable"]:
            out.append(f"not comparable ({plural(len(verdict['not_comparable']), 'call')}: {NOT_COMPARABLE_NOTE}):")
            out += [f"  {n['call']}: {n['why']}" for n in verdict["not_comparable"][:8]]
        if verdict["nonfinite"]:
            out.append("non-finite values (NaN/Inf), compared bit by bit:")
            out += [
                f"  {n['tensor']}: {n['nonfinite_a']} in A, {n['nonfinite_b']} in B" for n in verdict["nonfinite"][:8]
            ]
    if result["diverged_ranks"] and len(result["ranks"]) > 1:
        out.append(f"\nranks that diverge: {result['diverged_ranks']}")
    return terminal_safe("\n".join(out)) + "\n"
