"""Sentences about a culprit that the verdict's summary and every report format say alike (the CLI's
one-line headline and `localize`)."""

from __future__ import annotations

from typing import List, Tuple

from ..wording import fmt_num, plural

# What a divergence with no call beyond float noise is (the summary and every report say it alike).
NOISE_ONLY = (
    "the divergence is float noise carried along (batch-variance), not a state bug, unless one stays under "
    "its line (5x the same op's largest jump in other layers and at least 8x, or 30x its input error where "
    "it has no such peers) or under what a kernel makes from identical inputs (8 epsilons of a 16-bit "
    "output, 6% of the row in bfloat16; 100 of a float32 one), which cannot be told from noise."
)


# Where a gap (an error made between dumped calls) can be: said by every report alike.
GAP_CODE = (
    "a module's own forward between its children, modules left out by DUMPER_FILTER, or a dumped call "
    "that could not be compared"
)


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
        return (
            f"error of what that code was given {fmt_num(culprit['in_err'])}, of what it made "
            f"{fmt_num(culprit['out_err'])} (the input of {culprit['gap_before']}), "
            f"amplification >= {fmt_num(culprit['amplification'])}x"
        )
    return (
        f"input error {input_error(culprit)}, output error {fmt_num(culprit['out_err'])}, "
        f"amplification >= {fmt_num(culprit['amplification'])}x"
    )


# Said after the count of calls that could not be compared, in every report alike.
NOT_COMPARABLE_NOTE = "the tensors named are not compared row by row; a call is judged on the rest, if any"


def unstored_text(verdict: dict) -> str:
    return (
        f"{plural(verdict['rows_unstored'], 'paired row', 'have')} no dumped tensor row on both sides (row selection, "
        "DUMPER_POSITIONS or DUMPER_LAST_ROWS): not compared"
    )
