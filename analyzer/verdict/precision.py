"""Judge each op of a run against a reference by how far it strays beyond the precision it
computes in.

Two runs of one model in other engines, tensor-parallel sizes or dtypes never agree bit for bit:
each rounds where it computes. Per paired token row and op:

    in_err  = largest relative error of its inputs against the reference's (0: bit-identical)
    out_err = largest relative error of its outputs
    eps     = the epsilon of the coarser of the two sides' output types (bfloat16 against float32:
              bfloat16's; both float32: float32's)
    jump    = out_err / max(in_err, eps)     the error the op adds, in multiples of what came in

A relative error is max |a - b| over the row divided by the reference row's largest |a| (at least
the tensor's typical row magnitude). An op that only rounds, or sums in another order, carries
the error it was given, times a few: its jump stays within a few times what the same op in the
other layers shows. An op that computes something else (a planted bug, a wrong port, a kernel
that loses precision) jumps beyond them. An op is named when its jump is over its line and its
output is at least MIN_EPS epsilons off:

- the same op in the other layers (at least MIN_PEERS of them carrying an error in): PEER_FACTOR
  times the largest jump among them, and at least MIN_PEER_JUMP;
- an op with no such peers: MIN_JUMP;
- an op whose inputs are bit-identical: a float32 output must err by CLEAN_FLOAT32 epsilons
  (another summation order moves a reduction by tens), a 16-bit one by MIN_EPS.

The code between compared tensors is judged the same way (judge_gaps): an op's input error
against the largest error compared before it.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import numpy as np

# the noise-aware verdict's lines, under the names this module's docstring uses
from .noise import MIN_AMPLIFICATION as MIN_JUMP
from .noise import MIN_CLEAN_FLOAT32 as CLEAN_FLOAT32
from .noise import MIN_ULPS as MIN_EPS
from .peers import MIN_PEERS, peer_line

_NUMBER = re.compile(r"(?<=\.)\d+(?=[.#]|$)")


def peer_key(call: str) -> str:
    return _NUMBER.sub("*", call)


def judge(
    calls: List[str],
    in_err: np.ndarray,
    out_err: np.ndarray,
    eps: np.ndarray,
    wide: np.ndarray,
    excused: Optional[np.ndarray] = None,
) -> List[dict]:
    """Per call (in reference order; ``in_err``/``out_err``: [calls, rows], NaN where a row was not
    compared; ``eps``: per call; ``wide``: per call, whether its output is a 4-byte float), its
    figures and whether it strays beyond its precision. ``excused``: [calls, rows] not judged (an
    MoE routing flip explains them)."""
    if excused is not None:
        in_err, out_err = np.where(excused, np.nan, in_err), np.where(excused, np.nan, out_err)
    with np.errstate(invalid="ignore", divide="ignore"):
        jump = out_err / np.maximum(np.nan_to_num(in_err, nan=0.0), eps[:, None])
    return _judged(calls, jump, in_err == 0, np.nan_to_num(in_err, nan=0.0), out_err, eps, wide)


def judge_gaps(
    calls: List[str],
    in_err: np.ndarray,
    out_err: np.ndarray,
    eps: np.ndarray,
    wide: np.ndarray,
    excused: Optional[np.ndarray] = None,
) -> List[dict]:
    """The code between compared tensors, judged as an op is: per call, its input error against
    the largest error of everything compared before it on the row (a port's activation that
    swaps gate and up, compared nowhere, shows as a jump at down_proj's input). Each entry says
    which call came before (``after``); ``excused`` as for judge (what came before counts whole)."""
    before = np.zeros_like(in_err)
    running = np.zeros(in_err.shape[1])
    for c in range(len(calls)):
        before[c] = running
        running = np.fmax(running, np.fmax(np.nan_to_num(in_err[c], nan=0.0), np.nan_to_num(out_err[c], nan=0.0)))
    if excused is not None:
        in_err = np.where(excused, np.nan, in_err)
    with np.errstate(invalid="ignore", divide="ignore"):
        jump = in_err / np.maximum(before, eps[:, None])
    judged = _judged(calls, jump, before == 0, before, in_err, eps, wide)
    for entry in judged:
        entry["after"] = calls[entry["at"] - 1] if entry["at"] else None
    return judged


def _judged(calls, jump, clean, came_in, went_out, eps, wide) -> List[dict]:
    """Per call: its jump (``jump``: [calls, rows]) against its line; ``clean``: rows whose error
    coming in is nil; ``came_in``/``went_out``: the errors in and out, for the figures."""
    carried = np.where(~clean & np.isfinite(jump), jump, np.nan)
    best = np.array([np.nanmax(row) if np.isfinite(row).any() else np.nan for row in carried])
    groups: Dict[str, List[int]] = {}
    for at, call in enumerate(calls):
        groups.setdefault(peer_key(call), []).append(at)
    judged = []
    for at, call in enumerate(calls):
        rows = np.isfinite(went_out[at])
        if not rows.any():
            continue
        peers = [p for p in groups[peer_key(call)] if p != at and np.isfinite(best[p])]
        if len(peers) >= MIN_PEERS:
            largest = float(np.nanmax(best[peers]))
            line, line_from = float(peer_line(np.float64(largest))), f"{len(peers)} peers, largest {largest:.3g}x"
        else:
            line, line_from = MIN_JUMP, "no peers"
        lines = np.where(clean[at], CLEAN_FLOAT32 if wide[at] else MIN_EPS, line)
        out_eps = went_out[at] / eps[at]
        with np.errstate(invalid="ignore"):
            over = (jump[at] > lines) & (out_eps >= MIN_EPS)
            ratio = np.where(np.isfinite(jump[at]), jump[at] / lines, np.nan)
        worst = int(np.nanargmax(ratio)) if np.isfinite(ratio).any() else int(np.nonzero(rows)[0][0])
        judged.append(
            {
                "call": call,
                "at": at,
                "rows": int(rows.sum()),
                "rows_over": int(np.count_nonzero(over)),
                "over": bool(over.any()),
                "worst": worst,
                "jump": _num(jump[at][worst]),
                "line": float(lines[worst]),
                "line_from": "bit-identical inputs" if clean[at][worst] else line_from,
                "in_eps": _num(came_in[at][worst] / eps[at]),
                "out_eps": _num(out_eps[worst]),
                "max_out_eps": _num(np.nanmax(out_eps)),
                "eps": float(eps[at]),
            }
        )
    return judged


def adds_most(judged: List[dict]) -> Optional[dict]:
    """The op that adds the most error: the largest jump (nearest its line on a tie); None where
    no op's output differs at all."""
    finite = [j for j in judged if j["jump"]]
    if not finite:
        return None
    return max(finite, key=lambda j: (j["jump"], j["jump"] / j["line"]))


def _num(value) -> Optional[float]:
    value = float(value)
    return value if np.isfinite(value) else None
