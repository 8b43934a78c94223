"""MoE routing flips between two runs of one model (moe.py tells them for prefill against decode).

A bfloat16 run and a float32 one (or an engine and HF) compute a router's scores a rounding
apart; where two experts' scores are that close, the runs choose other experts for the token
row, and the MoE block's output on that row differs by O(1): no op computes anything wrong, the
top k of nearly equal scores went the other way. `dumpdiff compare` judges ops by the error
they add beyond their precision, and would name the experts on such rows. So the routers'
choices are compared row by row (the expert ids where a run dumps them, else the top k of the
router's logits, k from the model config), and on the rows where they differ the calls of the
MoE block and of the modules holding it are not judged; the report counts the flips.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..index.rows import reader_of
from .moe import _config_k, _experts_ids, _near_ties, _selection, find_routers
from .sides import Side

MAX_EXAMPLES = 4


def routing_flips(side_a: Side, side_b: Side, pairs) -> Tuple[List[dict], Dict[str, np.ndarray]]:
    """([one entry per router whose choice differs on some compared row], {MoE block module:
    [rows] True where the runs chose other experts, each the top k of its own router scores})
    over the sampled ``pairs``. A row where a run's choice is not the top k of its own scores
    (where they are dumped) is no rounding flip: it stays judged, and is counted apart."""
    index_a = side_a.indexes[side_a.ranks[0]]
    routers = find_routers(index_a)
    if not routers:
        return [], {}
    index_b = side_b.indexes[side_b.ranks[0]]
    names_b = side_b.names()
    reader_a, reader_b = reader_of(index_a), reader_of(index_b)
    groups: Dict[tuple, List[int]] = {}
    for i, key in enumerate(zip(pairs["pass_a"].tolist(), pairs["pass_b"].tolist())):
        groups.setdefault(key, []).append(i)
    entries, flipped_by_block = [], {}
    for router in routers:
        chosen, k, are_ids = _choice(router, index_a, side_a.dump.run)
        source_b = names_b.get(chosen) if chosen else None
        if source_b is None or not k:
            continue
        logits_b = names_b.get(router["logits"]) if router["logits"] else None
        flipped, unexplained, compared = (np.zeros(len(pairs), bool) for _ in range(3))
        examples = []
        for (pass_a, pass_b), at in groups.items():
            srows_a, srows_b = reader_a.srows(int(pass_a), chosen), reader_b.srows(int(pass_b), source_b.tensor)
            held = [i for i in at if int(pairs["row_a"][i]) in srows_a and int(pairs["row_b"][i]) in srows_b]
            if not held:
                continue
            rows_a, rows_b = [int(pairs["row_a"][i]) for i in held], [int(pairs["row_b"][i]) for i in held]
            sel_a = _selection(reader_a.rows(int(pass_a), chosen, rows_a), k, are_ids)
            sel_b = _selection(reader_b.rows(int(pass_b), source_b.tensor, rows_b), k, are_ids)
            changed = (sel_a != sel_b).any(dim=1).numpy()
            compared[held] = True
            if not changed.any():
                continue
            at_changed = np.asarray(held)[changed]
            own = np.ones(len(at_changed), bool)
            if logits_b is not None and are_ids:  # each run's choice must be a top k of its own scores
                own = _near_ties(
                    reader_a.rows(int(pass_a), router["logits"], [r for r, c in zip(rows_a, changed) if c]),
                    reader_b.rows(int(pass_b), logits_b.tensor, [r for r, c in zip(rows_b, changed) if c]),
                    sel_a[changed],
                    sel_b[changed],
                    k,
                )[0].numpy()
            flipped[at_changed[own]] = True
            unexplained[at_changed[~own]] = True
            for i, ea, eb in zip(at_changed[own].tolist(), sel_a[changed][own], sel_b[changed][own]):
                if len(examples) < MAX_EXAMPLES:
                    examples.append({"pair": i, "experts_a": ea.tolist(), "experts_b": eb.tolist()})
        if not (flipped.any() or unexplained.any()):
            continue
        block = router["parent"]
        flipped_by_block[block] = flipped_by_block.get(block, np.zeros(len(pairs), bool)) | flipped
        entries.append(
            {
                "router": router["call"],
                "block": block,
                "k": int(k),
                "rows_compared": int(compared.sum()),
                "rows_flipped": int(flipped.sum()),
                "rows_not_top_k": int(unexplained.sum()),
                "examples": examples,
            }
        )
    return entries, flipped_by_block


def _choice(router: dict, index, run: dict) -> Tuple[Optional[str], Optional[int], bool]:
    """(tensor whose rows tell the experts chosen, k, whether it holds expert ids) of a router."""
    if router["indices"]:
        return router["indices"], router["k"], True
    given = _experts_ids(index, router)
    if given:
        return given[0], given[1], True
    return router["logits"], _config_k(run or {}), False


def excused(
    calls: List[str], module_of, flipped_by_block: Dict[str, np.ndarray], n_rows: int, routers=()
) -> np.ndarray:
    """[calls, rows] True where a call is the MoE block whose routing flipped on the row, inside
    it, or holds it (its decoder layer, the model): an O(1) difference there is the flip's. The
    routers themselves stay judged: their scores differ by rounding, flip or not."""
    out = np.zeros((len(calls), n_rows), bool)
    for c, call in enumerate(calls):
        if call in routers:
            continue
        module = module_of(call)
        for block, rows in flipped_by_block.items():
            if module == block or module.startswith(block + ".") or not module or block.startswith(module + "."):
                out[c] |= rows
    return out
