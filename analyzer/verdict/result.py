"""The first-divergence result, typed: what `dumpdiff first-divergence --format json` writes, key
for key, and what every report format reads.

The result stays a tree of plain dicts and lists (it is JSON as it is made, and a library caller
gets it from ``first_divergence``); these TypedDicts say which keys each part holds and what
they mean. ``docs/schemas/first-divergence.schema.json`` is generated from them
(``python -m dumpdiff.analyzer.verdict.result``), and the tests validate every JSON report they
make against it: a key added here and not there, or made and not declared, fails.

Row errors are relative to the row's largest finite |x|; "amplification" is a call's output
error over its input error; "line" is the amplification above which a jump is named.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, TypedDict, Union

# Said first in the JSON report, so a reader can tell what it holds before trusting its keys; the
# version goes up when a key changes meaning or goes away (new keys keep it).
JSON_FORMAT, JSON_VERSION = "dumpdiff-first-divergence", 1

Kind = Literal["none", "batch-variance", "not-judged", "state-bug"]  # see kinds.py
RowKind = str  # a token row's pass mode: prefill, extend, decode, mixed, unknown


class Side(TypedDict):
    """One dump as the report names it (``a``: the reference, ``b``: the run under test)."""

    path: str
    label: str
    engine: Optional[str]
    model: Optional[str]
    dtype: Optional[str]
    device: Optional[str]
    tp_size: Optional[int]
    versions: Dict[str, str]
    flags: Dict[str, object]
    passes: int
    ranks: List[int]
    incomplete: Optional[str]  # why dumping stopped early (disk limit, error), if it did


class RowRef(TypedDict):
    seq: str
    pos: int
    kind: RowKind


class ShapeSide(TypedDict):
    pass_: int  # (JSON key "pass")
    M: int  # valid token rows of the pass
    tensors: Dict[str, str]  # slot -> shape, e.g. "in.0": "[1, 18, 64]"


class _CulpritBase(TypedDict):
    call: str
    module: str
    cls: str
    rows: List[RowRef]  # the first rows where it made the difference (up to a few)
    n_rows: int
    note: Optional[str]
    victims: int  # later calls whose rows differ because of it
    max_abs: Optional[float]
    max_ulp: Optional[int]
    rel: Optional[float]
    dtype: Optional[str]  # None with the figures: a fingerprint dump holds no values (error_note says so)
    tensor: str  # the output tensor the figures are of
    shapes: Dict[str, ShapeSide]  # "a", "b"


class StrictCulprit(_CulpritBase, total=False):
    """The first call whose inputs are bit-identical on both sides and whose output is not."""

    elements_differ: int
    elements: int
    ref_absmax: float
    error_note: str  # why the figures are partial or missing


class NotComparable(TypedDict):
    call: str
    why: str


class NonFinite(TypedDict):
    tensor: str
    rows: int
    nonfinite_a: int
    nonfinite_b: int


class DifferingRow(TypedDict):
    seq: str
    pos: int
    id: int
    kind: RowKind
    ref_kind: RowKind
    culprit: str


class Group(TypedDict):
    call: str
    module: str
    cls: str
    rows: int


class TimelineCall(TypedDict):
    call: str
    cls: str
    order: int
    rows: int
    rows_in_differ: int
    rows_out_differ: int
    rows_origin: int


class _NoiseRuleBase(TypedDict):
    floor_from_repeat: bool  # lines for clean inputs come from a repeat run (--noise)


class NoiseRule(_NoiseRuleBase, total=False):
    """The lines this run's verdict drew (derived from its own call errors unless overridden)."""

    amplification: float
    median: float
    mad: float
    samples: int
    left_out: int
    min_ulps: float
    clean_input_16bit: float
    clean_input_float32: float
    gap_amplification: float
    peer_factor: float
    min_peer_jump: float
    atol: float
    rtol: float
    rows_flipped_by_noise: int


class _NoiseCulpritBase(TypedDict):
    call: str
    module: str
    cls: str
    rows: int
    kinds: Dict[str, int]  # row kind -> rows
    in_err: float
    out_err: float
    amplification: float
    sample_rows: List[RowRef]


class NoiseCulprit(_NoiseCulpritBase, total=False):
    """A call (or the code between two dumped calls) that adds an error beyond float noise."""

    peers: float  # the same op's largest jump in other layers
    inside_err: float  # the largest error of the calls inside it
    gap_after: str
    gap_before: str  # set: the error is made in code no hook saw, before this call
    gap_uncompared: List[str]


class _NoiseRowBase(TypedDict):
    seq: str
    pos: int
    kind: RowKind
    culprit: str
    in_err: float
    out_err: float
    amplification: float


class NoiseRow(_NoiseRowBase, total=False):
    gap_after: str
    gap_before: str


class _JumpBase(TypedDict):
    call: str
    in_err: float
    out_err: float
    amplification: float


class Jump(_JumpBase, total=False):
    line: float
    peers: float
    gap: bool


class Suspect(TypedDict):
    """A jump far above its peers that is not named, with what would settle it."""

    call: str
    gap: bool
    amplification: float
    line: float
    peers: float
    out_err: float
    precision_eps: float
    why: str


class _NoiseVerdictBase(TypedDict):
    rule: NoiseRule
    rows_examined: int
    rows_total: int
    culprits: List[NoiseCulprit]
    per_row: List[NoiseRow]
    bytes_read: int
    top_jumps: List[Jump]


class NoiseVerdict(_NoiseVerdictBase, total=False):
    suspects: List[Suspect]


class FlipExample(TypedDict):
    seq: str
    pos: int
    kind: RowKind
    experts_a: List[int]
    experts_b: List[int]


class _RoutingFlipBase(TypedDict):
    layer: Optional[int]
    call: str
    module: str
    cls: str
    k: Optional[int]
    k_from: str
    num_experts: Optional[int]
    rows_compared: int
    rows_differing: int
    rows_flipped: int
    kinds: Dict[str, int]
    examples: List[FlipExample]


class RoutingFlip(_RoutingFlipBase, total=False):
    """An MoE router whose selected experts changed between the two runs."""

    note: str


class Alignment(TypedDict):
    proof: List[str]  # what was checked, in words
    rows_b: int
    unaligned_b: int
    unkeyed_b: int
    embedding: Optional[str]


class _RankVerdictBase(TypedDict):
    rows_compared: int
    rows_unstored: int
    rows_differing: int
    not_comparable: List[NotComparable]
    nonfinite: List[NonFinite]
    culprit: Optional[StrictCulprit]
    per_row: List[DifferingRow]
    groups: List[Group]
    calls_timeline: List[TimelineCall]
    calls_timeline_total: int
    alignment: Alignment
    kind: Kind


class RankVerdict(_RankVerdictBase, total=False):
    """One tensor-parallel rank's verdict."""

    noise: NoiseVerdict  # absent under --strict-only or when no row differs
    summary: str
    routing_flips: List[RoutingFlip]
    note: str
    unattributed: str
    fingerprint_only: List[str]  # the dumps that hold row fingerprints only: no values, no noise-aware verdict


class FirstDivergence(TypedDict):
    """The whole result. ``format`` and ``version`` come first in the JSON report only."""

    a: Side
    b: Side
    ranks: Dict[str, RankVerdict]  # rank (as a string) -> its verdict
    warnings: List[str]
    diverged_ranks: List[int]
    divergence: bool
    kind: Kind
    culprit: Optional[StrictCulprit]  # the first diverged rank's
    options: List[str]  # the command's options that change the verdict


# --- JSON Schema -----------------------------------------------------------------------------

# Python names that stand for JSON keys Python cannot spell.
_KEY = {"pass_": "pass"}
_SCALARS = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    object: {},
}


def json_schema(
    root=FirstDivergence,
    title: str = "dumpdiff first-divergence report",
    header: Optional[dict] = None,
    closed: bool = True,
) -> dict:
    """The JSON Schema (2020-12) of a TypedDict tree: every TypedDict a $def, required keys as the
    class says; ``closed``: no key beyond those declared (additionalProperties false)."""
    import typing

    defs: dict = {}

    def of(tp) -> dict:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp in _SCALARS:
            return dict(_SCALARS[tp])
        if origin is Literal:
            return {"enum": list(args)}
        if origin is Union:
            return {"anyOf": [of(a) for a in args]}
        if origin in (list, List):
            return {"type": "array", "items": of(args[0])}
        if origin in (dict, Dict):
            return {"type": "object", "additionalProperties": of(args[1])}
        if typing.is_typeddict(tp):
            name = tp.__name__
            if name not in defs:
                defs[name] = {}  # (recursion guard)
                hints = typing.get_type_hints(tp)
                required = sorted(_KEY.get(k, k) for k in tp.__required_keys__)
                props = {_KEY.get(k, k): of(v) for k, v in hints.items()}
                body = {"type": "object", "properties": props, "required": required}
                if closed:
                    body["additionalProperties"] = False
                doc = (tp.__doc__ or "").strip()
                if doc and not doc.startswith(name + "("):
                    body = {"description": " ".join(doc.split()), **body}
                defs[name] = body
            return {"$ref": f"#/$defs/{name}"}
        raise TypeError(f"no JSON Schema for {tp!r}")

    top = of(root)
    name = top["$ref"].rsplit("/", 1)[1]
    body = dict(defs.pop(name))
    if header:  # keys the JSON file carries before the result's own
        body["properties"] = {**header, **body["properties"]}
        body["required"] = sorted(set(body["required"]) | set(header))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        **body,
        "$defs": dict(sorted(defs.items())),
    }


def report_schema() -> dict:
    return json_schema(header={"format": {"const": JSON_FORMAT}, "version": {"const": JSON_VERSION}})


if __name__ == "__main__":
    import json
    import sys

    json.dump(report_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
