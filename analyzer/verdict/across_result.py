"""The result of `dumpdiff compare`, as typed dicts: the keys each part holds and what they
mean. ``docs/schemas/compare.schema.json`` is generated from them
(``python -m dumpdiff.analyzer.verdict.across_result``); tests check the published schema is
this one and that real reports follow it."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, TypedDict

from .result import Side, json_schema

JSON_FORMAT = "dumpdiff-compare"
JSON_VERSION = 1


class ComparedRow(TypedDict):
    seq: str  # the test run's sequence key
    pos: int
    kind: str  # prefill, extend, decode, mixed (the test run's pass)


class CrossAlignment(TypedDict):
    proof: List[str]  # what was checked, in words
    rows_b: int  # token rows of the test run
    paired: int  # of those, paired with a reference row (same token ids from position 0)
    unaligned_b: int
    unkeyed_b: int
    embedding: Optional[str]  # the embedding module of the test run


class Precision(TypedDict):
    reference: Optional[str]  # the dtype each run was made in (run.json)
    test: Optional[str]


class NotComparableTensor(TypedDict):
    tensor: str
    why: str


class Mapping(TypedDict):
    rules: List[str]  # the mapping rules used, in words
    tensors: int  # tensors compared
    renamed: Dict[str, str]  # test tensor -> reference tensor, paired by role where slot names differ
    not_comparable: List[NotComparableTensor]
    shards: List[str]  # how tensor-parallel shards were joined, per run with several ranks, in words
    joined: Dict[str, Dict[str, str]]  # reference|test -> tensor -> "shards" (side by side) or "sum" (partial sums)


class Op(TypedDict):
    """One op (a call, under the reference's name) judged by the error it adds; or (kind gap) the
    code no compared tensor shows between the call before it (after) and its input."""

    kind: Literal["op", "gap"]
    call: str
    after: Optional[str]  # kind gap: the call compared before that code (null: none)
    module: str
    cls: str  # the reference's class ("" where only the test run has the call)
    cls_b: str  # the test run's class of the call the tensors come from
    source_b: str  # that call, as the test run names it
    outputs_b: List[str]  # the test run's tensors compared as its outputs
    rows: int  # token rows compared
    rows_over: int  # rows where it strays beyond its precision
    over: bool
    row: ComparedRow  # the row nearest (or furthest over) its line
    jump: Optional[float]  # output error / max(input error, eps) there (null: not finite)
    line: float  # the jump that names it
    line_from: str  # where the line comes from (peers, no peers, bit-identical inputs)
    in_eps: Optional[float]  # input error there, in epsilons of the op's precision
    out_eps: Optional[float]  # output error there, in epsilons
    max_out_eps: Optional[float]  # largest output error over its rows, in epsilons
    eps: float  # the epsilon of its precision (the coarser output type of the two runs)


class FirstDifference(TypedDict):
    """Where both runs hold one dtype: the first op whose inputs agree bit for bit and whose
    output does not (the two runs' kernels first differ there)."""

    call: str
    cls: str
    cls_b: str
    rows: int
    row: ComparedRow


class FlipExample(TypedDict):
    seq: str
    pos: int
    kind: str
    experts_a: List[int]  # the experts the reference chose on the row
    experts_b: List[int]  # those the run under test chose


class RoutingFlip(TypedDict):
    """An MoE router whose choice of experts differs between the runs on some compared rows (near
    ties of its scores, rounded otherwise): its block and the modules holding it are not judged
    on those rows."""

    router: str  # the router call (reference name)
    block: str  # the MoE block (the router's parent module)
    k: int  # experts chosen per row
    rows_compared: int
    rows_flipped: int  # rows where each run chose the top k of its own scores: a flip, not judged
    rows_not_top_k: int  # rows where a run's choice is not the top k of its own scores: judged
    examples: List[FlipExample]


class Comparison(TypedDict):
    a: Side  # the reference run
    b: Side  # the run under test
    kind: Literal["within-precision", "beyond-precision"]
    divergence: bool  # an op strays beyond its precision (exit 1)
    alignment: CrossAlignment
    rows_compared: int  # token row pairs whose values were read (an even sample beyond 512)
    precision: Precision
    mapping: Mapping
    ops: List[Op]  # every op compared, in the reference's completion order
    gaps: List[Op]  # code between compared tensors that adds an error beyond precision
    culprits: List[str]  # the ops (and code not compared) beyond their precision, in order
    first: Optional[Op]  # the first of them (an op or a gap)
    adds_most: Optional[Op]  # the op with the largest jump
    first_difference: Optional[FirstDifference]
    routing_flips: List[RoutingFlip]  # MoE routers that chose other experts on some rows
    warnings: List[str]
    summary: str


def compare_schema() -> dict:
    return json_schema(
        Comparison,
        "dumpdiff compare report",
        header={"format": {"const": JSON_FORMAT}, "version": {"const": JSON_VERSION}},
    )


if __name__ == "__main__":
    import json
    import sys

    json.dump(compare_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
