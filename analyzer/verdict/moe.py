"""MoE routing flips: token rows whose selected experts differ between the two dumps.

A router (gate) turns a token row into scores over the experts and keeps the top k. A 1e-5
difference in its logits, harmless anywhere else, swaps an expert when two scores are that
close: the row then runs through a different expert and its output differs by O(1), the
amplifier behind a large KL after a tiny kernel difference. For every router call whose
output differs on some paired rows, the selection is compared row by row:

- when the router returns the chosen expert ids (an integer output [tokens, k], as HF
  Qwen3-MoE's router and sglang's TopK do), those are compared: what the engine really picked;
- otherwise the top k of its logits [tokens, num_experts], with k from the model's config
  (the run's model dir, when readable) or inferred from the expert calls (an integer
  [tokens, k] input of the experts module, or per-expert calls' row counts).

Selections are compared as sets: the order within the top k is not a flip.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from ..index.rows import reader_of
from ..index.table import Index
from .align import Alignment
from .compare import RowTable, call_order

MAX_EXAMPLES = 8
ROUTER_LEAF = re.compile(r"(^|\.)(gate|router)$")  # HF mlp.gate, block_sparse_moe.gate, ...router
ROUTER_CLASS = re.compile(r"router|moegate|topk", re.IGNORECASE)
CONFIG_K = ("num_experts_per_tok", "moe_topk", "num_selected_experts", "top_k", "moe_k")
_LAYER = re.compile(r"\.(\d+)(?=[.#]|$)")


def routing_flips(
    alignment: Alignment,
    a: Index,
    b: Index,
    table: RowTable,
    run: Optional[dict] = None,
    flipped_rows: Optional[list] = None,
) -> List[dict]:
    """One entry per router call whose output differs on some paired rows, in execution order.
    ``flipped_rows``, when given, receives (router call, its MoE block's module, pair numbers of
    the flipped rows where each side picked a top k of its own logits, those logits' relative
    errors) for the noise-aware verdict. A router whose logits are not dumped, or that picks by
    something else (a bias, expert groups), has no flip counted as noise."""
    routers = find_routers(b)
    if not routers:
        return []
    order = call_order(b)
    config_k = _config_k(run or {})
    reader_a = reader_b = None
    pairs = alignment.pairs.set_index("pair")
    found = []
    for router in sorted(routers, key=lambda r: order.get(r["call"], 0)):
        ids_from = "router output"
        if not router["indices"]:  # the ids the experts were given, where dumped: what the engine picked
            given = _experts_ids(b, router)
            if given and not a.tensors[a.tensors["tensor"] == given[0]].empty:  # and dumped on both sides
                router, ids_from = {**router, "indices": given[0], "k": given[1]}, "experts input"
        chosen = router["indices"] or router["logits"]
        mine = table.frame(table.tensor_mask(chosen) & table["comparable"])
        outs = table.frame(table.call_mask(router["call"]) & table["is_out"] & table["differ"])
        differing = mine[mine["pair"].isin(outs["pair"])]
        if differing.empty:
            continue
        k, k_from = (router["k"], ids_from) if router["indices"] else (config_k, "model config")
        if k is None:
            k, k_from = _experts_k(b, router), "expert calls"
        entry = {
            "layer": layer_of(router["module"]),
            "call": router["call"],
            "module": router["module"],
            "cls": router["cls"],
            "k": k,
            "k_from": k_from if k else None,
            "num_experts": router["num_experts"],
            "rows_compared": int(mine["pair"].nunique()),
            "rows_differing": int(differing["pair"].nunique()),
            "rows_flipped": None,
            "kinds": {},
            "examples": [],
        }
        if not k:
            entry["note"] = "top-k unknown (no expert ids in the router output, no model config, no expert calls)"
            found.append(entry)
            continue
        if reader_a is None:
            reader_a, reader_b = reader_of(a), reader_of(b)
        flipped, ties = [], []
        for (pass_a, pass_b), group in differing.groupby(["pass_a", "pass_b"], sort=True):
            sel_a = _selection(reader_a.rows(int(pass_a), chosen, group["row_a"].tolist()), k, bool(router["indices"]))
            sel_b = _selection(reader_b.rows(int(pass_b), chosen, group["row_b"].tolist()), k, bool(router["indices"]))
            changed = (sel_a != sel_b).any(dim=1)
            pairs_changed = group["pair"][changed.numpy()].tolist()
            for pair, row_a, row_b in zip(pairs_changed, sel_a[changed], sel_b[changed]):
                flipped.append((int(pair), row_a.tolist(), row_b.tolist()))
            if router["logits"] is not None and pairs_changed:
                rows_a, rows_b = group["row_a"][changed.numpy()].tolist(), group["row_b"][changed.numpy()].tolist()
                near, err = _near_ties(
                    reader_a.rows(int(pass_a), router["logits"], rows_a),
                    reader_b.rows(int(pass_b), router["logits"], rows_b),
                    sel_a[changed],
                    sel_b[changed],
                    k,
                )
                ties += [(int(p), float(e)) for p, ok, e in zip(pairs_changed, near.tolist(), err.tolist()) if ok]
        flipped.sort()
        entry["rows_flipped"] = len(flipped)
        if flipped_rows is not None and ties:
            flipped_rows.append((router["call"], router["parent"], [p for p, _ in ties], [e for _, e in ties]))
        info = pairs.loc[[p for p, _, _ in flipped]] if flipped else pairs.iloc[:0]
        entry["kinds"] = {str(kind): int(n) for kind, n in info["mode_b"].value_counts().items()}
        entry["examples"] = [
            {
                "seq": str(pairs.loc[p, "seq"]),
                "pos": int(pairs.loc[p, "pos"]),
                "kind": str(pairs.loc[p, "mode_b"]),
                "experts_a": ea,
                "experts_b": eb,
            }
            for p, ea, eb in flipped[:MAX_EXAMPLES]
        ]
        found.append(entry)
    return found


def find_routers(index: Index) -> List[dict]:
    """Router calls of a dump: a gate/router module of an MoE block with a float output over the
    experts, an integer output of chosen expert ids, or both."""
    calls = index.cols("calls")
    firsts = calls.firsts("call")
    first = {
        call: (module, cls)
        for call, module, cls in zip(  # call -> (module, cls), as first seen
            calls["call"][firsts].tolist(), calls["module"][firsts].tolist(), calls["cls"][firsts].tolist()
        )
    }
    modules = {module for module, _ in first.values()}
    candidates = {}  # call -> (module, cls, parent) of a gate/router module
    for call, (module, cls) in first.items():
        parent = module.rsplit(".", 1)[0] if "." in module else ""
        if ROUTER_CLASS.search(cls) or (
            ROUTER_LEAF.search(module) and any(m.startswith(f"{parent}.expert") for m in modules)
        ):
            candidates[call] = (module, cls, parent)
    if not candidates:  # a dense model: its tensors table is not walked
        return []
    outs_of: Dict[str, list] = {}  # candidate call -> its token-row outputs (tensor, shape, dtype), each tensor once
    seen = set()
    for tensor, call, io, dims, shape, dtype in index.cols("tensors").rows(
        ("tensor", "call", "io", "token_dims", "shape", "dtype")
    ):
        if call in candidates and io == "out" and dims != "null" and tensor not in seen:
            seen.add(tensor)
            outs_of.setdefault(call, []).append((tensor, shape, dtype))
    routers = []
    for call, (module, cls, parent) in candidates.items():
        logits = indices = None
        num_experts = k = None
        for tensor, shape_text, dtype in outs_of.get(call, []):
            shape = json.loads(shape_text)
            if not shape:
                continue
            if "float" in dtype and shape[-1] >= 2 and shape[-1] > (num_experts or 0):  # the widest: over all experts
                logits, num_experts = tensor, shape[-1]
            elif "int" in dtype and indices is None:
                indices, k = tensor, shape[-1]
        if logits is not None and indices is not None and k >= num_experts:
            indices, k = None, None  # not a top-k of these experts
        if logits is None and indices is None:
            continue
        routers.append(
            {
                "call": call,
                "module": module,
                "cls": cls,
                "parent": parent,
                "logits": logits,
                "indices": indices,
                "k": k,
                "num_experts": num_experts,
            }
        )
    return routers


def _selection(rows, k: int, are_ids: bool):
    """[n, k] sorted expert ids per row (torch tensors: its top-k breaks ties as the engines do)."""
    import torch  # only for a dump with routers: a dense model's verdict does not pay its start-up

    flat = rows.reshape(rows.shape[0], -1)
    ids = flat.long() if are_ids else torch.topk(flat.float(), min(k, flat.shape[1]), dim=1).indices
    return ids.sort(dim=1).values


def _near_ties(logits_a, logits_b, sel_a, sel_b, k: int):
    """Per flipped row: whether each side picked a top k of its own logits (ties either way: a
    GPU may break an exact tie to the other expert), so that the flip comes from how the logits
    moved and not from the router's choice; and the logits' relative error, which the
    noise-aware verdict holds against its line. (When both sides picked their own top k, the
    swapped experts' margin is at most twice the logits' difference: that test adds nothing.)"""
    import torch

    n = sel_a.shape[0]
    la, lb = logits_a.reshape(n, -1).double(), logits_b.reshape(n, -1).double()
    both = torch.isfinite(la) & torch.isfinite(lb)  # masked experts (-inf on both sides) move nothing
    noise = (la - lb).abs().where(both, la.new_zeros(())).amax(dim=1)
    near = _is_top_k(la, sel_a) & _is_top_k(lb, sel_b)
    scale = la.abs().where(torch.isfinite(la), la.new_zeros(())).amax(dim=1).clamp_min(1e-30)
    return near, noise / scale


def _is_top_k(logits, chosen):
    """Whether ``chosen`` ([n, k] ids) are a top k of each row's logits, ties allowed."""
    import torch

    picked = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, chosen, True)
    lowest_picked = logits.gather(1, chosen).amin(dim=1)
    best_left = logits.masked_fill(picked, float("-inf")).amax(dim=1)
    return lowest_picked >= best_left


def _config_k(run: dict) -> Optional[int]:
    """top-k from the model's config.json, when the run's model is a readable local dir."""
    model = run.get("model")
    path = os.path.join(model, "config.json") if isinstance(model, str) and model else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            config = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        for key in CONFIG_K:
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


def _experts_ids(index: Index, router: dict):
    """(tensor, k) of the expert ids the experts module next to the router takes as an input
    (an integer [tokens, k], as HF's fused experts do), or None. Recomputing the top k of the
    router's logits misses a flip where two bfloat16 logits tie: the engine broke the tie one way
    on one side, and the other way on the other."""
    tensors = index.tensors
    mine = tensors[tensors["call"].str.startswith(f"{router['parent']}.expert") & (tensors["io"] == "in")]
    for t in mine.drop_duplicates("tensor").itertuples(index=False):
        shape = json.loads(t.shape)
        if (
            "int" in t.dtype
            and t.token_dims != "null"
            and len(shape) >= 2
            and (router["num_experts"] is None or shape[-1] < router["num_experts"])
        ):
            return t.tensor, shape[-1]
    return None


def _experts_k(index: Index, router: dict) -> Optional[int]:
    """top-k from the expert calls next to the router: an integer [tokens, k] input of the experts
    module, or the rows all per-expert calls of one pass received over the pass's tokens."""
    parent = router["parent"]
    given = _experts_ids(index, router)
    if given:
        return given[1]
    tensors = index.tensors
    mine = tensors[tensors["call"].str.startswith(f"{parent}.expert") & (tensors["io"] == "in")]
    per_expert = re.compile(re.escape(parent) + r"\.experts?\.\d+#")
    firsts = mine[mine["call"].str.match(per_expert) & (mine["slot"].isin(["0", "hidden_states", "x"]))]
    if firsts.empty:
        return None
    pass_id = firsts["pass"].iloc[0]
    in_pass = firsts[firsts["pass"] == pass_id]
    rows = sum(int(_rows_of(json.loads(s))) for s in in_pass["shape"])
    tokens = int(index.tokens[(index.tokens["pass"] == pass_id) & index.tokens["valid"]].shape[0])
    if not tokens or rows % tokens:
        return None
    return rows // tokens or None


def _rows_of(shape: list) -> int:
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows


def layer_of(module: str) -> Optional[int]:
    found = _LAYER.search(module)
    return int(found.group(1)) if found else None
