"""Render a first-divergence result as text or JSON (the dict is the single source of truth)."""

from __future__ import annotations

import json
import re
from typing import List, Tuple

# What a divergence with no call beyond float noise is (the summary and every report say it alike).
NOISE_ONLY = ("the divergence is float noise carried along (batch-variance), not a state bug, unless one stays under "
              "its line (5x the same op's largest jump in other layers and at least 8x, or 30x its input error where "
              "it has no such peers) or under what a kernel makes from identical inputs (8 epsilons of a 16-bit "
              "output, 6% of the row in bfloat16; 100 of a float32 one), which cannot be told from noise.")


# Where a gap (an error made between dumped calls) can be: said by every report alike.
GAP_CODE = ("a module's own forward between its children, modules left out by DUMPER_FILTER, or a dumped call "
            "that could not be compared")


# Verbs whose singular is not the plural + "s".
_SINGULAR_VERBS = {"have": "has", "are": "is", "were": "was", "do": "does"}


def noun(count: int, word: str) -> str:
    """``word`` (singular; of a phrase, its last word) in the number ``count`` asks for: row/rows,
    pass/passes, entry/entries."""
    if count == 1:
        return word
    if re.search(r"(s|x|z|ch|sh)$", word):
        return word + "es"
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + "ies"
    return word + "s"


def plural(count: int, word: str, verb: str = None) -> str:
    """A count with its noun, and a verb given in its plural form, in the right number:
    "1 pass", "2 passes", "1 row differs", "3 rows differ". Reports never say "1 passes"."""
    text = f"{count} {noun(count, word)}"
    return f"{text} {agree(count, verb)}" if verb else text


def agree(count: int, verb: str) -> str:
    """``verb``, given in its plural form, in the number ``count`` asks for: have/has, differ/differs."""
    return verb if count != 1 else _SINGULAR_VERBS.get(verb, verb + "s")


def noise_place_parts(c: dict) -> List[Tuple[str, bool]]:
    """Where a noise-aware culprit introduces its error, as (text, is_name) pieces: at the call,
    or in the code no hook saw between the call completed last and the one whose input shows it."""
    if not c.get("gap_before"):
        return [("at ", False), (c["call"], True), (" [", False), (c["cls"], True), ("]", False)]
    return [("in ", False), *_gap_parts(c)]


def _gap_parts(c: dict) -> List[Tuple[str, bool]]:
    """'code not dumped[ or not compared (X, Y)][ inside P], between A and B' (or 'before B') as
    (text, is_name) pieces."""
    parts = [("code not dumped", False)]
    if c.get("gap_uncompared"):
        parts += [(" or not compared (", False)]
        for k, name in enumerate(c["gap_uncompared"]):
            parts += [(", ", False)] * bool(k) + [(name, True)]
        parts += [(")", False)]
    if c["call"] != c["gap_before"]:
        parts += [(" inside ", False), (c["call"], True)]
    if c.get("gap_after"):
        return parts + [(", between ", False), (c["gap_after"], True), (" and ", False), (c["gap_before"], True)]
    return parts + [(", before ", False), (c["gap_before"], True)]


def noise_place(culprit: dict) -> str:
    """Where a culprit's error is, in plain words without at/in: the call, or the code not dumped."""
    if not culprit.get("gap_before"):
        return culprit["call"]
    return "".join(piece for piece, _ in _gap_parts(culprit))


def clean_unit(rule: dict) -> str:
    """What a line for calls with bit-identical inputs counts: epsilons of the output, or the
    repeat run's floor of the call where one is given (--noise) and larger."""
    return "epsilons (or repeat-run floors, if larger)" if rule.get("floor_from_repeat") else "epsilons"


def input_error(culprit: dict) -> str:
    """A culprit's input error; a call judged against its children's errors says those too."""
    if culprit.get("inside_err"):
        return f"{fmt_num(culprit['in_err'])} (calls inside it: up to {fmt_num(culprit['inside_err'])})"
    return fmt_num(culprit["in_err"])


def noise_errors(culprit: dict) -> str:
    """A culprit's figures in words."""
    if culprit.get("gap_before"):
        return (f"error of what that code was given {fmt_num(culprit['in_err'])}, of what it made "
                f"{fmt_num(culprit['out_err'])} (the input of {culprit['gap_before']}), "
                f"amplification >= {fmt_num(culprit['amplification'])}x")
    return (f"input error {input_error(culprit)}, output error {fmt_num(culprit['out_err'])}, "
            f"amplification >= {fmt_num(culprit['amplification'])}x")


# Said after the count of calls that could not be compared, in every report alike.
NOT_COMPARABLE_NOTE = "the tensors named are not compared row by row; a call is judged on the rest, if any"


# Said first in the JSON output, so a reader can tell what it holds before trusting its keys; the
# version goes up when a key changes meaning or goes away (new keys keep it).
JSON_FORMAT, JSON_VERSION = "dumpdiff-first-divergence", 1


def to_json(result: dict) -> str:
    return json.dumps({"format": JSON_FORMAT, "version": JSON_VERSION, **result}, indent=2, default=str,
                      ensure_ascii=True)


def fmt_num(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def describe_side(side: dict) -> str:
    bits = [side.get("engine") or "?", side.get("model") or "?", side.get("dtype") or "?", side.get("device") or ""]
    return f"{side['label']} ({' '.join(b for b in bits if b)}; {plural(side['passes'], 'pass')}, ranks {side['ranks']})"


def shapes_line(culprit: dict, labels) -> str:
    parts = []
    for side, label in zip(("a", "b"), labels):
        info = culprit["shapes"][side]
        tensors = ", ".join(f"{slot} {shape}" for slot, shape in info["tensors"].items())
        parts.append(f"{label} pass {info['pass']} M={info['M']}: {tensors}")
    return "\n    ".join(parts)


def unstored_text(verdict: dict) -> str:
    return (f"{plural(verdict['rows_unstored'], 'paired row', 'have')} no dumped tensor row on both sides (row selection, "
            "DUMPER_POSITIONS or DUMPER_LAST_ROWS): not compared")


def culprit_lines(culprit: dict, labels, rows_compared: int) -> List[str]:
    rows = ", ".join(f"{r['seq']}@{r['pos']} ({r['kind']})" for r in culprit["rows"][:6])
    more = "" if culprit["n_rows"] <= 6 else f", ... {culprit['n_rows'] - 6} more"
    lines = [
        f"culprit: {culprit['call']}  [{culprit['cls']}]",
        f"  module: {culprit['module']}",
        f"  token rows: {culprit['n_rows']} of {plural(rows_compared, 'compared row')}: {rows}{more}",
        f"  shapes (M = token rows in the pass):\n    {shapes_line(culprit, labels)}",
        f"  error on {culprit['tensor']}: " + (culprit["error_note"] if culprit.get("max_abs") is None else
                                              f"max abs {fmt_num(culprit['max_abs'])}, max ulp {fmt_num(culprit['max_ulp'])}, "
                                              f"rel {fmt_num(culprit['rel'])}, {culprit['elements_differ']} of "
                                              f"{culprit.get('elements', '?')} elements differ"),
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
        how = f"amplification > {rule['amplification']:.3g}x (derived from {samples} of this run" + \
              (f", leaving out {rule['left_out']} made after an error introduced on their row" if rule.get("left_out") else "") + \
              (", floor from a repeat run" if rule.get("floor_from_repeat") else "") + ")" + \
              (f"; from bit-identical inputs, a 16-bit output > {rule['clean_input_16bit']:.3g} {clean_unit(rule)}"
               if rule.get("clean_input_16bit") else "") + \
              (f"; from bit-identical inputs, a float32 output > {rule['clean_input_float32']:.3g} {clean_unit(rule)}"
               if rule.get("clean_input_float32") else "") + \
              (f"; between dumped calls > {rule['gap_amplification']:.3g}x" if rule.get("gap_amplification") else "") + \
              (f"; where the same op in other layers carried an error too, > {rule['peer_factor']:.3g}x their largest "
               f"jump and {rule['min_peer_jump']:.3g}x" if rule.get("peer_factor") else "")
    sampled = "" if noise["rows_examined"] == noise["rows_total"] else \
        f", {noise['rows_examined']} of {plural(noise['rows_total'], 'row')} sampled"
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
    from .common import flip_example, k_text, routing_headline
    lines = [f"routing flips (MoE): {routing_headline(flips)}"]
    for f in flips:
        if f.get("rows_flipped"):
            shown = ", ".join(f"{name} ({what})" for name, what in map(flip_example, f["examples"][:4]))
            more = "" if f["rows_flipped"] <= 4 else f", ... {f['rows_flipped'] - 4} more"
            lines.append(f"  layer {fmt_num(f['layer'])} {f['call']}  [{f['cls']}]: {f['rows_flipped']} of "
                         f"{plural(f['rows_compared'], 'row')} flipped, {k_text(f)}: {shown}{more}")
        elif f.get("rows_flipped") is None:
            lines.append(f"  layer {fmt_num(f['layer'])} {f['call']}: {f.get('note', 'top-k unknown')}")
    return lines


def to_text(result: dict) -> str:
    from .common import headline_parts, rank_kind_parts
    from .seqnames import for_reading
    result, note = for_reading(result)
    labels = (result["a"]["label"], result["b"]["label"])
    head = "".join(piece for piece, _ in headline_parts(result))
    out = [f"dumpdiff first-divergence: {head}",
           f"  A (reference):  {describe_side(result['a'])}",
           f"  B (under test): {describe_side(result['b'])}"]
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
            out.append(f"  - {plural(unaligned, 'row')} of {labels[1]} {agree(unaligned, 'have')} no partner "
                       f"in {labels[0]}, {unkeyed} {agree(unkeyed, 'have')} an unknown prefix; they are not "
                       "compared")
        if verdict.get("rows_unstored"):
            out.append(f"  - {unstored_text(verdict)}")
        out.append(f"rows differing: {verdict['rows_differing']} of {verdict['rows_compared']}")
        if verdict["culprit"]:
            out += culprit_lines(verdict["culprit"], labels, verdict["rows_compared"])
        elif verdict.get("note"):
            out.append(f"note: {verdict['note']}")
        if len(verdict["groups"]) > 1 or (verdict["groups"] and verdict["groups"][0]["rows"] < verdict["rows_differing"]):
            out.append("per-row culprits (rows can meet different culprits):")
            out += [f"  {g['rows']:6d} {noun(g['rows'], 'row'):4}  {g['call']}  [{g['cls']}]" for g in verdict["groups"]]
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
            out += [f"  {n['tensor']}: {n['nonfinite_a']} in A, {n['nonfinite_b']} in B" for n in verdict["nonfinite"][:8]]
    if result["diverged_ranks"] and len(result["ranks"]) > 1:
        out.append(f"\nranks that diverge: {result['diverged_ranks']}")
    return terminal_safe("\n".join(out)) + "\n"


# Control characters in names (a module called "esc\x1b]0;title\x07") would drive the terminal
# the report is printed on: each is written as \xNN; line breaks between report lines stay.
_UNSAFE = {c: f"\\x{c:02x}" for c in [*range(0, 9), *range(11, 32), 127, *range(0x80, 0xA0)]}


def terminal_safe(text: str) -> str:
    return text.translate(_UNSAFE)
