"""Align token rows across two dumps, and prove the alignment before any verdict.

A token row is identified by the token ids of its sequence up to and including it: decode step
k of a request and row plen+k of the reference prefill of prompt+output carry the same key.
Sequence keys (request ids, cache objects) never cross dumps; token ids do. Each sequence's
history is followed pass by pass (a decode pass holds one token; its prefill held the rest),
with the prefix ids an engine recorded for prefix-cache hits; a pass that computes a position
again with another token (speculative decoding's rejected drafts) branches off there.

Every row of B with a known key is paired with the last row of A carrying the same key.
The proof: every pair has equal token ids and positions, and the embedding output of every
pair is bit-identical. A misaligned diff yields a confident, wrong culprit, so a failed proof
stops the analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import DumpError
from ..index.columns import Columns
from ..index.keyjoin import lookup, row_key
from ..index.table import Index

try:  # hashlib's own blake2b, without hashlib's start of OpenSSL (5 ms of every verdict)
    from _blake2 import blake2b
except ImportError:
    from hashlib import blake2b


@dataclasses.dataclass
class Alignment:
    cols: Columns  # per pair of rows: pair, pass/row/pos/id/mode of each side, seq; by (pass_b, row_b)
    unaligned_b: int  # rows of B with no partner in A
    unkeyed_b: int  # rows of B whose sequence history has gaps (prefix unknown)
    rows_b: int
    cached_b: int = 0  # rows of B computed on a cache (decode, extend): what the comparison is for
    cached_unpaired_b: int = 0  # of those, rows with no partner in A
    cached_a: int = 0  # rows of A computed on a cache (extend, decode): a reference made on a warm cache has them
    decode_a: int = 0  # decode rows of A: a reference prefill has none
    unkeyed_a: int = 0  # rows of A with no key (positions before them unknown)
    decode_b: int = 0
    embedding: Optional[str] = None  # module path of the embedding call used in the proof
    proof: List[str] = dataclasses.field(default_factory=list)  # what was checked, in words
    history_notes_b: List[str] = dataclasses.field(default_factory=list)  # why rows of B have no key (row_keys)
    positions_jump_b: bool = False  # a sequence of B skips positions between consecutive engine steps
    ambiguous_b: int = 0  # rows of B whose key several reference sequences hold with other values
    ambiguous_note: Optional[str] = None  # why (the first tensor that tells them apart)

    @functools.cached_property
    def pairs(self):
        """The pairs as a pandas frame, for the passes that read tensor values."""
        return self.cols.to_pandas()


def row_keys(index: Index) -> Tuple[Columns, List[str], bool]:
    """Valid token rows, ordered by (pass, row), with their prefix key: a hash of the token ids
    from position 0 up to the row's, as the pass that computed the row saw them (None where
    positions before the row are unknown); notes on why rows have no key; and whether a
    sequence's positions jump between consecutive engine steps (an engine bug, not a gap).

    Each sequence's ids are followed pass by pass, in order. A pass that computes a position
    again with another token starts a new branch there: speculative decoding replaces a rejected
    draft token, an engine rolls a step back. Rows of the abandoned branch keep keys no reference
    row has (they computed a context the finished sequence does not hold), so they pair with
    nothing; the same token computed again (a retracted request) keeps its key."""
    tokens = index.cols("tokens")
    tokens = tokens.take(tokens["valid"].astype(bool))
    tokens = tokens.take(np.lexsort((tokens["row"], tokens["pass"])))
    prefixes = {
        (int(pass_id), seq): json.loads(raw)
        for pass_id, seq, raw in index.cols("seqs").rows(("pass", "seq", "prefix_ids"))
        if raw is not None
    }
    seq_code: Dict[str, int] = {}
    codes = np.array([seq_code.setdefault(seq, len(seq_code)) for seq in tokens["seq"].tolist()], dtype=np.int64)
    branches: Dict[str, _Branch] = {}
    keys = np.empty(len(tokens), dtype=object)
    passes, seqs, positions, ids = (tokens[n].tolist() for n in ("pass", "seq", "pos", "id"))
    steps = tokens["step"].tolist() if "step" in tokens else [None] * len(tokens)
    started, last, forked = None, None, False
    notes = []
    for i in np.lexsort((tokens["pos"], codes, tokens["pass"])).tolist():  # each (pass, sequence) in position order
        branch = branches.get(seqs[i]) or branches.setdefault(seqs[i], _Branch())
        if (passes[i], seqs[i]) != started:
            started, last, forked = (passes[i], seqs[i]), None, False
            prefix = prefixes.get((int(passes[i]), seqs[i])) or []  # a cache hit's prefix: this pass's context
            for offset, tok in enumerate(prefix, start=positions[i] - len(prefix)):
                if offset >= 0:
                    branch.place(offset, int(tok), steps[i])
        if positions[i] == last and not forked:  # one pass computes a position twice for one sequence
            forked = True
            if len(notes) < 3:
                notes.append(
                    f"pass {passes[i]} computes position {last} of sequence {seqs[i]} twice (a tree of draft "
                    "tokens, or sequences packed under one key): its rows from there on are not paired"
                )
        last = positions[i]
        keys[i] = None if forked else branch.place(positions[i], ids[i], steps[i])  # a row's context is unknown then
    out = Columns({n: tokens[n] for n in ("pass", "row", "seq", "pos", "id", "mode")} | {"key": keys})
    jumped = any(
        b.gap is not None and all(isinstance(s, (int, np.integer)) for s in b.gap[2:]) and b.gap[3] == b.gap[2] + 1
        for b in branches.values()
    )
    return out, notes + _history_notes(branches, int(np.count_nonzero(tokens["id"] < 0))), jumped


class _Branch:
    """One sequence's token ids from position 0 as last computed, with the key of each prefix."""

    __slots__ = ("ids", "keys", "step", "gap", "late")

    def __init__(self) -> None:
        self.ids: List[int] = []
        self.keys: List[bytes] = []
        self.step = None  # the engine step of the pass that last extended it
        self.gap: Optional[tuple] = None  # (first unknown position, the row found past it, step before, step of it)
        self.late: Optional[int] = None  # the first position seen, when nothing before it is known

    def place(self, pos: int, tok: int, step=None) -> Optional[bytes]:
        """The key of token ``tok`` computed at ``pos`` (in engine step ``step``): on the branch
        when it holds that token there, else on a new branch from ``pos``; None when an earlier
        position is unknown."""
        if pos < len(self.ids):
            if self.ids[pos] == tok:
                self.step = step if pos == len(self.ids) - 1 else self.step
                return self.keys[pos]
            del self.ids[pos:], self.keys[pos:]  # another token here: the old branch ends before it
        if pos == len(self.ids):
            before = self.keys[-1] if self.keys else b""
            self.keys.append(blake2b(before + int(tok).to_bytes(8, "little", signed=True), digest_size=16).digest())
            self.ids.append(tok)
            self.step = step
            return self.keys[-1]
        if self.ids and self.gap is None:
            self.gap = (len(self.ids), pos, self.step, step)
        elif not self.ids and self.late is None:
            self.late = pos
        return None


def _history_notes(branches: Dict[str, "_Branch"], unknown_ids: int) -> List[str]:
    """Why rows of a dump cannot be keyed, for an error that found no partner: a sequence with
    no row at some position but rows after it (a pass not dumped, or positions that jump),
    token ids not recorded."""
    notes = []
    for seq, branch in branches.items():
        if branch.gap is not None:
            missing, found, before, after = branch.gap
            known = all(isinstance(s, (int, np.integer)) for s in (before, after))
            if known and after == before + 1:
                why = (
                    f"between consecutive engine steps {before} and {after} its positions jump (a position or "
                    "rotary bug in the engine?)"
                )
            elif known:
                why = (
                    f"the passes of engine steps {before + 1}..{after - 1} were not dumped (dumping paused?), or its "
                    "positions jump"
                )
            else:
                why = "a pass was not dumped, or its positions jump (a position or rotary bug in the engine?)"
            notes.append(
                f"sequence {seq} has no row at position {missing} but has rows at {found} and after: {why}; "
                "rows after the gap cannot be paired"
            )
            break
    late = next(
        ((seq, branch.late) for seq, branch in branches.items() if branch.late is not None and not branch.ids), None
    )
    if late is not None and not notes:
        notes.append(
            f"sequence {late[0]} starts at position {late[1]} with the token ids before it unknown: its first "
            "dumped pass ran on a cache whose earlier tokens this dump does not hold (filled while dumping was "
            "off, or a cache the dumper never saw filled, or the engine dropped the sequence's cache and went "
            "on without its context); enable dumping before the prompt's prefill and pass that cache (or a copy "
            "of it) on"
        )
    if unknown_ids:
        notes.append(
            f"{unknown_ids} token rows hold no token id (-1: a forward given inputs_embeds instead of input_ids "
            "records none); dump the run from token ids"
        )
    return notes


def align(a: Index, b: Index) -> Alignment:
    (keys_a, _, _), (keys_b, notes_b, jumped_b) = row_keys(a), row_keys(b)
    last_in_a = {key: i for i, key in enumerate(keys_a["key"].tolist()) if key is not None}  # the last row wins
    ambiguous, told_by = _ambiguous_keys(a, keys_a)
    keyed_b = np.array([key is not None for key in keys_b["key"].tolist()], dtype=bool)
    partner = np.array(
        [last_in_a.get(key, -1) if key is not None and key not in ambiguous else -1 for key in keys_b["key"].tolist()],
        dtype=np.int64,
    )
    n_ambiguous = sum(key in ambiguous for key in keys_b["key"].tolist()) if ambiguous else 0
    at_b = np.nonzero(partner >= 0)[0]  # B is in (pass, row) order already
    at_a = partner[at_b]
    cols = Columns(
        {
            "pair": np.arange(len(at_b)),
            "pass_a": keys_a["pass"][at_a],
            "row_a": keys_a["row"][at_a],
            "pass_b": keys_b["pass"][at_b],
            "row_b": keys_b["row"][at_b],
            "seq": keys_b["seq"][at_b],
            "pos": keys_b["pos"][at_b],
            "id": keys_b["id"][at_b],
            "pos_a": keys_a["pos"][at_a],
            "id_a": keys_a["id"][at_a],
            "mode_a": keys_a["mode"][at_a],
            "mode_b": keys_b["mode"][at_b],
        }
    )
    cached = np.array([mode not in ("prefill", None) for mode in keys_b["mode"].tolist()], dtype=bool)
    cached_a = sum(mode not in ("prefill", None) for mode in keys_a["mode"].tolist())
    decode_a = sum(mode == "decode" for mode in keys_a["mode"].tolist())
    unkeyed_a = sum(key is None for key in keys_a["key"].tolist())
    decode_b = sum(mode == "decode" for mode in keys_b["mode"].tolist())
    return Alignment(
        cols=cols,
        unaligned_b=int(keyed_b.sum()) - len(at_b),
        unkeyed_b=int((~keyed_b).sum()),
        rows_b=len(keys_b),
        cached_b=int(cached.sum()),
        cached_unpaired_b=int((cached & (partner < 0)).sum()),
        history_notes_b=notes_b,
        positions_jump_b=jumped_b,
        ambiguous_b=n_ambiguous,
        ambiguous_note=told_by
        and (
            f"the reference holds several sequences with the same token ids whose "
            f"values differ (first at {told_by}): the model takes inputs besides "
            "the token ids (an encoder's output, an image), so which one a row "
            "pairs with cannot be told; dump one such request per run, or give "
            "them distinct ids"
        ),
        cached_a=cached_a,
        decode_a=decode_a,
        decode_b=decode_b,
        unkeyed_a=unkeyed_a,
    )


MAX_AMBIGUITY_KEYS = 4096  # repeated keys checked (a context that differs shows on every shared row)


def _ambiguous_keys(index: Index, keys: Columns) -> Tuple[set, Optional[str]]:
    """Keys that several reference rows hold with other values, computed in different passes of
    the same shape (where batch-variance cannot explain them): their context is more than their
    token ids (an encoder-decoder's source, an image). Rows of one pass are not compared: in a
    left-padded batch a shared prefix sits at other offsets, and its bits differ by batch-variance.
    Also the first tensor that tells them apart."""
    rows_of: Dict[bytes, list] = {}
    for at, key in enumerate(keys["key"].tolist()):
        if key is not None:
            rows_of.setdefault(key, []).append(at)
    passes, counts = np.unique(keys["pass"], return_counts=True)  # token rows per pass: its shape
    size_of = dict(zip(passes.tolist(), counts.tolist()))
    pass_of, row_of = keys["pass"].tolist(), keys["row"].tolist()
    repeated: Dict[bytes, list] = {}
    for key, ats in rows_of.items():  # per key, its first row in two passes of one size (bounded work:
        firsts = list({pass_of[at]: at for at in reversed(ats)}.values())  # N prompts sharing a system prompt)
        by_size: Dict[int, list] = {}
        for at in firsts:
            by_size.setdefault(size_of[pass_of[at]], []).append(at)
        two = next((ats[:2] for ats in by_size.values() if len(ats) > 1), None)
        if two:
            repeated[key] = [(int(pass_of[at]), int(row_of[at])) for at in two]
            if len(repeated) == MAX_AMBIGUITY_KEYS:
                break
    if not repeated:
        return set(), None
    where = [place for places in repeated.values() for place in places]
    table = index.cols("rows")
    width = int(table["row"].max(initial=0)) + 1
    wanted = np.isin(
        table["pass"].astype(np.int64) * width + table["row"],
        np.array([p * width + r for p, r in where], dtype=np.int64),
    )
    values: Dict[tuple, Dict[str, int]] = {}
    for p, r, tensor, fp in zip(
        table["pass"][wanted].tolist(),
        table["row"][wanted].tolist(),
        table["tensor"][wanted].tolist(),
        table["fp"][wanted].tolist(),
    ):
        values.setdefault((int(p), int(r)), {})[tensor] = fp
    ambiguous, told_by = set(), None
    for key, (first, other) in repeated.items():
        mine, theirs = values.get(first, {}), values.get(other, {})
        differ = [t for t in mine if t in theirs and mine[t] != theirs[t]]
        if differ:
            ambiguous.add(key)
            told_by = told_by or differ[0]
    return ambiguous, told_by


def prove(alignment: Alignment, a: Index, b: Index, label_a: str, label_b: str, trust: bool = False) -> Alignment:
    """Check the alignment; raise DumpError (exit 2) with the reason when it does not hold."""
    pairs = alignment.cols
    why = "".join(f"; {label_b}: {note}" for note in alignment.history_notes_b)
    if alignment.ambiguous_b:
        why += f"; {alignment.ambiguous_b} rows of {label_b}: {alignment.ambiguous_note}"
    if alignment.cached_a and alignment.unkeyed_a:  # rows after a cached prefix it does not hold: unpairable
        why += (
            f"; {label_a} holds {alignment.cached_a} rows computed on a cache (extend or decode passes), not one "
            "prefill: flush the engine's cache before dumping the reference (sglang: POST /flush_cache)"
        )
    if not len(pairs) and alignment.ambiguous_b:
        raise DumpError(f"no token row of {label_b} can be paired: {alignment.ambiguous_note}")
    if not len(pairs) and alignment.history_notes_b and alignment.unkeyed_b == alignment.rows_b:
        raise DumpError(
            f"no token row of {label_b} can be paired (the ids before its rows are unknown): "
            + "; ".join(alignment.history_notes_b)
        )  # not another prompt: say what is missing
    if not len(pairs):
        raise DumpError(
            f"no token row of {label_b} matches a row of {label_a} (same token ids from position 0); "
            "were both dumps made from the same prompt? dump the reference prefill of prompt+output" + why
        )
    if alignment.cached_b and alignment.cached_unpaired_b == alignment.cached_b:
        # Only prefill rows would be compared: "no divergence" would hide that the decode steps,
        # the point of the comparison, were never looked at.
        raise DumpError(
            f"none of the {alignment.cached_b} decode/extend rows of {label_b} has a partner in {label_a} "
            "(same token ids from position 0); the reference must hold the tokens the decode run generated: "
            "dump it as one prefill of prompt+output" + why
        )
    bad = int(((pairs["id"] != pairs["id_a"]) | (pairs["pos"] != pairs["pos_a"])).sum())
    if bad:
        raise DumpError(f"alignment broken: {bad} paired rows differ in token id or position")
    alignment.proof.append(f"{len(pairs)} token rows of {label_b} paired with {label_a}: token ids and positions equal")
    if trust:
        alignment.proof.append("embedding check skipped (--trust-alignment)")
        return alignment
    emb_a, emb_b = embedding_call(a), embedding_call(b)
    if emb_b is None or emb_a is None:
        missing = label_b if emb_b is None else label_a
        if metadata_only(a, b):
            raise DumpError(
                f"cannot prove the alignment: {missing} holds no module tensors (DUMPER_NON_INTRUSIVE_MODE="
                "core writes pass metadata only); dump with DUMPER_NON_INTRUSIVE_MODE=all"
            )
        raise DumpError(
            f"cannot prove the alignment: {missing} has no dumped embedding call (a module taking the token "
            "ids); widen DUMPER_FILTER to include it, or pass --trust-alignment"
        )
    if emb_a[0] != emb_b[0]:
        raise DumpError(
            f"the dumps embed tokens in different modules ({emb_a[0]} vs {emb_b[0]}); are they of the same model?"
        )
    fp_a, fp_b = _tensor_fps(a, emb_a[1], pairs, "a"), _tensor_fps(b, emb_b[1], pairs, "b")
    both = (fp_a[1] >= 0) & (fp_b[1] >= 0)  # pairs whose embedding row is in both dumps
    differ = np.nonzero(both & (fp_a[0] != fp_b[0]))[0]
    if not both.any():
        raise DumpError(
            "cannot prove the alignment: the embedding output has no token rows in common between the dumps"
            + row_selection_hint(a, b)
        )
    if len(differ):
        first = differ[0]
        prefill = np.asarray([mode in ("prefill", None) for mode in pairs["mode_b"].tolist()], dtype=bool)
        if (both & prefill).any() and not prefill[differ].any():
            # same ids and positions, same embedding on every prefill row: the decode path's own
            # embedding differs, a bug of the engine under test, not a misalignment
            why = (
                f"every one of them a decode/extend row, while all {int((both & prefill).sum())} paired prefill rows "
                f"are bit-identical: {emb_b[0]} itself computes otherwise in decode (a bug, not a misalignment); "
                "the token ids and positions match, so rerun with --trust-alignment for the verdict"
            )
        else:
            why = "the dumps are of different weights or the rows are misaligned; no verdict is given"
        raise DumpError(
            f"alignment proof failed: embedding output ({emb_b[0]}) differs on {len(differ)} of {int(both.sum())} "
            f"paired rows (first: sequence {pairs['seq'][first]}, position {pairs['pos'][first]}); {why}"
        )
    alignment.embedding = emb_b[0]
    alignment.proof.append(f"embedding output ({emb_b[0]}) bit-identical on all {int(both.sum())} paired rows")
    return alignment


def metadata_only(a: Index, b: Index) -> bool:
    """Whether either dump was made with DUMPER_NON_INTRUSIVE_MODE=core: pass metadata, no tensors."""
    return "core" in (a.dump.setting("non_intrusive_mode"), b.dump.setting("non_intrusive_mode"))


def row_selection_hint(a: Index, b: Index) -> str:
    """For an error that found no paired row dumped on both sides: the row selection each dump
    was made with, and what it must keep ("" when neither selected rows)."""
    kept, last_rows = [], False
    for index in (a, b):
        if index.dump.setting("last_rows"):
            kept.append(f"{index.dump.label} kept DUMPER_LAST_ROWS={index.dump.setting('last_rows')}")
            last_rows = last_rows or index is a
        if index.dump.setting("positions"):
            kept.append(f"{index.dump.label} kept DUMPER_POSITIONS={index.dump.setting('positions')!r}")
    if not kept:
        return ""
    advice = (
        "the reference prefill of prompt+output holds one row more than the decode run computes (its last "
        "generated token is never fed back), so the reference must keep at least the decode steps of a "
        "sequence plus one (DUMPER_LAST_ROWS >= new tokens)"
        if last_rows
        else "keep positions that both runs compute (the decode steps: DUMPER_POSITIONS='T:' with T the prompt length, "
        "in both dumps)"
    )
    return f"; {' and '.join(kept)}: {advice}"


def embedding_call(index: Index):
    """(module path, output tensor name) of the first call that turns token ids into floats.
    Works on whole columns: a dump of many decode steps has tens of thousands of tensors."""
    tensors = index.cols("tensors")
    if not len(tensors):
        return None
    ids_in = (tensors["io"] == "in") & tensors["is_ids"].astype(bool)
    if not ids_in.any():
        return None
    takes_ids = set(zip(tensors["pass"][ids_in].tolist(), tensors["call"][ids_in].tolist()))
    id_calls = np.array(sorted({call for _, call in takes_ids}), dtype=object)
    dtypes = tensors["dtype"]
    float_types = np.array([d for d in set(dtypes.tolist()) if "float" in str(d)], dtype=object)
    # The first float output with token rows of each call that takes the ids, in table order.
    is_float_out = (
        (tensors["io"] == "out")
        & np.isin(dtypes, float_types)
        & (tensors["token_dims"] != "null")
        & np.isin(tensors["call"], id_calls)
    )
    first_out: Dict[str, str] = {}
    for call, tensor in zip(tensors["call"][is_float_out].tolist(), tensors["tensor"][is_float_out].tolist()):
        first_out.setdefault(call, tensor)
    calls = index.cols("calls")
    calls = calls.take(np.isin(calls["call"], id_calls))
    chosen = np.array([(p, c) in takes_ids for p, c in calls.rows(("pass", "call"))], dtype=bool)
    calls = calls.take(chosen)
    calls = calls.take(np.lexsort((calls["post"], calls["pass"])))
    for module, call in calls.rows(("module", "call")):
        if call in first_out:
            return module, first_out[call]
    return None


def _tensor_fps(index: Index, tensor: str, pairs: Columns, side: str):
    """(fingerprint, position in the rows table or -1) of one tensor on each pair's row of one side."""
    rows = index.cols("rows")
    codes, vocabulary = rows.codes("tensor")
    code = np.nonzero(vocabulary == tensor)[0]
    mine = np.nonzero(codes == code[0])[0] if len(code) else np.zeros(0, np.int64)
    at = lookup(row_key(rows["pass"][mine], rows["row"][mine]), row_key(pairs[f"pass_{side}"], pairs[f"row_{side}"]))
    found = np.where(at >= 0, mine[np.clip(at, 0, None)] if len(mine) else -1, -1)
    fps = np.where(found >= 0, rows["fp"][np.clip(found, 0, None)] if len(rows) else 0, 0)
    return fps, found
