"""The noise-aware verdict: where a real error is introduced, seen through float noise.

Engines are rarely batch-invariant, so the first flipped bit usually sits in a layer-0 kernel
and every later call is a victim of it. A state bug deeper down (a corrupted cached key) still
shows: at its call the error jumps far beyond what came in. For each aligned row and call:

    in_err  = largest relative error of the call's token-aligned inputs  (0 when bit-identical)
    out_err = largest relative error of its outputs
    amplification = out_err / max(in_err, floor)

Relative error of a row is max|a - b| / max|a| over the row. The floor is the larger of the
output dtype's epsilon (an error below one ulp at the row's magnitude is not an error) and,
when a repeat dump of the reference is given (--noise A A2), the error that call shows between
two identical runs. Carried noise amplifies by ~1-10x; an introduced error by far more. The
threshold is derived from the run itself: a robust spread (median + k*MAD of log10
amplification over the calls whose inputs and outputs both differ) with a lower bound, or the user's
--atol/--rtol, in which case a call whose inputs are all within tolerance and whose output is
not is named.

All of it works on numpy columns, like the strict verdict: no pandas. Tensor values are read at
the byte offsets the index holds, a chunk of tensors at a time in file order (analyzer/index/batches.py:
of each decode step's file, the slice that holds the chunk's rows), and compared per tensor in one
batch.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from ..dump.dtypes import BY_NAME, DType, eps, tiny, to_float32, to_float64
from ..index.batches import chunks, in_file_order, read_batches, row_bytes
from ..index.columns import Columns, distinct
from ..index.rows import reader_of
from ..index.table import Index
from .align import Alignment
from .compare import MAX_LISTED, RowTable, call_order, calls_of_b
from .peers import (
    MIN_GAP_PEERS,
    MIN_PEER_JUMP,
    MIN_PEERS,
    MIN_SUSPECT_JUMP,
    PEER_FACTOR,
    SUSPECT_FACTOR,
    op_classes,
    peer_line,
    peer_maxima,
)
from .result import NoiseVerdict

MIN_AMPLIFICATION = 30.0  # never call a 30x jump or less an introduced error
MAD_FACTOR = 8.0
# Code no hook saw may be anything: an attention core (softmax of large logits) inlined in its
# module's forward carried clean float32 noise 27x on a random Llama. A gap must jump further
# than a call (a corrupted KV cache read there: 2e4x; a 0.1% error in an unhooked MLP: 1e3x).
MIN_GAP_AMPLIFICATION = 100.0
MIN_ULPS = 8.0  # an introduced error must be at least this many epsilons of its row's magnitude
# A float32 output from bit-identical inputs: another reduction order moves it by tens of
# epsilons where a reduction cancels (a decode kernel sums attention keys in another order than
# the prefill one: 17.7 epsilons on a trained tiny Llama on the real sglang server, growing with
# |q||k|, head size and context). Such a call is judged as code no hook saw is.
MIN_CLEAN_FLOAT32 = MIN_GAP_AMPLIFICATION
EPS_ACCUMULATE = eps(BY_NAME["float32"])  # kernels accumulate in float32 whatever they output


def clean_input_line(line, out_eps):
    """The line for a call whose inputs are bit-identical. Another reduction order (the batch
    variance of a kernel) moves a float32 sum by a few float32 epsilons, which rounding to a
    16-bit output turns into an ulp or two: an error of MIN_ULPS 16-bit epsilons from identical
    inputs is no reordering. (Against the line for carried noise, 30 x eps(bfloat16) ~ 23%, a
    13% state bug passed for noise.) For float32 outputs the line stays."""
    return np.maximum(MIN_ULPS, line * EPS_ACCUMULATE / out_eps)


MAX_PAIRS = 512  # rows whose bytes are read for the noise-aware walk (sampled evenly beyond this)


PER_CULPRIT = 8  # rows of each strict per-row culprit that the sample always holds


def sample_pairs(pairs: Columns, limit: int = MAX_PAIRS, per_row: Sequence[dict] = ()) -> np.ndarray:
    """Pair numbers: every pair if few; else an even sample within each row kind (mode_b), so
    each kind is represented, plus up to PER_CULPRIT rows (spread evenly) of each call the strict
    verdict names first on some row (``per_row``: its per_row list). A state bug whose strict
    culprit is its own call is then always judged: a decode-only error on one prompt row of 600
    was outside the even sample, and the run was called float noise."""
    ids = np.asarray(pairs["pair"], np.int64)
    if len(ids) <= limit:
        return ids
    kinds, kind_of = np.unique(pairs["mode_b"].astype(str), return_inverse=True)
    kind_of = kind_of.reshape(-1)
    share = max(1, limit // len(kinds))
    chosen = []
    for kind in range(len(kinds)):
        members = np.nonzero(kind_of == kind)[0]
        chosen.append(members[np.linspace(0, len(members) - 1, min(share, len(members))).astype(np.int64)])
    chosen.append(_culprit_rows(pairs, per_row))
    return distinct(ids[np.concatenate(chosen)])


def _culprit_rows(pairs: Columns, per_row: Sequence[dict]) -> np.ndarray:
    """Positions in ``pairs`` of up to PER_CULPRIT rows of each strict per-row culprit."""
    by_call: Dict[str, list] = {}
    for row in per_row:
        by_call.setdefault(row["culprit"], []).append((row["seq"], row["pos"]))
    if not by_call:
        return np.zeros(0, np.int64)
    where = {key: i for i, key in enumerate(zip(pairs["seq"].tolist(), pairs["pos"].tolist()))}
    picked = []
    for rows in by_call.values():
        picked += [
            where[rows[i]]
            for i in np.linspace(0, len(rows) - 1, min(PER_CULPRIT, len(rows))).astype(int).tolist()
            if rows[i] in where
        ]
    return np.asarray(picked, np.int64)


def row_errors(table: RowTable, a: Index, b: Index, pair_ids: np.ndarray, atol=None, rtol=None) -> Columns:
    """Per comparable (pair, tensor) entry of the chosen pairs: pair, ccode, is_in, is_out and the
    row's relative error, absolute error, whether a tolerance is exceeded (with tolerances) and
    its dtype's epsilon (NaN where the fingerprints are equal: nothing read)."""
    chosen = np.nonzero(table["comparable"] & np.isin(table["pair"], pair_ids))[0]
    n = len(chosen)
    found = {"rel": np.zeros(n), "abs": np.zeros(n), "exceeds": np.zeros(n, bool), "eps": np.full(n, np.nan)}
    differ = np.nonzero(table["differ"][chosen])[0]
    typical = _typical_magnitudes(table, a, chosen, distinct(table["tcode"][chosen[differ]]))
    # Rows with the same bytes on both sides (same fingerprints: an alias, a module's output that
    # is the next one's input, is most of them) and the same scale have the same errors: each
    # is read and compared once.
    at = chosen[differ]
    floor = np.array([typical[c] for c in table["tcode"][at].tolist()], dtype=np.float64)
    shape = table.column("shape_a", at)
    same = (
        np.stack(
            [table.column("fp_a", at), table.column("fp_b", at), shape.astype(np.int64), floor.view(np.int64)], axis=1
        )
        if len(at)
        else np.zeros((0, 4), np.int64)
    )
    _, first, copy_of = np.unique(same, axis=0, return_index=True, return_inverse=True)
    at, shape = at[first], shape[first]
    errors = {
        "rel": np.zeros(len(at)),
        "abs": np.zeros(len(at)),
        "exceeds": np.zeros(len(at), bool),
        "eps": np.full(len(at), np.nan),
    }
    # One batch per (tensor, row shape), its rows read pass by pass with the other batches'.
    key = table["tcode"][at].astype(np.int64) * max(len(table.shapes), 1) + shape
    order = np.argsort(key, kind="stable")
    bounds = np.r_[0, np.nonzero(np.diff(key[order]))[0] + 1, len(order)] if len(order) else np.zeros(1, np.int64)
    batches = [order[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]
    batches = in_file_order(b, table["entry_b"][at], batches)
    codes = [int(table["tcode"][at[batch[0]]]) for batch in batches]
    sizes = [len(batch) * max(row_bytes(table.shapes[shape[batch[0]]]), 1) for batch in batches]
    for chunk in chunks(sizes):
        names = [table.tensors[codes[i]] for i in chunk]
        ref_rows = read_batches(a, names, [table["entry_a"][at[batches[i]]] for i in chunk])
        test_rows = read_batches(b, names, [table["entry_b"][at[batches[i]]] for i in chunk])
        for i, (ref, ref_type), (test, test_type) in zip(chunk, ref_rows, test_rows):
            rel, absolute, exceeds, epsilon = _compare_rows(
                ref, test, ref_type, atol, rtol, test_type, typical[codes[i]]
            )
            batch = batches[i]
            errors["rel"][batch], errors["abs"][batch], errors["exceeds"][batch] = rel, absolute, exceeds
            errors["eps"][batch] = epsilon
    for name, values in errors.items():
        found[name][differ] = values[copy_of.reshape(-1)]
    return Columns(
        {
            "pair": table["pair"][chosen],
            "ccode": table["ccode"][chosen],
            "is_in": table["is_in"][chosen],
            "is_out": table["is_out"][chosen],
            **found,
            "own": _own_scale_errors(found, a.cols("rows")["amax"][table["entry_a"][chosen]]),
        }
    )


def _own_scale_errors(found: dict, amax: np.ndarray) -> np.ndarray:
    """Each row's error relative to its own largest |x| (A's), not floored at the typical row:
    at least ``rel``. A row far smaller than the typical one (the first tokens of a state-space
    model, whose residual grows along the sequence) carries its error at its own scale into a
    norm that scales it back up; floored, its input error would look 70x smaller than it is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(np.isfinite(amax) & (amax > 0) & (found["eps"] != 0), found["abs"] / amax, found["rel"])
    return np.maximum(own, found["rel"])


def _typical_magnitudes(table: RowTable, a: Index, chosen: np.ndarray, tcodes: np.ndarray) -> Dict[int, float]:
    """Per tensor code: the median of its rows' largest |x| (A's index, the chosen rows). A row's
    error is taken relative to at least this: a row that is near zero by cancellation (a gate
    that outputs one number, a logit near 0) would otherwise turn float noise into a huge
    relative error."""
    if not len(tcodes):
        return {}
    codes = table["tcode"][chosen]
    amax = a.cols("rows")["amax"][table["entry_a"][chosen]]
    order = np.argsort(codes, kind="stable")
    starts = np.searchsorted(codes[order], tcodes, "left")
    ends = np.searchsorted(codes[order], tcodes, "right")
    typical = {}
    for code, start, end in zip(tcodes.tolist(), starts.tolist(), ends.tolist()):
        values = amax[order[start:end]]
        values = values[np.isfinite(values)]
        typical[code] = float(np.median(values)) if len(values) else 0.0
    return typical


def _compare_rows(
    ref: np.ndarray,
    test: np.ndarray,
    dtype: DType,
    atol,
    rtol,
    test_dtype: Optional[DType] = None,
    scale_floor: float = 0.0,
):
    """Per row of two same-shaped arrays of elements held as bits (numpy: no torch start-up):
    relative error, absolute error, whether a tolerance is exceeded, and the dtype's epsilon.
    ``test_dtype``: the test side's element type when it is not ``dtype`` (values are compared).
    The relative error's scale is the row's largest finite |x|, at least ``scale_floor``."""
    n = ref.shape[0]
    test_dtype = test_dtype or dtype
    if not (dtype.floating and test_dtype.floating):
        differ = (
            _int_rows_differ(ref.reshape(n, -1), test.reshape(n, -1)) if dtype == test_dtype else np.ones(n, dtype=bool)
        )
        return differ.astype(float), differ.astype(float), differ, 0.0
    tolerances = atol is not None or rtol is not None
    if dtype.size <= 4 and test_dtype.size <= 4 and not tolerances:
        found = _finite_rows_in_float32(ref.reshape(n, -1), test.reshape(n, -1), dtype, test_dtype)
        if found is not None:  # the usual case: half the bytes of float64, no conversion copies
            absolute, magnitude = found
            scale = np.maximum(magnitude, max(tiny(dtype), scale_floor))
            return absolute / scale, absolute, np.zeros(n, dtype=bool), max(eps(dtype), eps(test_dtype))
    r, t = to_float64(ref.reshape(n, -1), dtype), to_float64(test.reshape(n, -1), test_dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(r - t)
        if np.isfinite(diff).all():  # both sides finite everywhere (the usual case): a third of the passes
            magnitude = np.abs(r)
        else:
            finite = np.isfinite(r) & np.isfinite(t)
            both_nan = np.isnan(r) & np.isnan(t)
            diff = np.where(finite, diff, np.where(both_nan | (r == t), 0.0, np.inf))
            magnitude = np.where(finite, np.abs(r), 0.0)
    scale = np.maximum(magnitude.max(axis=1, initial=0.0), max(tiny(dtype), scale_floor))
    absolute = diff.max(axis=1, initial=0.0)
    exceeds = np.zeros(n, dtype=bool)
    if tolerances:
        exceeds = (diff > (atol or 0.0) + (rtol or 0.0) * np.abs(r)).any(axis=1)
    return absolute / scale, absolute, exceeds, max(eps(dtype), eps(test_dtype))


def _int_rows_differ(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per row, whether two integer rows differ. Rows of distinct values that hold the same
    values in another order are the same choice: a router's top-k expert ids, two of them
    swapped by float noise at a near tie, pick the same experts. Not so a one-hot or mask row
    (repeated values), whose order is the choice."""
    differ = (ref != test).any(axis=1)
    sorted_ref, sorted_test = np.sort(ref, axis=1), np.sort(test, axis=1)
    distinct = (np.diff(sorted_ref, axis=1) != 0).all(axis=1) & (np.diff(sorted_test, axis=1) != 0).all(axis=1)
    return np.where(distinct, (sorted_ref != sorted_test).any(axis=1), differ)


def _finite_rows_in_float32(ref: np.ndarray, test: np.ndarray, dtype: DType, test_dtype: DType):
    """(max |a-b|, max |a|) per row, in float32, when every difference is finite (both sides
    finite, nothing overflows); else None. Values of these types are float32s exactly, and the
    difference of two close values is exact (Sterbenz); a far one rounds by a float32 ulp of
    itself, nothing a noise ratio can see."""
    r, t = to_float32(ref, dtype), to_float32(test, test_dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.subtract(r, t)
        np.abs(diff, out=diff)
    largest = diff.max(axis=1, initial=0.0)  # NaN or inf anywhere in a row shows in its max
    if not np.isfinite(largest).all():
        return None
    # r is finite here (else a difference would not be): its largest |x| from two reductions, no temporary
    magnitude = np.maximum(r.max(axis=1, initial=0.0), -r.min(axis=1, initial=0.0))
    return largest.astype(np.float64), magnitude.astype(np.float64)


def noise_floor_by_call(errors: Columns, calls: np.ndarray) -> Dict[str, float]:
    """From a repeat of the same run: the largest output error each call shows anyway."""
    outs = errors["is_out"]
    floor = np.zeros(len(calls))
    np.maximum.at(floor, errors["ccode"][outs], errors["rel"][outs])
    seen = np.bincount(errors["ccode"][outs], minlength=len(calls)) > 0
    return {str(calls[c]): float(floor[c]) for c in np.nonzero(seen)[0]}


def per_call_errors(
    errors: Columns, table: RowTable, pairs: Columns, traits: tuple, floor_by_call: Dict[str, float]
) -> Columns:
    """One entry per (pair, call): largest input and output error, tolerance flags, the floor
    and the amplification. ``arrived``: the input error at the typical row's scale, running
    over the sequence: what the code ahead of the call made, so what a gap is judged by.

    A call's output on a token row may depend on its inputs on every earlier row of the sequence
    (attention, a recurrent scan): its input error on a row is the largest over the sequence up
    to that row, so an error a scan carries forward is not taken for one it introduces. A call
    whose inputs are only integers (the model, taking token ids) gets its earlier rows' errors
    through the state it keeps (a KV cache): its input error on a row is its largest output
    error on earlier rows. The floor is at least the epsilon of the least precise float type
    inside the call: a float32 block whose mixer computes in bfloat16 makes bfloat16-sized noise.
    ``traits``: per call code, (that epsilon, whether the call takes a float input)."""
    precision, float_inputs = traits
    n_calls = max(len(table.calls), 1)
    cells, cell_of = np.unique(errors["pair"].astype(np.int64) * n_calls + errors["ccode"], return_inverse=True)
    cell_of = cell_of.reshape(-1)
    n = len(cells)
    is_in, is_out, rel = errors["is_in"], errors["is_out"], errors["rel"]
    in_err, out_err, out_eps = np.zeros(n), np.zeros(n), np.full(n, np.nan)
    # Integer inputs are metadata (an engine's cache slot per token row differs from run to run
    # by design): an error enters a call through its float inputs only.
    floating = is_in & ~(errors["eps"] == 0)
    np.maximum.at(in_err, cell_of[floating], rel[floating])
    in_own = np.zeros(n)
    np.maximum.at(in_own, cell_of[floating], errors["own"][floating])
    np.maximum.at(out_err, cell_of[is_out], rel[is_out])
    np.fmax.at(out_eps, cell_of[is_out], errors["eps"][is_out])  # NaN (not read) never wins
    pair, ccode = np.divmod(cells, n_calls)
    seq, pos = pairs["seq"][pair], pairs["pos"][pair]
    # A call taking token ids only (the model itself) gets earlier rows' errors through the state
    # it keeps, made by its submodules: the largest error of any call on an earlier row (its own
    # outputs may cover the last row only, as generate's logits do).
    arrived = np.where(
        float_inputs[ccode],
        _running_max(in_err, ccode, seq, pos),
        np.maximum(in_err, _earlier_rows_max(out_err, seq, pos)),
    )
    # A call is judged against its input's error on its own row at that row's own scale too (a
    # norm scales a small row back up); earlier rows' errors at the typical scale only, or one
    # small early row would hide every later row's jump.
    in_err = np.maximum(arrived, in_own)
    float_out = ~np.isnan(out_eps)
    out_eps = np.fmax(np.where(float_out, out_eps, eps(BY_NAME["float32"])), precision[ccode])
    floors = np.array([floor_by_call.get(c, 0.0) for c in table.calls.tolist()] or [0.0])
    floor = np.maximum(out_eps, floors[ccode])
    return Columns(
        {
            "pair": pair,
            "ccode": ccode,
            "in_err": in_err,
            "arrived": arrived,
            "out_err": out_err,
            "in_exceeds": np.bincount(cell_of[is_in & errors["exceeds"]], minlength=n) > 0,
            "out_exceeds": np.bincount(cell_of[is_out & errors["exceeds"]], minlength=n) > 0,
            "eps": out_eps,
            "float_out": float_out,
            "floor": floor,
            "amplification": _ratio(out_err, np.maximum(in_err, floor)),
        }
    )


def _ratio(out_err: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """out_err / scale; where the scale is 0 (integer outputs have no epsilon), inf for an error
    and 0 for none, without numpy's divide-by-zero warning on stderr."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = out_err / scale
    return np.where(scale > 0, ratio, np.where(out_err > 0, np.inf, 0.0))


def _earlier_rows_max(values: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Per cell, the largest value over every cell of its sequence at an earlier position."""
    if not len(values):
        return values
    _, seq_code = np.unique(seq.astype(str), return_inverse=True)
    width = int(pos.max()) + 1
    rows, row_of = np.unique(seq_code.reshape(-1).astype(np.int64) * width + pos, return_inverse=True)
    row_max = np.zeros(len(rows))
    np.maximum.at(row_max, row_of.reshape(-1), values)
    before = _running_max(row_max, np.zeros(len(rows), np.int64), rows // width, rows % width, exclusive=True)
    return before[row_of.reshape(-1)]


def _running_max(
    values: np.ndarray, ccode: np.ndarray, seq: np.ndarray, pos: np.ndarray, exclusive: bool = False
) -> np.ndarray:
    """Per (call, sequence), the running maximum of values in position order (``exclusive``: over
    the earlier rows only; 0 on a sequence's first row). ``seq``: names, or integer codes."""
    if not len(values):
        return values
    seq_code = seq if np.issubdtype(seq.dtype, np.integer) else np.unique(seq.astype(str), return_inverse=True)[1]
    order = np.lexsort((pos, seq_code.reshape(-1), ccode))
    group = ccode[order].astype(np.int64) * (int(seq_code.max()) + 1) + seq_code.reshape(-1)[order]
    segment = np.cumsum(np.r_[0, np.diff(group) != 0])  # 0, 0, 1, 1, 1, 2 ...
    # On ranks (exact, inf included): a later segment's keys exceed every earlier one's.
    levels, rank = np.unique(values[order], return_inverse=True)
    keys = segment * len(levels) + rank.reshape(-1)
    running = np.maximum.accumulate(keys)
    out = np.empty_like(values)
    if exclusive:
        first = np.r_[True, segment[1:] != segment[:-1]]
        before = np.r_[0, running[:-1]] - segment * len(levels)
        out[order] = np.where(first, 0.0, levels[np.maximum(before, 0)])
    else:
        out[order] = levels[running - segment * len(levels)]
    return out


def call_traits(table: RowTable, b: Index) -> tuple:
    """Per call code, from B's tensors and calls tables: the epsilon of the least precise float
    type among the outputs of the call and of every call inside it (by module path), and
    whether the call takes a float input with token rows."""
    by_module: Dict[str, float] = {}
    module_of = {}
    calls_b = b.cols("calls")
    first = calls_b.firsts("call")
    for call, module in zip(calls_b["call"][first].tolist(), calls_b["module"][first].tolist()):
        module_of[call] = module or ""
    tensors = b.cols("tensors")
    # On the distinct (call, dtype, io, token rows or not) of B's tensors: a long decode run
    # repeats each a few hundred times.
    dtype_codes, dtype_names = tensors.codes("dtype")
    call_codes, call_names = tensors.codes("call")
    io_codes, io_names = tensors.codes("io")
    dims_codes, dims_names = tensors.codes("token_dims")
    has_rows = (
        np.array([d not in (None, "null") for d in dims_names.tolist()], dtype=bool)[dims_codes]
        if len(dims_names)
        else np.zeros(len(tensors), bool)
    )
    combos = (
        np.unique(np.stack([call_codes, dtype_codes, io_codes, has_rows.astype(np.int64)], axis=1), axis=0)
        if len(tensors)
        else np.zeros((0, 4), np.int64)
    )
    float_input = set()
    for c, d, i, rows in combos.tolist():
        call, kind, io = call_names[c], BY_NAME.get(dtype_names[d]), io_names[i]
        if kind is None or not kind.floating or call not in module_of:
            continue
        if io == "out":  # what a call computes in (an input's type is the caller's: its noise is in in_err)
            module = module_of[call]
            by_module[module] = max(by_module.get(module, 0.0), eps(kind))
        elif io == "in" and rows:  # a float input per token row (not a mask)
            float_input.add(call)
    subtree = dict(by_module)
    for module, value in by_module.items():  # each module's precision reaches all its ancestors
        parts = module.split(".") if module else []
        for depth in range(len(parts)):
            ancestor = ".".join(parts[:depth])
            subtree[ancestor] = max(subtree.get(ancestor, 0.0), value)
    calls = table.calls.tolist()
    return (
        np.array([subtree.get(module_of.get(c, ""), 0.0) for c in calls] or [0.0]),
        np.array([c in float_input for c in calls] or [True]),
    )


def derive_threshold(calls: Columns, sampled: Optional[np.ndarray] = None) -> dict:
    """Robust spread of log10 amplification over the (row, call) cells that carry an error: an
    error in their inputs and in their outputs. A cell with clean inputs and a differing output
    is a candidate, judged against the line, not a sample of it: when the only calls with an
    error are a culprit and the calls that contain it (a decode-only bug in lm_head), their own
    jumps would set the line above themselves and the bug would pass for noise."""
    carrying = (calls["out_err"] > 0) & (calls["carried"] > 0)
    active = calls["amplification"][carrying if sampled is None else carrying & sampled]
    if not len(active):
        return {"amplification": MIN_AMPLIFICATION, "median": None, "mad": None, "samples": 0}
    logs = np.log10(np.maximum(active, 1e-12))
    median = float(np.median(logs))
    mad = float(np.median(np.abs(logs - median))) or 0.05
    threshold = max(MIN_AMPLIFICATION, 10 ** (median + MAD_FACTOR * mad))
    return {"amplification": threshold, "median": 10**median, "mad": mad, "samples": int(len(active))}


def noise_verdict(
    alignment: Alignment,
    a: Index,
    b: Index,
    table: RowTable,
    atol=None,
    rtol=None,
    floor_by_call: Optional[Dict[str, float]] = None,
    flips=(),
    uncompared=frozenset(),
    per_row: Sequence[dict] = (),
    model_dtype: Optional[str] = None,
) -> NoiseVerdict:
    """``model_dtype``: the dtype of the model's weights, as the dumps record it: no call computes
    more precisely than its weights, whatever dtype it outputs (a bfloat16 model's final norm
    over a float32 residual returns float32 made with bfloat16 weights: its clean noise reached
    90 float32-sized floors on a GPU). ``flips``: (router call, MoE block module, paired rows whose experts flipped at a near tie,
    their logits' relative errors), from analyzer/verdict/moe.py. ``uncompared``: the names of calls with
    an output that cannot be compared row by row (a gap that holds one names it). ``per_row``:
    the strict verdict's per-row culprits (the sample holds some rows of each)."""
    pair_ids = sample_pairs(alignment.cols, per_row=per_row)
    read_before = reader_of(a).bytes_read + reader_of(b).bytes_read
    errors = row_errors(table, a, b, pair_ids, atol, rtol)
    pairs = alignment.cols
    traits = call_traits(table, b)
    weights = BY_NAME.get(model_dtype or "")
    if (
        weights is not None and weights.floating and weights.size >= 2
    ):  # a float8 model still computes in 16 bits or more
        traits = (np.maximum(traits[0], eps(weights)), traits[1])
    calls = per_call_errors(errors, table, pairs, traits, floor_by_call or {})
    at_calls, at = calls_of_b(table, b, pairs["pass_b"][calls["pair"]], calls["ccode"])
    calls = calls.take(at)
    calls_b = b.cols("calls")
    pre, post = calls_b["pre"][at_calls], calls_b["post"][at_calls]
    calls = with_nesting(calls, pre, post, pairs, traits[1])
    modules = calls_b["module"][at_calls]
    first = calls_b.firsts("call")
    kind_of = dict(zip(calls_b["call"][first].tolist(), calls_b["cls"][first].tolist()))
    calls = with_peers(
        calls,
        table,
        _flipped_by_noise(calls, table, modules, flips, MIN_AMPLIFICATION),
        [str(kind_of.get(c, "")) for c in table.calls.tolist()],
    )
    if atol is not None or rtol is not None:
        rule = {"atol": atol, "rtol": rtol}
        explained = _flipped_by_noise(calls, table, modules, flips, MIN_AMPLIFICATION)
        introduced, gaps = calls["out_exceeds"] & ~calls["in_exceeds"] & ~explained, np.zeros(len(calls), bool)
    else:
        rule, introduced, gaps, explained = _derived_verdict(calls, table, modules, flips, pre, post)
    rule["floor_from_repeat"] = bool(floor_by_call)
    if explained.any():
        rule["rows_flipped_by_noise"] = int(len(distinct(calls["pair"][explained])))
    # The earliest introduction on each row: a call's when it completes, a gap's when the call
    # whose input shows it starts.
    chosen = np.r_[np.nonzero(introduced)[0], np.nonzero(gaps)[0]]
    is_gap = np.r_[np.zeros(int(introduced.sum()), bool), np.ones(int(gaps.sum()), bool)]
    when = np.where(is_gap, pre[chosen], post[chosen])
    by_time = np.lexsort((when, calls["pair"][chosen]))
    chosen, is_gap = chosen[by_time], is_gap[by_time]
    first = np.r_[True, np.diff(calls["pair"][chosen]) != 0] if len(chosen) else np.zeros(0, bool)
    firsts, first_gap = chosen[first], is_gap[first]
    names = table.calls[calls["ccode"]]
    order = call_order(b)
    verdict = {
        "rule": rule,
        "rows_examined": int(len(pair_ids)),
        "rows_total": int(len(pairs)),
        "culprits": [],
        "per_row": [],
    }
    seq, pos, kind = pairs["seq"], pairs["pos"], pairs["mode_b"]
    # A gap's figures are the error of what its code was given ('before') and of what it made
    # (the input of the call that follows it).
    in_err = np.where(first_gap, calls["before"][firsts], calls["in_err"][firsts])
    out_err = np.where(first_gap, calls["arrived"][firsts], calls["out_err"][firsts])
    amplification = np.where(first_gap, calls["gap_amplification"][firsts], calls["amplification"][firsts])
    # A gap is owned by the parent it was measured in (an attention module whose own forward
    # reads the KV cache between v_proj and o_proj), else by the innermost dumped call around
    # it; a call's error, by the call.
    owner = np.array(
        [
            f
            if not g
            else calls["parent"][f]
            if calls["parent"][f] >= 0
            else _enclosing(calls["pair"], pre, calls["done"], f, calls["after"][f])
            for f, g in zip(firsts.tolist(), first_gap.tolist())
        ],
        dtype=np.int64,
    )
    after = np.where(first_gap, calls["after"][firsts], -1)
    label = [names[o] if o >= 0 else names[f] for o, f in zip(owner.tolist(), firsts.tolist())]
    place = [
        (c, bool(g), names[x] if g and x >= 0 else None, names[f] if g else None)
        for c, g, x, f in zip(label, first_gap.tolist(), after.tolist(), firsts.tolist())
    ]
    for key in sorted(set(place), key=lambda p: (order.get(p[3] or p[0], 0), not p[1])):
        member = np.array([p == key for p in place], dtype=bool)
        group, shown = firsts[member], np.where(owner[member] >= 0, owner[member], firsts[member])
        rows = calls["pair"][group]
        kinds, first_seen, counts = np.unique(kind[rows].astype(str), return_index=True, return_counts=True)
        by_count = np.lexsort((first_seen, -counts))  # most rows first, ties as they come
        culprit = {
            "call": key[0],
            "module": calls_b["module"][at_calls[shown[0]]],
            "cls": calls_b["cls"][at_calls[shown[0]]],
            "rows": int(len(group)),
            "kinds": {str(kinds[k]): int(counts[k]) for k in by_count},
            "in_err": float(in_err[member].max()),
            "out_err": float(out_err[member].max()),
            "amplification": float(amplification[member].min()),
            "sample_rows": [{"seq": seq[p], "pos": int(pos[p]), "kind": kind[p]} for p in rows[:6].tolist()],
        }
        judged, best = ("gap_peer_judged", "gap_peer_best") if key[1] else ("peer_judged", "peer_best")
        if (
            "amplification" in rule and calls[judged][group].any()
        ):  # its line was drawn from the same op in other layers
            culprit["peers"] = float(calls[best][group][calls[judged][group]].max())
        if key[1]:
            culprit.update(gap_after=key[2], gap_before=key[3])
            held = _uncompared_in_gap(calls_b, int(pairs["pass_b"][rows[0]]), culprit, uncompared)
            if held:
                culprit["gap_uncompared"] = held
        elif culprit["in_err"] == 0 and calls["carries"][group].any():  # judged against its children
            culprit["inside_err"] = float(calls["inside"][group].max())
        verdict["culprits"].append(culprit)
    rows = calls["pair"][firsts]
    by_place = np.lexsort((pos[rows], seq[rows].astype(str)))[: MAX_LISTED * 10]
    verdict["per_row"] = [
        {
            "seq": seq[p],
            "pos": int(pos[p]),
            "kind": kind[p],
            "culprit": label[k],
            **({"gap_after": place[k][2], "gap_before": place[k][3]} if place[k][1] else {}),
            "in_err": float(in_err[k]),
            "out_err": float(out_err[k]),
            "amplification": float(amplification[k]),
        }
        for p, k in zip(rows[by_place].tolist(), by_place.tolist())
    ]
    verdict["bytes_read"] = int(reader_of(a).bytes_read + reader_of(b).bytes_read - read_before)
    # a noise flip's O(1) jump is no margin; a gap's jump is listed before the call whose input shows it
    kept = ~explained & (calls["gap_amplification"] > 0)
    # each jump with the line it stayed under (none under --atol/--rtol), so the summary's largest
    # jump is the list's first, judged as the verdict judged it
    line, gap_line = cell_lines(calls, rule["amplification"]) if "amplification" in rule else (None, None)
    gap_cells = Columns(
        {
            "amplification": calls["gap_amplification"][kept],
            "in_err": calls["before"][kept],
            "out_err": calls["arrived"][kept],
        }
    )
    gap_names = np.array([f"before {n}" for n in names[kept].tolist()], dtype=object)
    lined = "amplification" in rule  # under --atol/--rtol no line was drawn, from peers or otherwise
    peers = np.where(calls["peer_judged"] & lined, calls["peer_best"], np.nan)
    gap_peers = np.where(calls["gap_peer_judged"] & lined, calls["gap_peer_best"], np.nan)
    call_jumps = top_jumps(
        calls.take(~explained), names[~explained], None if line is None else line[~explained], peers[~explained]
    )
    gap_jumps = top_jumps(gap_cells, gap_names, None if gap_line is None else gap_line[kept], gap_peers[kept])
    jumps = call_jumps + [{**jump, "gap": True} for jump in gap_jumps]
    verdict["top_jumps"] = sorted(jumps, key=_nearest_first)[:8]
    if line is not None:
        # a row with a named error holds its victims (the culprit's parent carries its error, diluted)
        named_rows = np.isin(calls["pair"], calls["pair"][introduced | gaps])
        verdict["suspects"] = suspects(
            calls,
            names,
            line,
            gap_line,
            peers,
            np.where(calls["gap_peer_seen"] & lined, calls["gap_peer_best"], np.nan),
            introduced | explained | named_rows,
            gaps | explained | named_rows,
        )
    return verdict


def _nearest_first(jump: dict):
    """The jump nearest its line first (the largest where no line was drawn)."""
    return -(jump["amplification"] / jump["line"] if jump.get("line") else jump["amplification"])


MAX_SUSPECTS = 4
SUSPECT_ULPS = 8.0


def suspects(calls: Columns, names: np.ndarray, line, gap_line, peers, gap_peers, named, gap_named) -> list:
    """Calls and gaps not named, on rows where nothing was named, that noise hardly explains: far
    above every peer but under their line (SUSPECT_FACTOR), or over it with an error under the
    least an error must be (least_error). Either way the error is within SUSPECT_ULPS of that
    least error (a 1% error in bfloat16). Said with what would settle them, never counted as a
    state bug."""
    found = {}
    # an error within SUSPECT_ULPS of the least error is one: a 1% error of a bfloat16 row (1.3
    # epsilons) is, a float32 kernel's own few epsilons are not, however far above its peers
    # (float32 on a GPU: layer 0's attention makes 4-10 epsilons from inputs an ulp off, while the
    # same op in later layers, fed carried noise, barely amplifies it)
    least = least_error(calls)
    for gap, amp, lines, best, done, err in (
        (False, calls["amplification"], line, peers, named, calls["out_err"]),
        (True, calls["gap_amplification"], gap_line, gap_peers, gap_named, calls["arrived"]),
    ):
        some = err >= least / SUSPECT_ULPS
        over = (amp > lines) & (err <= least) & some
        far = (amp >= SUSPECT_FACTOR * np.nan_to_num(best, nan=np.inf)) & (amp >= MIN_SUSPECT_JUMP) & some
        for i in np.nonzero((over | far) & ~done & np.isfinite(best))[0].tolist():
            key = (f"before {names[i]}" if gap else names[i], gap)
            if key not in found or amp[i] > found[key]["amplification"]:
                found[key] = {
                    "call": key[0],
                    "gap": gap,
                    "amplification": float(amp[i]),
                    "line": float(lines[i]),
                    "peers": float(best[i]),
                    "out_err": float(calls["arrived"][i] if gap else calls["out_err"][i]),
                    "precision_eps": float(calls["eps"][i]),
                    "why": "error under the epsilon floor" if amp[i] > lines[i] else "under its line",
                }
    ranked = sorted(found.values(), key=lambda s: -s["amplification"] / max(s["peers"], 1e-30))
    return ranked[:MAX_SUSPECTS]


MAX_REFINEMENTS = 4
MIN_REFINED_SAMPLES = 50


def _derived_verdict(calls: Columns, table: RowTable, modules: np.ndarray, flips, pre: np.ndarray, post: np.ndarray):
    """(rule, introduced cells, gap cells, cells a routing flip explains) under the line derived
    from the run. A real error spreads: downstream of it every call reading the damaged state
    (each layer's attention over a stale cached key) jumps too, and those jumps, sampled as
    carried noise, widened the spread until the line stood above the first of them (1.4e5x on
    the real sglang server, the bug named on 1 row of 35). So the line is derived again from the
    cells that end before their row's first introduced error, until it no longer falls. A run
    in which nothing is named keeps its first line."""
    rule = derive_threshold(calls)
    first_line, all_samples = rule["amplification"], rule["samples"]
    introduced, gaps, explained = _judged(calls, table, modules, flips, rule)
    for _refinement in range(MAX_REFINEMENTS):
        if not (introduced.any() or gaps.any()):
            break
        rows = np.r_[calls["pair"][introduced], calls["pair"][gaps]]
        first_when = np.full(int(calls["pair"].max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first_when, rows, np.r_[post[introduced], pre[gaps]].astype(np.int64))
        refined = derive_threshold(calls, post.astype(np.int64) < first_when[calls["pair"]])
        if refined["amplification"] >= rule["amplification"] or refined["samples"] < MIN_REFINED_SAMPLES:
            break  # too few cells left to tell the noise's spread: the line stays
        rule = refined
        introduced, gaps, explained = _judged(calls, table, modules, flips, rule)
    if rule["amplification"] < first_line:
        rule["left_out"] = int(all_samples - rule["samples"])  # the cells after an introduced error
    return rule, introduced, gaps, explained


def _judged(calls: Columns, table: RowTable, modules: np.ndarray, flips, rule: dict):
    """Which cells introduce an error and which gaps do, under the rule's line (its other
    lines, said in the rule, follow from it)."""
    line_amp = rule["amplification"]
    rule["min_ulps"] = MIN_ULPS
    if (calls["eps"] > EPS_ACCUMULATE).any():  # the rule for 16-bit outputs, said where there are some
        rule["clean_input_16bit"] = float(clean_input_line(line_amp, eps(BY_NAME["bfloat16"])))
    if ((calls["eps"] <= EPS_ACCUMULATE) & calls["float_out"]).any():  # said where there are float32 outputs
        rule["clean_input_float32"] = max(line_amp, MIN_CLEAN_FLOAT32)
    rule["gap_amplification"] = max(line_amp, MIN_GAP_AMPLIFICATION)
    if (calls["peer_judged"] | calls["gap_peer_judged"]).any():  # said where some cell has peers
        rule["peer_factor"], rule["min_peer_jump"] = PEER_FACTOR, MIN_PEER_JUMP
    line, gap_line = cell_lines(calls, line_amp)
    least = least_error(calls)
    introduced = (calls["amplification"] > line) & (calls["out_err"] > least)
    gaps = (calls["gap_amplification"] > gap_line) & (calls["arrived"] > least)
    explained = _flipped_by_noise(calls, table, modules, flips, line_amp)
    return introduced & ~explained, gaps & ~explained, explained


def least_error(calls: Columns) -> np.ndarray:
    """Per cell, the smallest error that can be introduced: what the call's own kernels make from
    bit-identical inputs in another summation order stays under it (MIN_ULPS epsilons of a 16-bit
    output, MIN_CLEAN_FLOAT32 of a float32 one), whatever error came in. An input one ulp off
    makes a few ulps of a kernel's own noise look like a 10x jump (float32 on a GPU: layer 0's
    attention, 8 epsilons from 0.6 in)."""
    return np.where(calls["eps"] > EPS_ACCUMULATE, MIN_ULPS, MIN_CLEAN_FLOAT32) * calls["eps"]


def cell_lines(calls: Columns, line_amp: float):
    """Per cell, the line its call's jump is judged against and the line a gap before it is: the
    verdict and the largest jumps listed under it read the same lines."""
    # carried noise gets the line; bit-identical inputs (and children within an epsilon of
    # them: a bfloat16 attention whose o_proj moved under an ulp) the line in epsilons, 8 for a
    # 16-bit output, MIN_CLEAN_FLOAT32 for a float32 one
    clean_line = np.where(
        calls["eps"] > EPS_ACCUMULATE,
        np.minimum(line_amp, clean_input_line(line_amp, calls["eps"])),
        max(line_amp, MIN_CLEAN_FLOAT32),
    )
    line = np.where(calls["carries"], line_amp, clean_line)
    # a 16-bit gap from bit-identical values: the rounding argument of clean_input_line holds
    gap_line = np.where(
        calls["clean_gap"] & (calls["eps"] > EPS_ACCUMULATE), clean_line, max(line_amp, MIN_GAP_AMPLIFICATION)
    )
    # an error carried in, where the same op in other layers carried one too: their jumps draw the line
    line = np.where(calls["peer_judged"], peer_line(calls["peer_best"]), line)
    gap_line = np.where(calls["gap_peer_judged"], peer_line(calls["gap_peer_best"]), gap_line)
    return line, gap_line


def with_peers(calls: Columns, table: RowTable, explained: np.ndarray, kinds: Sequence[str] = ()) -> Columns:
    """Adds, per cell, the largest jump of its call's peers (the same op in the other layers,
    analyzer/verdict/peers.py) and whether that judges it: for a call, where it carries an error in; for
    a gap, where what its code was given differs. A peer's jump counts where it carried an error
    in and out (a routing flip's O(1) change is no jump). ``kinds``: each call's module class."""
    classes = op_classes(table.calls, kinds)
    carried = (calls["in_err"] > 0) & ~explained
    # a jump of inf or NaN (downstream of a NaN) says nothing of a peer's noise
    best, count = peer_maxima(
        calls["amplification"],
        calls["ccode"],
        carried & (calls["out_err"] > 0) & np.isfinite(calls["amplification"]),
        classes,
    )
    gap_open = (calls["gap_amplification"] > 0) & ~calls["clean_gap"] & ~explained
    gap_best, gap_count = peer_maxima(
        calls["gap_amplification"],
        calls["ccode"],
        gap_open & (calls["in_err"] > 0) & np.isfinite(calls["gap_amplification"]),
        classes,
    )
    code = calls["ccode"]
    return Columns(
        {
            **{name: calls[name] for name in calls.names},
            "peer_best": best[code],
            "peer_judged": (count[code] >= MIN_PEERS) & (calls["in_err"] > 0),
            "gap_peer_best": gap_best[code],
            "gap_peer_judged": (gap_count[code] >= MIN_GAP_PEERS) & gap_open,
            # too few to draw a line from, enough to make a jump far above them a suspect
            "gap_peer_seen": (gap_count[code] >= MIN_PEERS) & gap_open,
        }
    )


def _uncompared_in_gap(calls_b: Columns, pass_b: int, culprit: dict, uncompared) -> list:
    """The dumped calls whose output could not be compared and that ran before a gap's 'before'
    call, inside the call that holds the gap (else after its 'after' call), in the pass of B
    where the gap was first seen. Not only those after 'after': an error made on one path (q)
    shows only where the paths meet (o_proj), after calls on another path (k_norm) ran clean."""
    if not uncompared:
        return []
    here = np.nonzero(calls_b["pass"] == pass_b)[0]
    at = dict(zip(calls_b["call"][here].tolist(), here.tolist()))
    if culprit["gap_before"] not in at:
        return []
    pre, post = calls_b["pre"], calls_b["post"]
    if culprit["call"] != culprit["gap_before"] and culprit["call"] in at:
        start = pre[at[culprit["call"]]]
    elif culprit.get("gap_after") in at:
        start = post[at[culprit["gap_after"]]]
    else:
        start = -1
    end = pre[at[culprit["gap_before"]]]
    return [name for name, i in at.items() if name in uncompared and start < pre[i] and 0 <= post[i] < end][:MAX_LISTED]


def with_nesting(
    calls: Columns, pre: np.ndarray, post: np.ndarray, pairs: Columns, float_inputs: np.ndarray
) -> Columns:
    """Judge each call by what the dumped calls around it show, on its row (and, as for inputs,
    on the earlier rows of its sequence):

    - inside: the largest output error of the calls nested in it (pre < theirs < post). A call
      with bit-identical inputs whose children are dumped is judged against them: a decoder
      layer's error from such inputs is its kernels' noise compounded (float32: 36 epsilons,
      no bug), not an error of its own; its own code is still named when its output jumps
      beyond them.
    - before: the largest error of what the code ahead of it was given (its parent's input and
      the parent's children completed so far; with no such parent, every call completed before
      it); a jump from that to its input error was made in code no hook saw (a parent's own
      forward between its children, or modules DUMPER_FILTER left out): a gap.
    - after: the cell of the call completed last before it starts (-1: none).

    Adds inside, before, after, parent (the cell 'before' was measured in; -1: none), carried
    (in_err, or inside where in_err is 0), carries (whether the line for carried noise judges
    it, not the line in epsilons), amplification (against carried), gap_amplification (0 where
    nothing completed before, or the call takes no float input: an error that arrives from no
    dumped call cannot be judged), clean_gap and done (completion order; never finished: last)."""
    pair = calls["pair"].astype(np.int64)
    out_err, n = calls["out_err"], len(calls)
    width = int(max(pre.max(initial=0), post.max(initial=0))) + 2
    done = np.where(post >= 0, post, width - 1)  # never finished: after everything
    # inside: a range maximum over the cells of the pair in start order
    by_pre = np.lexsort((pre, pair))
    keys = pair[by_pre] * width + pre[by_pre]
    lo = np.searchsorted(keys, pair * width + pre, "right")
    hi = np.searchsorted(keys, pair * width + done, "left")
    inside = _range_max(out_err[by_pre], lo, hi)
    # before: inside a dumped parent that takes a float input, the parent's input error and
    # the output errors of its children completed so far (a call completing between the
    # parent's start and this call's is inside the parent: calls nest); elsewhere every call
    # completed before it on the row
    by_post = np.lexsort((done, pair))
    keys = pair[by_post] * width + done[by_post]
    running = _running_max(out_err[by_post], np.zeros(n, np.int64), pair[by_post], done[by_post])
    last = np.searchsorted(keys, pair * width + pre, "left") - 1
    has_before = (last >= 0) & (pair[by_post][np.maximum(last, 0)] == pair) if n else np.zeros(0, bool)
    after = np.where(has_before, by_post[np.maximum(last, 0)] if n else -1, -1)
    seq_of_pair = np.unique(pairs["seq"].astype(str), return_inverse=True)[1].reshape(-1) if n else pair
    seq, pos, ccode = seq_of_pair[pair], pairs["pos"][pair], calls["ccode"]
    parent = _parents(pair, pre, done)
    local = parent >= 0
    local[local] = float_inputs[ccode[parent[local]]]
    parent_at = np.maximum(parent, 0)
    lo = np.searchsorted(keys, pair * width + pre[parent_at], "right")
    within = _range_max(out_err[by_post], lo, np.maximum(last + 1, lo))
    everything = np.where(has_before, running[np.maximum(last, 0)] if n else 0.0, 0.0)
    # at the typical scale, as the gap's own error ('arrived'): a parent's small early rows at
    # their own scale, carried along the sequence, would hide the gap on every later row
    before = np.where(local, np.maximum(within, calls["arrived"][parent_at] if n else 0.0), everything)
    inside = _running_max(inside, ccode, seq, pos)
    before = _running_max(before, ccode, seq, pos)
    # A call with bit-identical inputs is judged against the calls inside it (a composite's
    # clean-input error is its kernels' noise compounded); one that carries an error in, against
    # that, as any call: the noise line is drawn from such cells, composites among them.
    carried = np.where(calls["in_err"] > 0, calls["in_err"], inside)
    carries = (calls["in_err"] > 0) | (inside > calls["floor"])  # judged by the line, not in epsilons
    # Where nothing before it differs, a gap inside such a parent is judged as a call with
    # bit-identical inputs is (an attention whose own forward reads a corrupted cache after its
    # v_proj); not where the error may come from whole modules no hook saw since the token ids
    # (a filter that leaves out layers under a root that takes only ids).
    clean_gap = float_inputs[ccode] & local & (before == 0)
    judged = float_inputs[ccode] & ((before > 0) | clean_gap)
    gap = np.where(judged, _ratio(calls["arrived"], np.maximum(before, calls["floor"])), 0.0)
    return Columns(
        {
            **{name: calls[name] for name in calls.names},
            "inside": inside,
            "before": before,
            "after": after,
            "carried": carried,
            "amplification": _ratio(out_err, np.maximum(carried, calls["floor"])),
            "gap_amplification": gap,
            "clean_gap": clean_gap,
            "parent": np.where(local, parent, -1),
            "carries": carries,
            "done": done,
        }
    )


def _parents(pair: np.ndarray, pre: np.ndarray, done: np.ndarray) -> np.ndarray:
    """Per cell, the innermost cell of its pair that encloses it (-1: none): calls nest, so a
    stack over the cells in start order."""
    parent = np.full(len(pair), -1, np.int64)
    pairs, starts, ends = pair.tolist(), pre.tolist(), done.tolist()
    stack, current = [], None
    for i in np.lexsort((pre, pair)).tolist():
        if pairs[i] != current:
            stack, current = [], pairs[i]
        while stack and ends[stack[-1]] < starts[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _enclosing(pair: np.ndarray, pre: np.ndarray, done: np.ndarray, cell: int, after: int) -> int:
    """The innermost cell of the same pair that started before the gap (after the cell ``after``
    completed, before ``cell`` started) and had not completed when it ended; -1 if none."""
    start = done[after] if after >= 0 else pre[cell]
    around = np.nonzero((pair == pair[cell]) & (pre < start) & (done > pre[cell]))[0]
    return int(around[np.argmax(pre[around])]) if len(around) else -1


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo:hi]) for each (lo, hi); 0 where the range is empty."""
    if not len(values):
        return np.zeros(len(lo))
    bounds = np.stack([lo, hi], axis=1).reshape(-1)
    found = np.maximum.reduceat(np.r_[values, 0.0], bounds)[::2]
    return np.where(hi > lo, found, 0.0)


def _flipped_by_noise(calls: Columns, table: RowTable, modules: np.ndarray, flips, line: float) -> np.ndarray:
    """Cells whose error a routing flip explains: on a row where noise reached the router's
    input, its logits moved no more than noise carries (under the line), and a near tie among
    them flipped its experts (analyzer/verdict/moe.py), the router, its MoE block and the calls around
    the block change by O(1) with no bug. A router that picks other experts, or moves its
    logits, by itself is still named."""
    explained = np.zeros(len(calls), bool)
    names = table.calls[calls["ccode"]]
    modules = modules.astype(str)
    for router, block, flipped, logit_err in flips:
        at = np.nonzero(names == router)[0]
        err_of = dict(zip(flipped, logit_err))
        noisy = [
            int(calls["pair"][i])
            for i in at
            if calls["in_err"][i] > 0
            and int(calls["pair"][i]) in err_of
            and err_of[int(calls["pair"][i])] <= line * max(calls["in_err"][i], calls["floor"][i])
        ]
        rows = np.isin(calls["pair"], np.asarray(noisy, np.int64))
        if not rows.any():
            continue
        known, module_of = np.unique(modules, return_inverse=True)
        near = np.array(
            [m == block or m.startswith(block + ".") or not m or block.startswith(m + ".") for m in known.tolist()],
            dtype=bool,
        )  # the block, inside it, or around it
        explained |= rows & near[module_of.reshape(-1)]
    return explained


def top_jumps(
    calls: Columns,
    names: np.ndarray,
    lines: Optional[np.ndarray] = None,
    peers: Optional[np.ndarray] = None,
    limit: int = 8,
) -> list:
    """The jumps nearest their lines, introduced or not: context for judging the threshold.
    ``lines``: per cell, the line it was judged against (said as "line"); ``peers``: the largest
    jump of the same op in other layers where that drew the line (NaN elsewhere)."""
    margin = calls["amplification"] / lines if lines is not None else calls["amplification"]
    ranked = np.argsort(-margin, kind="stable")
    seen, best = set(), []
    for at in ranked.tolist():
        if names[at] in seen:
            continue
        seen.add(names[at])
        best.append(
            {
                "call": names[at],
                "in_err": float(calls["in_err"][at]),
                "out_err": float(calls["out_err"][at]),
                "amplification": float(calls["amplification"][at]),
                **({"line": float(lines[at])} if lines is not None else {}),
                **({"peers": float(peers[at])} if peers is not None and np.isfinite(peers[at]) else {}),
            }
        )
        if len(best) == limit:
            break
    return best
