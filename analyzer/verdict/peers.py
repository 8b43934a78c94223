"""The same op in the other layers as the control: a line for each call drawn from its peers.

Float noise carried through a call is amplified by what the call computes (an attention core
over large logits amplifies more than a norm), and the same op in the other layers of the same
run computes alike: the largest jump layer 3's attention shows is within a few times of what
layers 1, 2 and 4 show, whatever the processor, the dtype or the weights. An error a state bug
introduces does not follow its peers: a corrupted KV page at one layer jumped 20x on an H100
in bfloat16 while every other layer's attention stayed at 1-2x; clean float32 runs on random
weights reach 30-40x at every layer alike. No fixed line separates those two; the peers do.

Peers are calls whose names differ only in their numeric path parts (model.layers.7.mlp#0 and
model.layers.2.mlp#0; experts of an MoE too). A call is judged against its peers when at least
MIN_PEERS of them carried an error in and out (MIN_GAP_PEERS for a gap: code no hook saw); its
line is PEER_FACTOR times the largest jump among them (the largest, not a median: depth changes
noise, and a false alarm is worse than a miss), and at least MIN_PEER_JUMP. Calls with no such
peers keep the run-wide line.
"""

from __future__ import annotations

import re
from typing import Sequence, Tuple

import numpy as np

PEER_FACTOR = 5.0  # a jump must stand this far above every peer's largest
MIN_PEER_JUMP = 8.0  # and be at least this: peers near 1x say little about a 5x jump
MIN_PEERS = 2  # one peer is no spread
# Code no hook saw may be anything, and its noise has heavier tails: a Jamba mixer's inlined
# convolution in bfloat16 jumped 14.9x on one row of a clean GPU run, against peers of 1.6x in
# the two other Mamba layers. Three peers at least.
MIN_GAP_PEERS = 3
SUSPECT_FACTOR = 2.5  # under the line but this far above every peer (and MIN_SUSPECT_JUMP): said, not named
MIN_SUSPECT_JUMP = 4.0
_NUMBER = re.compile(r"(?<=\.)\d+(?=[.#]|$)|^\d+(?=[.#]|$)")


def op_classes(calls: np.ndarray, kinds: Sequence[str] = ()) -> np.ndarray:
    """Per call name, a class code shared with its peers: the name with numeric path parts taken
    out, and the module class (``kinds``, per call) where known, so that an nn.Sequential's
    Linear and activation, or a dense first layer's MLP and the MoE blocks after it, are not
    peers. A call with no numeric part is alone in its class."""
    kinds = list(kinds) or [""] * len(calls)
    keys = [
        (_NUMBER.sub("*", name) if _NUMBER.search(name) else f"\0{name}") + f"\0{kind}"
        for name, kind in zip(calls.tolist(), kinds)
    ]
    return (
        np.unique(np.asarray(keys, dtype=object).astype(str), return_inverse=True)[1].reshape(-1)
        if len(keys)
        else np.zeros(0, np.int64)
    )


def peer_maxima(
    jump: np.ndarray, ccode: np.ndarray, eligible: np.ndarray, classes: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """Per call code: (the largest jump among its peers, how many peers carried one). A call's
    own jump: the largest over its eligible cells (rows)."""
    n = len(classes)
    own = np.zeros(n)
    np.maximum.at(own, ccode[eligible], jump[eligible])
    seen = np.bincount(ccode[eligible], minlength=n) > 0
    best = np.full(n, np.nan)
    count = np.zeros(n, np.int64)
    for cls in np.unique(classes[seen]).tolist():
        members = np.nonzero((classes == cls) & seen)[0]
        values = own[members]
        order = np.argsort(-values, kind="stable")
        top, second = values[order[0]], values[order[1]] if len(order) > 1 else np.nan
        everyone = np.nonzero(classes == cls)[0]
        best[everyone] = top
        best[members[order[0]]] = second
        count[everyone] = len(members) - seen[everyone]
    return best, count


def peer_line(best: np.ndarray) -> np.ndarray:
    return np.maximum(PEER_FACTOR * np.nan_to_num(best), MIN_PEER_JUMP)
