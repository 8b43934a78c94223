"""The first-divergence pipeline: open both dumps, check they are comparable, index, align, prove,
and give the verdict rank by rank. Returns the result every report format renders (typed in
result.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Optional

import numpy as np

from ..dump.load import Dump, open_dump, show
from ..errors import DumpError
from ..index.memtune import keep_freed_memory
from ..index.printkind import fingerprint_only
from ..index.store import load_indexes
from .align import align, metadata_only, prove, row_selection_hint
from .compare import VERDICT_ROW_COLUMNS, plan_join, row_table, strict_verdict, uncompared_calls
from .kinds import rank_kind, worst_kind
from .phrases import GAP_CODE, NOISE_ONLY, input_error, noise_place
from .prints import blind_summary
from .result import FirstDivergence

# What must match for a comparison to mean anything. The model path may differ (a copy, an
# engine's own cache), so it is only reported.
IDENTITY_KEYS = ("model_type", "num_layers", "dtype", "tp_size")


def differing_key(a: Dump, b: Dump, keys=IDENTITY_KEYS) -> Optional[str]:
    """'key (a vs b)' for the first of these run.json keys both dumps hold with other values."""
    for key in keys:
        va, vb = a.run.get(key), b.run.get(key)
        if va is not None and vb is not None and va != vb:
            return f"{key} ({va!r} vs {vb!r})"
    return None


def check_same_model(a: Dump, b: Dump, allow: bool) -> None:
    differ = differing_key(a, b)
    if differ and not allow:
        raise DumpError(
            f"the dumps differ in {differ}; compare dumps of the same model and settings, or pass --allow-mismatch "
            "if that is intended (dumpdiff compare judges runs of other dtypes, engines or tp sizes)"
        )
    if set(a.ranks) != set(b.ranks) and not allow:
        raise DumpError(
            f"the dumps have different ranks ({sorted(a.ranks)} vs {sorted(b.ranks)}); dump both runs with the "
            "same tensor-parallel size"
        )


def first_divergence(
    path_a: str,
    path_b: str,
    trust_alignment: bool = False,
    allow_mismatch: bool = False,
    progress: bool = True,
    rebuild_index: bool = False,
    rank: Optional[int] = None,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    noise_repeat: Optional[str] = None,
    noise_aware: bool = True,
) -> FirstDivergence:
    dump_a, dump_b = open_dump(path_a), open_dump(path_b)
    if noise_repeat and fingerprint_only(dump_a, dump_b):
        raise DumpError(
            f"--noise needs tensor values, and {' and '.join(fingerprint_only(dump_a, dump_b))} holds row "
            "fingerprints only: dump with DUMPER_NON_INTRUSIVE_MODE=all"
        )
    floors = _repeat_floors(dump_a, noise_repeat, progress) if noise_repeat else {}
    check_same_model(dump_a, dump_b, allow_mismatch)
    # the rows table's columns are decoded in the background while the next index opens and the rows align
    index_a, index_b = load_indexes(
        [dump_a, dump_b],
        rebuild=rebuild_index,
        progress=progress,
        prefetch=("rows", VERDICT_ROW_COLUMNS + (("amax",) if noise_aware else ())),
    )
    keep_freed_memory()  # the join's transient arrays reuse freed memory (the dumpdiff program only)
    ranks = sorted(set(dump_a.ranks) & set(dump_b.ranks))
    if rank is not None:
        if rank not in ranks:
            raise DumpError(f"rank {rank} is not in both dumps (ranks {ranks})")
        ranks = [rank]
    result = {
        "a": describe(dump_a),
        "b": describe(dump_b),
        "ranks": {},
        "warnings": dump_a.warnings() + dump_b.warnings(),
    }
    filters = [_filter_text(d.setting("filter")) for d in (dump_a, dump_b)]
    if filters[0] != filters[1]:
        _warn(
            result,
            f"the dumps were made with different DUMPER_FILTERs ({filters[0]!r} and {filters[1]!r}): only calls "
            "hooked in both are compared; dump both with the same filter",
        )
    if os.path.realpath(dump_a.path) == os.path.realpath(dump_b.path):
        _warn(result, f"both arguments are the same dump ({show(dump_a.label)}): it is compared with itself")
    for r in ranks:
        ia, ib = index_a.rank(r), index_b.rank(r)
        ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dumpdiff-plan")
        try:  # the join's codes and grids need the indexes only: made while the rows align
            plan = ahead.submit(plan_join, ia, ib)
            alignment = prove(align(ia, ib), ia, ib, dump_a.label, dump_b.label, trust=trust_alignment)
        finally:
            ahead.shutdown(wait=False)  # an alignment that fails says so at once; the plan's own error comes
            #                             after the checks below, as the join's did before it was planned ahead
        if alignment.decode_a and not alignment.decode_b and r == ranks[0]:
            _warn_swapped(result, dump_a, dump_b, alignment.decode_a)
        _check_cut_off_reference(dump_a, dump_b, alignment, r)
        _warn_cached_reference(result, dump_a, alignment, r)
        _check_unknown_prefixes(result, dump_b, alignment)
        if alignment.ambiguous_b:
            _warn(
                result,
                f"{alignment.ambiguous_b} token rows of {show(dump_b.label)} are not compared: "
                f"{alignment.ambiguous_note}",
            )
        table = row_table(alignment, ia, ib, plan.result())
        uncompared, unseen_outputs = uncompared_calls(table, ia, ib)
        verdict = strict_verdict(alignment, ia, ib, table, uncompared)
        if not verdict["rows_compared"]:  # "no divergence" would pass off a comparison of nothing as clean
            raise DumpError(_nothing_compared(len(alignment.cols), ia, ib))
        if verdict.get("unattributed"):
            _warn(result, verdict["unattributed"])
        if not verdict["rows_differing"] and alignment.cached_unpaired_b:  # clean, but not on every row
            _warn(
                result,
                f"{alignment.cached_unpaired_b} decode or extend rows of {show(dump_b.label)} were not compared "
                "(no partner, or the ids before them unknown): no divergence holds for the compared rows only",
            )
        blind = fingerprint_only(dump_a, dump_b)
        if blind and verdict["rows_differing"]:  # no values to judge noise with: said, not guessed
            verdict["fingerprint_only"] = blind
            verdict["summary"] = blind_summary(verdict, blind)
        elif noise_aware and verdict["rows_differing"]:
            from .moe import routing_flips  # these read tensor values: not under --strict-only
            from .noise import noise_verdict

            flipped_rows = []  # a flip that input noise caused is no introduced error
            flips = routing_flips(alignment, ia, ib, table, dump_a.run, flipped_rows)
            if flips:
                verdict["routing_flips"] = flips
            verdict["noise"] = noise_verdict(
                alignment,
                ia,
                ib,
                table,
                atol,
                rtol,
                floors.get(r),
                flipped_rows,
                unseen_outputs,
                verdict["per_row"],
                dump_b.run.get("dtype") or dump_a.run.get("dtype"),
            )
            verdict["summary"] = summarize(verdict)
        verdict["alignment"] = {
            "proof": alignment.proof,
            "rows_b": alignment.rows_b,
            "unaligned_b": alignment.unaligned_b,
            "unkeyed_b": alignment.unkeyed_b,
            "embedding": alignment.embedding,
        }
        verdict["kind"] = rank_kind(verdict)
        result["ranks"][str(r)] = verdict
    result["diverged_ranks"] = [int(r) for r, v in result["ranks"].items() if v["rows_differing"]]
    result["divergence"] = bool(result["diverged_ranks"])
    result["kind"] = worst_kind(result["ranks"])
    first = next((v for v in result["ranks"].values() if v["culprit"]), None)
    result["culprit"] = first["culprit"] if first else None
    return result


def _warn_swapped(result: dict, a: Dump, b: Dump, decode_a: int) -> None:
    """The reference (first argument) holds decode steps and the run under test none: the usual
    slip of giving the decode run first. The verdict still runs (the labels say which is which).
    Extend rows in a reference are no sign of it: chunked prefills and cache hits make them."""
    _warn(
        result,
        f"{show(a.label)} (the reference, first argument) has {decode_a} decode rows and {show(b.label)} has "
        "none: are the arguments swapped? give the reference prefill first: first-divergence REF DEC",
    )


def _filter_text(setting) -> str:
    """A DUMPER_FILTER as its selection: 'name=X' and 'X' are one filter."""
    text = setting if isinstance(setting, str) else ""
    return text[len("name=") :] if text.startswith("name=") else text


def _check_cut_off_reference(a: Dump, b: Dump, alignment, rank: int) -> None:
    """A reference whose writer died mid-dump lacks the rows it never wrote: a verdict over the
    rows left would pass a partial comparison off as the whole one."""
    part = a.ranks.get(rank)
    cut = a.incomplete or (part is not None and (part.unclosed or part.torn_lines))
    if cut and alignment.cached_unpaired_b:
        raise DumpError(
            f"{show(a.label)} (the reference) was cut off (its writer never closed it: killed mid-dump?) and "
            f"{alignment.cached_unpaired_b} decode or extend rows of {show(b.label)} have no partner in it: "
            "dump the reference again"
        )


def _warn_cached_reference(result: dict, a: Dump, alignment, rank: int) -> None:
    """Paired reference rows computed in extend passes: a chunked prefill or a prefix-cache hit.
    A cache or restore bug then runs in the reference too. (Decode rows in a reference are not
    said here: two decode runs compared for run-to-run determinism have them by design.)"""
    cached = int(np.count_nonzero(alignment.cols["mode_a"] == "extend"))
    if not cached:
        return
    where = f" (rank {rank})" if len(a.ranks) > 1 else ""
    _warn(
        result,
        f"{cached} paired rows of {show(a.label)}{where} were computed on a cache (a chunked prefill or a "
        "prefix-cache hit): a cache or restore bug would run in the reference too; for a cache-free reference flush "
        "the cache and prefill prompt+output in one chunk (sglang: --chunked-prefill-size larger than it)",
    )


def _check_unknown_prefixes(result: dict, b: Dump, alignment) -> None:
    """Rows of the run whose earlier token ids are unknown pair with nothing: say why, next to
    a verdict that covers the other rows only. Positions that jump between consecutive engine
    steps are an engine bug on exactly the rows that cannot be compared: exit 2 (a verdict over
    the others would pass it off as clean or as noise)."""
    if not (alignment.unkeyed_b and alignment.history_notes_b):
        return
    why = "; ".join(alignment.history_notes_b)
    if alignment.positions_jump_b:
        raise DumpError(
            f"{alignment.unkeyed_b} token rows of {show(b.label)} cannot be paired: {why}; no verdict is "
            "given over the other rows"
        )
    _warn(
        result,
        f"{alignment.unkeyed_b} token rows of {show(b.label)} are not compared: {why}; the verdict covers the "
        "other rows only",
    )


def _warn(result: dict, note: str) -> None:
    """On stderr now, and in the report."""
    logging.getLogger("dumpdiff").warning("warning: %s", note)
    result["warnings"].append(note)


def _nothing_compared(n_pairs: int, a, b) -> str:
    """Why no paired token row has a tensor row stored on both sides, and what to dump instead."""
    if metadata_only(a, b):
        why = "; a dump made with DUMPER_NON_INTRUSIVE_MODE=core holds pass metadata only: dump with =all"
    else:
        why = row_selection_hint(a, b) or "; dump both runs with the same DUMPER_FILTER and no row selection"
    return f"nothing was compared: none of the {n_pairs} paired token rows has a tensor row dumped on both sides{why}"


def _repeat_floors(dump_a: Dump, repeat_path: str, progress: bool) -> dict:
    """Per rank, per call: the output error two runs of the same reference show anyway."""
    from .noise import noise_floor_by_call, row_errors

    repeat = open_dump(repeat_path)
    check_same_model(dump_a, repeat, allow=False)
    index_a, index_r = load_indexes([dump_a, repeat], progress=progress)
    floors = {}
    for r in sorted(set(dump_a.ranks) & set(repeat.ranks)):
        ia, ir = index_a.rank(r), index_r.rank(r)
        alignment = prove(align(ia, ir), ia, ir, dump_a.label, repeat.label)
        _check_repeat(alignment, ia, repeat_path)
        table = row_table(alignment, ia, ir)
        floors[r] = noise_floor_by_call(row_errors(table, ia, ir, alignment.cols["pair"]), table.calls)
    return floors


def _check_repeat(alignment, index_a, repeat_path: str) -> None:
    """A noise floor from anything but a repeat of the reference run would absorb real errors
    (the decode run given by mistake makes every difference "noise")."""
    rows_a = int(np.count_nonzero(index_a.cols("tokens")["valid"]))
    if alignment.decode_b > alignment.decode_a or alignment.unaligned_b or len(alignment.cols) < rows_a:
        what = (
            f"holds {alignment.decode_b} decode rows (the reference {alignment.decode_a})"
            if alignment.decode_b > alignment.decode_a
            else f"pairs {len(alignment.cols)} of the reference's {rows_a} token rows"
        )
        raise DumpError(
            f"--noise {show(repeat_path)}: {what}; give a second dump of the reference run itself "
            "(the same prefill, run again)"
        )


def summarize(verdict: dict) -> str:
    """Say in words which verdict is which."""
    strict, noise = verdict.get("culprit"), verdict.get("noise", {})
    found = noise.get("culprits", [])
    parts = []
    if strict:
        parts.append(f"The first bit flips at {strict['call']} ({strict['cls']}): inputs identical, output not.")
        if not (found and found[0]["call"] == strict["call"]):  # else it is the real error, not batch-variance
            parts.append("That is where batch-variance starts: the kernel to make batch-invariant.")
    if found:
        top = found[0]
        kinds = ", ".join(f"{n} {k}" for k, n in top["kinds"].items())
        examined, total = noise.get("rows_examined"), noise.get("rows_total")
        sampled = (
            f" of the {examined} sampled (of {total})" if examined is not None and total and examined < total else ""
        )
        rule = noise.get("rule", {})
        if "atol" in rule:  # the user's tolerance decided, not an amplification line
            why = (
                f"inputs within atol={rule['atol']}, rtol={rule['rtol']}, output not "
                f"(output error {top['out_err']:.3g}, input error {top['in_err']:.3g})"
            )
        elif top.get("gap_before"):
            why = f"the input error of {top['gap_before']}, {top['out_err']:.3g}, against {top['in_err']:.3g} in what that code was given, {top['amplification']:.3g}x, far beyond float noise"
        elif top["in_err"] == 0 and not top.get(
            "inside_err"
        ):  # judged in epsilons: no reordering of a float32 sum moves a 16-bit output that far
            unit = (
                "times its noise floor from the repeat run"
                if rule.get("floor_from_repeat")
                else "epsilons of its precision"
            )
            why = (
                f"output error {top['out_err']:.3g} from bit-identical inputs, {top['amplification']:.3g} {unit}, "
                "beyond what another summation order makes"
            )
        else:
            why = (
                f"output error {top['out_err']:.3g} from input error {input_error(top)}, "
                f"{top['amplification']:.3g}x amplification, far beyond float noise"
            )
        if top.get("peers") is not None:  # a line drawn from peers (none under --atol/--rtol)
            why += f"; the same {'code' if top.get('gap_before') else 'op'} in other layers jumps {top['peers']:.3g}x at most"
        if top.get("gap_before"):
            parts.append(
                f"A real error is introduced in {noise_place(top)} on {top['rows']} rows{sampled} ({kinds}): "
                f"{why}. Look at the code that runs there ({GAP_CODE}) for a state or cache bug, or a kernel "
                "wrong at this batch shape; dump its modules to name the op."
            )
        else:
            parts.append(
                f"A real error is introduced at {top['call']} ({top['cls']}) on {top['rows']} rows{sampled} "
                f"({kinds}): {why}. Look there for a state or cache bug, or a kernel wrong at this batch shape."
            )
    elif strict:
        parts.append(f"No call introduces an error beyond float noise{_margin(noise)}: {NOISE_ONLY}")
    suspected = _suspect_sentence(noise)
    if suspected:
        parts.append(suspected)
    flipped = noise.get("rule", {}).get("rows_flipped_by_noise")
    if flipped:
        parts.append(
            f"On {flipped} rows the MoE experts flipped because input noise reached the router: their O(1) "
            "error around the MoE block is counted as noise (see routing flips)."
        )
    return " ".join(parts)


def _margin(noise: dict) -> str:
    """How far the jump nearest its line stayed under it: an error within float noise cannot be
    told from it. That jump is the first listed (a gap's too: "before X"), with the line it was
    judged against: its peers' (the same op in other layers), a gap's, a call's, or a call's from
    bit-identical inputs (in epsilons)."""
    jumps = noise.get("top_jumps") or []
    if not jumps or jumps[0].get("line") is None:  # a tolerance (--atol/--rtol) drew no line
        return ""
    top = jumps[0]
    where = f"{top['call']} (in code not dumped)" if top.get("gap") else f"at {top['call']}"
    if top.get("peers") is not None:
        which = f" drawn from the same op in other layers (largest {top['peers']:.3g}x)"
    elif top.get("gap"):
        which = " for code not dumped"
    else:
        which = " for bit-identical inputs" * (top["line"] != noise["rule"]["amplification"])
    if top["amplification"] > top["line"]:  # over it, its error too small to be introduced
        return (
            f" (the jump nearest its line, {top['amplification']:.3g}x {where}, is over its {top['line']:.3g}x "
            f"line{which}, but its error is within what a kernel makes from identical inputs: 8 epsilons of a "
            "16-bit output, 100 of a float32 one)"
        )
    return f" (the jump nearest its line, {top['amplification']:.3g}x {where}, is under its {top['line']:.3g}x line{which})"


def _suspect_sentence(noise: dict) -> str:
    """The suspects in words, with what would settle them: a jump far above the same op in other
    layers is no proof of a bug in a run this noisy, and no proof of noise either."""
    found = noise.get("suspects") or []
    if not found:
        return ""
    shown = "; ".join(
        f"{s['call']} {s['amplification']:.3g}x against at most {s['peers']:.3g}x in other layers"
        + (" (its error under the epsilon floor)" if s["why"] != "under its line" else "")
        for s in found
    )
    from .noise import EPS_ACCUMULATE  # only once a noise-aware verdict was made

    coarse = any(s["precision_eps"] > EPS_ACCUMULATE for s in found)  # 16-bit: float32 shrinks noise 65000x
    how = "dump both runs in float32 (noise shrinks, a real error does not) or give" if coarse else "give"
    return (
        f"Suspect{'s' * (len(found) > 1)}, not named: {shown}. To settle it, {how} a second dump of the "
        "reference run (--noise): each call's own noise is then measured, not inferred."
    )


def describe(dump: Dump) -> dict:
    run = dump.run
    return {
        "path": show(dump.path),
        "label": show(dump.label),
        "engine": run.get("engine"),
        "model": run.get("model"),
        "dtype": run.get("dtype"),
        "device": run.get("device"),
        "tp_size": run.get("tp_size"),
        "versions": run.get("versions", {}),
        "flags": run.get("flags", {}),
        "passes": sum(len(r.passes) for r in dump.ranks.values()),
        "ranks": sorted(dump.ranks),
        "incomplete": dump.incomplete,
    }
