"""Align token rows across two dumps, and prove the alignment before any verdict.

A token row is identified by the token ids of its sequence up to and including it: decode step
k of a request and row plen+k of the reference prefill of prompt+output carry the same key.
Sequence keys (request ids, cache objects) never cross dumps; token ids do. Each sequence's
history is stitched together from every pass of the dump (a decode pass holds one token; its
prefill held the rest) plus the prefix ids an engine recorded for prefix-cache hits.

Every row of B with a known key is paired with the last row of A carrying the same key.
The proof: every pair has equal token ids and positions, and the embedding output of every
pair is bit-identical. A misaligned diff yields a confident, wrong culprit, so a failed proof
stops the analysis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from .errors import DumpError
from .index import Index


@dataclasses.dataclass
class Alignment:
    pairs: pd.DataFrame  # pair, pass_a, row_a, pass_b, row_b, seq, pos, id, mode_a, mode_b
    unaligned_b: int  # rows of B with no partner in A
    unkeyed_b: int  # rows of B whose sequence history has gaps (prefix unknown)
    rows_b: int
    embedding: Optional[str] = None  # module path of the embedding call used in the proof
    proof: List[str] = dataclasses.field(default_factory=list)  # what was checked, in words
    conflicts: List[str] = dataclasses.field(default_factory=list)


def row_keys(index: Index) -> pd.DataFrame:
    """Valid token rows with their prefix key (None where the sequence history has a gap)."""
    tokens = index.tokens[index.tokens["valid"]].sort_values(["pass", "row"])
    history: Dict[str, Dict[int, int]] = {}
    conflicts = []
    for seq, pos, tok in zip(tokens["seq"], tokens["pos"], tokens["id"]):
        known = history.setdefault(seq, {})
        if known.setdefault(int(pos), int(tok)) != int(tok):
            conflicts.append(f"sequence {seq} has two token ids at position {pos}")
    firsts = tokens.groupby(["pass", "seq"])["pos"].min()
    with_prefix = index.seqs.dropna(subset=["prefix_ids"])
    for pass_id, seq, raw in zip(with_prefix["pass"], with_prefix["seq"], with_prefix["prefix_ids"]):
        prefix = json.loads(raw)
        start = int(firsts.get((pass_id, seq), len(prefix))) - len(prefix)
        known = history.setdefault(seq, {})
        for offset, tok in enumerate(prefix):
            known.setdefault(start + offset, int(tok))
    keys_by_seq = {seq: _prefix_keys(known) for seq, known in history.items()}
    keys = [keys_by_seq[s][p] if p < len(keys_by_seq[s]) else None for s, p in zip(tokens["seq"], tokens["pos"])]
    out = tokens[["pass", "row", "seq", "pos", "id", "mode"]].copy()
    out["key"] = keys
    out.attrs["conflicts"] = conflicts
    return out


def _prefix_keys(known: Dict[int, int]) -> List[bytes]:
    """Chained hashes of ids[0..p] for every p while positions 0..p are all known."""
    keys, digest = [], b""
    pos = 0
    while pos in known:
        digest = hashlib.blake2b(digest + int(known[pos]).to_bytes(8, "little", signed=True), digest_size=16).digest()
        keys.append(digest)
        pos += 1
    return keys


def align(a: Index, b: Index) -> Alignment:
    keys_a, keys_b = row_keys(a), row_keys(b)
    conflicts = keys_a.attrs.get("conflicts", []) + keys_b.attrs.get("conflicts", [])
    ref = keys_a.dropna(subset=["key"]).drop_duplicates("key", keep="last")
    test = keys_b.dropna(subset=["key"])
    pairs = test.merge(ref, on="key", suffixes=("_b", "_a"))
    pairs = pairs.rename(columns={"seq_b": "seq", "pos_b": "pos", "id_b": "id"})
    pairs = pairs.sort_values(["pass_b", "row_b"]).reset_index(drop=True)
    pairs["pair"] = np.arange(len(pairs))
    result = Alignment(
        pairs=pairs[["pair", "pass_a", "row_a", "pass_b", "row_b", "seq", "pos", "id", "pos_a", "id_a", "mode_a", "mode_b"]],
        unaligned_b=len(test) - len(pairs), unkeyed_b=len(keys_b) - len(test), rows_b=len(keys_b), conflicts=conflicts)
    return result


def prove(alignment: Alignment, a: Index, b: Index, label_a: str, label_b: str, trust: bool = False) -> Alignment:
    """Check the alignment; raise DumpError (exit 2) with the reason when it does not hold."""
    pairs = alignment.pairs
    if alignment.conflicts:
        raise DumpError(f"cannot align: {alignment.conflicts[0]}; the dump mixes requests under one sequence key")
    if pairs.empty:
        raise DumpError(f"no token row of {label_b} matches a row of {label_a} (same token ids from position 0); "
                        "were both dumps made from the same prompt? dump the reference prefill of prompt+output")
    bad = pairs[(pairs["id"] != pairs["id_a"]) | (pairs["pos"] != pairs["pos_a"])]
    if len(bad):
        raise DumpError(f"alignment broken: {len(bad)} paired rows differ in token id or position")
    alignment.proof.append(f"{len(pairs)} token rows of {label_b} paired with {label_a}: token ids and positions equal")
    if trust:
        alignment.proof.append("embedding check skipped (--trust-alignment)")
        return alignment
    emb_a, emb_b = embedding_call(a), embedding_call(b)
    if emb_b is None or emb_a is None:
        missing = label_b if emb_b is None else label_a
        raise DumpError(f"cannot prove the alignment: {missing} has no dumped embedding call (a module taking the token "
                        "ids); widen DUMPER_FILTER to include it, or pass --trust-alignment")
    if emb_a[0] != emb_b[0]:
        raise DumpError(f"the dumps embed tokens in different modules ({emb_a[0]} vs {emb_b[0]}); are they of the same model?")
    rows_a = _tensor_fps(a, emb_a[1], pairs, "a")
    rows_b = _tensor_fps(b, emb_b[1], pairs, "b")
    both = rows_a.merge(rows_b, on="pair", suffixes=("_a", "_b"))
    differ = both[both["fp_a"] != both["fp_b"]]
    if both.empty:
        raise DumpError("cannot prove the alignment: the embedding output has no token rows in common between the dumps")
    if len(differ):
        first = pairs.set_index("pair").loc[differ["pair"].iloc[0]]
        raise DumpError(f"alignment proof failed: embedding output ({emb_b[0]}) differs on {len(differ)} of {len(both)} "
                        f"paired rows (first: sequence {first['seq']}, position {first['pos']}); the dumps are of different "
                        "weights or the rows are misaligned; no verdict is given")
    alignment.embedding = emb_b[0]
    alignment.proof.append(f"embedding output ({emb_b[0]}) bit-identical on all {len(both)} paired rows")
    return alignment


def embedding_call(index: Index):
    """(module path, output tensor name) of the first call that turns token ids into floats."""
    tensors = index.tensors
    takes_ids = tensors[(tensors["io"] == "in") & tensors["is_ids"]]
    if takes_ids.empty:
        return None
    calls = index.calls.merge(takes_ids[["pass", "call"]].drop_duplicates(), on=["pass", "call"])
    float_outs = tensors[(tensors["io"] == "out") & tensors["dtype"].str.contains("float")
                         & (tensors["token_dims"] != "null")]
    for call in calls.sort_values(["pass", "post"]).itertuples(index=False):
        outs = float_outs[float_outs["call"] == call.call]
        if len(outs):
            return call.module, outs["tensor"].iloc[0]
    return None


def _tensor_fps(index: Index, tensor: str, pairs: pd.DataFrame, side: str) -> pd.DataFrame:
    """Fingerprints of one tensor on each pair's row of one side."""
    rows = index.rows[index.rows["tensor"] == tensor]
    merged = pairs[["pair", f"pass_{side}", f"row_{side}"]].merge(
        rows, left_on=[f"pass_{side}", f"row_{side}"], right_on=["pass", "row"])
    return merged[["pair", "fp"]]
