"""What the Markdown and HTML reports say, as plain strings; each renderer escapes for its syntax.

Keeping the wording here means a ticket pasted as Markdown and one attached as HTML never tell
different stories. Nothing in this module escapes: strings from a dump stay raw until the
renderer that writes them out escapes them.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Dict, List, Optional, Tuple

from ..verdict.kinds import STATE_BUG, kind_of, kind_parts, rank_kind
from ..verdict.phrases import (  # noqa: F401
    GAP_CODE,
    NOISE_ONLY,
    NOT_COMPARABLE_NOTE,
    clean_unit,
    input_error,
    noise_place,
    noise_place_parts,
    unstored_text,
)
from ..wording import CONTROL, agree, escape_controls, fmt_num, noun, plural  # noqa: F401  (the renderers read them as rc.*)

MAX_TABLE_ROWS = 200  # rows shown per table; a huge dump must not make a huge ticket

# First numbered component of a module path: "model.layers.12.mlp" -> 12.
_LAYER = re.compile(r"\.(\d+)(?=[.#]|$)")


def clean(value) -> str:
    """Any value as printable text: control bytes and unpaired surrogates (from hostile or broken
    dump metadata) become backslash escapes, so writing the report as UTF-8 cannot fail."""
    text = "" if value is None else str(value)
    text = escape_controls(text, keep="\t")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def layer_of(call: str) -> Optional[int]:
    found = _LAYER.search(call.split("#")[0])
    return int(found.group(1)) if found else None


def rank_label(result: dict, rank: str) -> str:
    """Suffix naming the rank, only when there is more than one (single-GPU tickets stay terse)."""
    return f" (rank {rank})" if len(result["ranks"]) > 1 else ""


def culprit_rank(result: dict) -> Optional[Tuple[str, dict]]:
    for rank, verdict in result["ranks"].items():
        if verdict.get("culprit"):
            return rank, verdict
    return None


def noise_culprit(result: dict) -> Optional[dict]:
    """The first noise-aware culprit of the first rank that has one: the error a ticket is about."""
    return next((c for v in result["ranks"].values() for c in (v.get("noise") or {}).get("culprits", [])), None)


def headline_parts(result: dict) -> List[Tuple[str, bool]]:
    """The first words of every report, as (text, is_name) pieces: "NO DIVERGENCE", "DIVERGENCE
    (batch-variance)", "DIVERGENCE (state bug at X)"; the kind is the worst over the ranks."""
    if not result["divergence"]:
        return [("NO DIVERGENCE", False)]
    return [("DIVERGENCE (", False), *kind_parts(kind_of(result), noise_culprit(result)), (")", False)]


def headline_names_place(result: dict) -> bool:
    """Whether the headline already names where the error is (a state bug's place), so a title
    need not add title_place's."""
    return bool(result["divergence"]) and kind_of(result) == STATE_BUG and noise_culprit(result) is not None


def rank_kind_parts(verdict: dict) -> List[Tuple[str, bool]]:
    """One rank's kind, as headline_parts says the result's: "batch-variance", "state bug at X"."""
    culprits = (verdict.get("noise") or {}).get("culprits") or [None]
    return kind_parts(verdict.get("kind") or rank_kind(verdict), culprits[0])


def diverged_rank_parts(result: dict) -> List[Tuple[str, bool]]:
    """The ranks that diverge with their kinds: "0 (state bug at X), 1 (batch-variance)"."""
    parts: List[Tuple[str, bool]] = []
    for rank in result["diverged_ranks"]:
        parts += [(", ", False)] * bool(parts) + [
            (f"{rank} (", False),
            *rank_kind_parts(result["ranks"][str(rank)]),
            (")", False),
        ]
    return parts


def title_place(result: dict) -> Optional[Tuple[str, str]]:
    """(word, call) for a report's title: the call the real error is in, else the first bit flip;
    a gap no dumped call encloses is "before" the call whose input shows it."""
    found, real = culprit_rank(result), noise_culprit(result)
    if not found:
        return None
    if real is None:
        return "in", found[1]["culprit"]["call"]
    return ("before" if real.get("gap_before") == real["call"] else "in"), real["call"]


def verdict_parts(result: dict) -> List[Tuple[str, bool]]:
    """The answer in one sentence, as (text, is_name) pieces: renderers show names as code. A
    real error beyond float noise leads: it is what the ticket is about, the first bit flip
    may be batch-variance only."""
    found = culprit_rank(result)
    if found:
        rank, verdict = found
        c = verdict["culprit"]
        real = noise_culprit(result)
        lead = (
            [
                ("DIVERGENCE: a real error introduced ", False),
                *noise_place_parts(real),
                (f" on {plural(real['rows'], 'row')} (beyond float noise); first bit flip at ", False),
            ]
            if real
            else [("DIVERGENCE: first divergent operator ", False)]
        )
        return lead + [
            (c["call"], True),
            (" [", False),
            (c["cls"], True),
            (
                f"]{rank_label(result, rank)}, {c['n_rows']} of "
                f"{plural(verdict['rows_compared'], 'compared token row')}; "
                f"{plural(verdict['rows_differing'], 'row', 'differ')} in all; max abs error "
                f"{fmt_num(c.get('max_abs'))}",
                False,
            ),
        ]
    compared = sum(v["rows_compared"] for v in result["ranks"].values())
    differing = sum(v["rows_differing"] for v in result["ranks"].values())
    if result["divergence"]:
        return [
            (
                f"DIVERGENCE: {differing} of {plural(compared, 'compared token row')} "
                f"{agree(differing, 'differ')}, but no hooked call has clean "
                "inputs and a differing output; widen DUMPER_FILTER",
                False,
            )
        ]
    every = "the" if compared == 1 else "all"
    return [
        (
            f"NO DIVERGENCE: {every} {plural(compared, 'compared token row', 'are')} bit-identical in every compared "
            "tensor",
            False,
        )
    ]


def verdict_line(result: dict) -> str:
    return clean("".join(piece for piece, _ in verdict_parts(result)))


def environment_rows(result: dict) -> List[Tuple[str, str, str]]:
    """(field, reference value, test value) for the environment table of both runs."""
    a, b = result["a"], result["b"]

    def versions(side):
        return ", ".join(f"{k} {v}" for k, v in sorted((side.get("versions") or {}).items())) or "n/a"

    def flags(side):
        return ", ".join(f"{k}={v}" for k, v in sorted((side.get("flags") or {}).items(), key=str)) or "none"

    def plain(key):
        return lambda side: "n/a" if side.get(key) is None else str(side.get(key))

    fields = [
        ("label", plain("label")),
        ("path", plain("path")),
        ("engine", plain("engine")),
        ("versions", versions),
        ("model", plain("model")),
        ("dtype", plain("dtype")),
        ("device", plain("device")),
        ("tp size", plain("tp_size")),
        ("flags", flags),
        ("passes", plain("passes")),
        ("ranks", lambda s: ", ".join(str(r) for r in s.get("ranks") or [])),
        ("incomplete", lambda s: s.get("incomplete") or "no"),
    ]
    return [(name, clean(get(a)), clean(get(b))) for name, get in fields]


def row_name(row: dict) -> str:
    return f"{row['seq']}@{row['pos']}"


def shell_quote(path: str) -> str:
    """shlex.quote, except that a path with control bytes gets bash's $'...' form: still the exact
    path, but printable, so no raw escape sequence reaches a terminal or a ticket."""
    if not CONTROL.search(path):
        return shlex.quote(path)
    body = "".join(f"\\x{ord(ch):02x}" if CONTROL.match(ch) or ch in "'\\" else ch for ch in path)
    return f"$'{body}'"


def reproduce_command(result: dict) -> str:
    """The exact command, with its verdict-changing options, quoted for a POSIX shell (bash for
    odd paths)."""
    # absolute: the command is pasted into a ticket and run from anywhere on that machine
    paths = (clean(shell_quote(os.path.abspath(result[side]["path"]))) for side in ("a", "b"))
    options = (clean(shell_quote(str(option))) for option in result.get("options", []))
    return "dumpdiff first-divergence " + " ".join([*paths, *options])


def error_items(culprit: dict) -> List[Tuple[str, str]]:
    """(figure, value) pairs of the culprit's output error."""
    items = [
        ("max abs", fmt_num(culprit.get("max_abs"))),
        ("max ulp", fmt_num(culprit.get("max_ulp"))),
        ("relative", fmt_num(culprit.get("rel"))),
        ("elements differing", f"{culprit.get('elements_differ', '?')} of {culprit.get('elements', '?')}"),
        ("dtype", clean(culprit.get("dtype") or "?")),
    ]
    if culprit.get("ref_absmax") is not None:
        items.append(("reference max |x|", fmt_num(culprit["ref_absmax"])))
    if culprit.get("error_note"):
        items.append(("note", clean(culprit["error_note"])))
    return items


def shape_sides(result: dict, culprit: dict) -> List[Dict[str, str]]:
    """Per side: label, pass, M and 'slot shape' strings of the culprit call."""
    sides = []
    for key in ("a", "b"):
        info = culprit["shapes"][key]
        sides.append(
            {
                "label": clean(result[key]["label"]),
                "pass": str(info["pass"]),
                "M": str(info["M"]),
                "tensors": [(clean(slot), clean(shape)) for slot, shape in info["tensors"].items()],
            }
        )
    return sides


def alignment_items(result: dict, verdict: dict) -> List[Tuple[bool, str]]:
    """(checked, text) items of the alignment proof; unchecked ones are caveats, not failures
    (a failed proof never reaches a report: the command stops with exit 2)."""
    align = verdict["alignment"]
    items = [(True, clean(line)) for line in align["proof"]]
    if align.get("unaligned_b") or align.get("unkeyed_b"):
        items.append(
            (
                False,
                f"{plural(align['unaligned_b'], 'row')} of {clean(result['b']['label'])} "
                f"{agree(align['unaligned_b'], 'have')} no partner in "
                f"{clean(result['a']['label'])} and {align['unkeyed_b']} "
                f"{agree(align['unkeyed_b'], 'have')} an unknown prefix: not compared",
            )
        )
    if verdict.get("rows_unstored"):
        items.append((False, unstored_text(verdict)))
    return items


def left_out(total: int, shown: int, what: str) -> Optional[str]:
    """'5 more calls not shown (first 200 of 205)'; ``what``: the singular noun."""
    return f"{plural(total - shown, 'more ' + what)} not shown (first {shown} of {total})" if total > shown else None


# ---- noise-aware verdict -------------------------------------------------------------------


def jump_text(jump: dict) -> str:
    """A listed jump's size against the line it was judged by: 3.1x/8x."""
    return f"{fmt_num(jump['amplification'])}x" + (f"/{fmt_num(jump['line'])}x" if jump.get("line") else "")


def noise_rule(noise: dict) -> str:
    """The rule the noise-aware verdict applied, in words."""
    rule = noise["rule"]
    if "atol" in rule:
        how = (
            f"tolerance atol={fmt_num(rule['atol'])}, rtol={fmt_num(rule['rtol'])}: a call whose inputs are within "
            "tolerance and whose output is not introduces an error"
        )
    else:
        how = (
            f"amplification (output error / max(input error, floor)) above {fmt_num(rule['amplification'])}x, "
            f"derived from {plural(rule['samples'], 'call error')} of this run"
            + (
                f" (leaving out {rule['left_out']} made after an error introduced on their row)"
                if rule.get("left_out")
                else ""
            )
            + (f" (median {fmt_num(rule['median'])}x)" if rule.get("median") is not None else "")
            + (
                f", and an output error of at least {fmt_num(rule['min_ulps'])} epsilons"
                if rule.get("min_ulps")
                else ""
            )
            + (
                f"; a call with bit-identical inputs and a 16-bit output, above {fmt_num(rule['clean_input_16bit'])} "
                f"{clean_unit(rule)} (another float32 summation order moves it an ulp or two)"
                if rule.get("clean_input_16bit")
                else ""
            )
            + (
                f"; a call with bit-identical inputs and a float32 output, above {fmt_num(rule['clean_input_float32'])} "
                f"{clean_unit(rule)} (another order of a reduction that cancels moves it by tens)"
                if rule.get("clean_input_float32")
                else ""
            )
            + (
                f"; in code no hook saw (between dumped calls), a jump above {fmt_num(rule['gap_amplification'])}x"
                if rule.get("gap_amplification")
                else ""
            )
            + (
                f"; where the same op in at least two other layers carried an error too, its line is "
                f"{fmt_num(rule['peer_factor'])}x their largest jump, and at least {fmt_num(rule['min_peer_jump'])}x "
                "(an op amplifies noise alike in every layer; a state bug stands out of its layer)"
                if rule.get("peer_factor")
                else ""
            )
        )
    if rule.get("floor_from_repeat"):
        how += "; each call's noise floor from a repeat run of the reference"
    return how


def noise_sampled(noise: dict) -> Optional[str]:
    if noise["rows_examined"] == noise["rows_total"]:
        return None
    return (
        f"{noise['rows_examined']} of {plural(noise['rows_total'], 'row')} examined (an even sample per row kind, "
        "and rows of each strict per-row culprit)"
    )


def kinds_text(kinds: Dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in kinds.items())


NO_NOISE_CULPRIT = f"No call introduces an error beyond float noise: {NOISE_ONLY}"


def gap_note(culprit: dict) -> str:
    """After a gap culprit's call name: that the error is in its input, made by code not dumped."""
    if not culprit.get("gap_before"):
        return ""
    return f" (in {noise_place(culprit)}: {GAP_CODE})"


# ---- MoE routing flips ---------------------------------------------------------------------


def routing_headline(flips: List[dict]) -> str:
    flipped = [f for f in flips if f.get("rows_flipped")]
    if not flipped:
        rows = max(f["rows_differing"] for f in flips)
        return (
            f"Router outputs differ on up to {plural(rows, 'row')} in {plural(len(flips), 'router call')}, but no "
            "row's selected experts changed."
        )
    first = flipped[0]
    total = sum(f["rows_flipped"] for f in flipped)
    where = f"layer {first['layer']}" if first.get("layer") is not None else "the first router"
    return (
        f"The selected experts changed on {plural(total, 'token row')} (summed over "
        f"{plural(len(flipped), 'router call')}), first at {where} ({first['call']}, {first['rows_flipped']} of "
        f"{plural(first['rows_compared'], 'row')}): a tiny router "
        "difference sends a token row through other experts, so its output differs by far more than the router's."
    )


def flip_example(example: dict) -> Tuple[str, str]:
    """(row name, 'kind: [experts in A] -> [experts in B]') of one flipped row."""
    return row_name(example), f"{example['kind']}: {example['experts_a']} -> {example['experts_b']}"


def k_text(entry: dict) -> str:
    return f"top-{entry['k']} ({entry['k_from']})" if entry.get("k") else "top-k unknown"
