"""Convert a dump of sglang's BUILT-IN dumper (sglang.srt.debug_utils.dumper) into a dumpdiff dump.

sglang writes one ``.pt`` file per tensor, tags in the file name::

    step=3___rank=0___dump_index=12___name=non_intrusive__model.layers.0.mlp.inputs.0___...pt

each holding {"value": tensor, "meta": dict}. ``step`` advances once per forward pass; in
non-intrusive mode a module's inputs are named ``non_intrusive__<path>.inputs.<i|kwarg>`` and its
outputs ``.output`` / ``.output.<i|key>``; the core fields ``input_ids``, ``positions``,
``seq_lens``, ``req_pool_indices`` and ``rids`` describe the batch of that step.

One pass per (rank, step). Tensor ``<path>.inputs.<slot>`` becomes ``<path>#<k>.in.<slot>``
(k: the call index of a module called more than once in a step, in dump_index order). Token
rows come from the step's core fields: sequence i owns the consecutive rows up to the one at
position seq_lens[i]-1 (so extend, chunked prefill and decode are all handled alike).

Files are read with ``torch.load(weights_only=True)`` only; a file it refuses is skipped and
counted. This module never imports sglang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file

from dumpdiff.dumper import format as fmt

from ..errors import DumpError
from .load import show

ENGINE = "sglang-builtin"
PREFIX = "non_intrusive__"
CORE_FIELDS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "rids")
_NAME_RE = re.compile(r"^(?:(?P<module>.*)\.)?(?P<io>inputs|output)(?:\.(?P<slot>[^.]+))?$")


@dataclasses.dataclass
class ImportResult:
    dst: str
    ranks: Dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> passes written
    files: int = 0
    warnings: List[str] = dataclasses.field(default_factory=list)
    refused: int = 0  # files torch.load(weights_only=True) refused
    other: int = 0  # .pt files whose name is not a tensor of a hooked module nor a core field

    def describe(self) -> str:
        lines = [
            f"imported {self.files} .pt files into {show(self.dst)}: "
            + ", ".join(f"rank{r} {n} pass(es)" for r, n in sorted(self.ranks.items()))
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"


def parse_tags(filename: str) -> Optional[dict]:
    """The tags of one sglang dump file name, or None if it is not one."""
    if not filename.endswith(".pt"):
        return None
    tags = {}
    for part in filename[:-3].split("___"):
        key, sep, value = part.partition("=")
        if not sep:
            return None
        tags[key] = value
    try:
        tags["step"], tags["rank"], tags["dump_index"] = int(tags["step"]), int(tags["rank"]), int(tags["dump_index"])
    except (KeyError, ValueError):
        return None
    return tags if "name" in tags else None


def split_name(name: str) -> Optional[Tuple[str, str, str]]:
    """(module path, "in"|"out", slot) of a non-intrusive tensor name, or None."""
    if not name.startswith(PREFIX):
        return None
    match = _NAME_RE.match(name[len(PREFIX) :])
    if not match:
        return None
    io = "in" if match.group("io") == "inputs" else "out"
    return match.group("module") or "", io, match.group("slot") or ""


def _load(path: str, result: ImportResult):
    if not os.path.isfile(path):  # a named pipe would block torch.load forever
        result.refused += 1
        if result.refused <= 3:
            result.warnings.append(f"{show(os.path.basename(path))}: not a regular file; skipped")
        return None
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - weights_only refusal, damaged file: skip and count
        result.refused += 1
        if result.refused <= 3:
            result.warnings.append(
                f"{show(os.path.basename(path))}: not loadable with weights_only=True "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); skipped"
            )
        return None
    if not isinstance(data, dict) or "value" not in data:
        result.refused += 1
        return None
    return data


def _seq_rows(positions: List[int], seq_lens: List[int]) -> Optional[List[Tuple[int, int]]]:
    """[first, last+1) rows of each sequence: sequence i ends at the row at position seq_lens[i]-1."""
    spans, row = [], 0
    for length in seq_lens:
        start = row
        while row < len(positions) and positions[row] != length - 1:
            row += 1
        if row >= len(positions):
            return None
        row += 1
        spans.append((start, row))
    return spans


def _tokens(core: dict, rank: int, step: int):
    ids = [int(x) for x in core["input_ids"].reshape(-1).tolist()]
    pos = [int(x) for x in core["positions"].reshape(-1).tolist()]
    seq_lens = [int(x) for x in core["seq_lens"].reshape(-1).tolist()]
    if len(pos) != len(ids):
        raise ValueError(f"{len(ids)} input_ids but {len(pos)} positions")
    spans = _seq_rows(pos, seq_lens)
    if spans is None:
        raise ValueError(f"positions {pos[:8]}... do not end each sequence at seq_lens-1 ({seq_lens[:8]})")
    rids = core.get("rids")
    if isinstance(rids, (list, tuple)) and len(rids) == len(seq_lens):
        names = [str(r) for r in rids]
    elif "req_pool_indices" in core:  # no request ids: the KV slot keys a sequence (reused once it ends)
        names = [f"slot{int(x)}" for x in core["req_pool_indices"].reshape(-1).tolist()]
    else:
        names = [f"r{rank}s{step}q{i}" for i in range(len(seq_lens))]
    seq = [""] * len(ids)
    for name, (start, end) in zip(names, spans):
        seq[start:end] = [name] * (end - start)
    valid = [s != "" for s in seq]
    decode = len(ids) == len(seq_lens)
    mode = "decode" if decode else ("prefill" if all(pos[s] == 0 for s, _ in spans) else "extend")
    seqs = [{"seq": n, "rows": [s, e]} for n, (s, e) in zip(names, spans)]
    return {"ids": ids, "pos": pos, "seq": seq, "valid": valid}, seqs, [e - 1 for _, e in spans], mode


def _tensor_meta(value: torch.Tensor, n_tokens: int, n_seqs: int, mode: str) -> dict:
    meta = {"shape": list(value.shape), "dtype": str(value.dtype)[6:], "token_dims": None, "rows": None}
    if value.dim() >= 1 and value.shape[0] == n_tokens:
        meta.update(token_dims=[0], rows="all")
    elif value.dim() >= 1 and mode != "decode" and value.shape[0] == n_seqs:
        meta.update(token_dims=[0], rows="last")  # e.g. next_token_logits: the last row of each sequence
    else:
        meta["why"] = f"first dim is not the {n_tokens} token rows of the pass"
    return meta


def _convert_pass(entries: List[Tuple[dict, str]], rank: int, step: int, pass_id: int, result: ImportResult):
    """(pass metadata, tensors) of one step, or None (with a warning) when it cannot be keyed."""
    core: Dict[str, object] = {}
    loaded = []
    for tags, path in sorted(entries, key=lambda e: e[0]["dump_index"]):
        name = tags["name"]
        if name in CORE_FIELDS:
            if name not in core:  # positions is dumped again by every attention layer: keep the first
                data = _load(path, result)
                if data is not None:
                    core[name] = data["value"]
            continue
        parsed = split_name(name)
        if parsed is None:
            result.other += 1
            continue
        data = _load(path, result)
        if data is not None:
            loaded.append((tags["dump_index"], parsed, data["value"]))
    missing = [k for k in ("input_ids", "positions", "seq_lens") if not isinstance(core.get(k), torch.Tensor)]
    if missing:
        result.warnings.append(
            f"rank{rank} step {step}: no {'/'.join(missing)} dumped; pass skipped "
            "(dump with DUMPER_NON_INTRUSIVE_MODE=core or all)"
        )
        return None
    try:
        tokens, seqs, last_rows, mode = _tokens(core, rank, step)
    except ValueError as exc:
        result.warnings.append(f"rank{rank} step {step}: cannot lay out token rows ({exc}); pass skipped")
        return None
    n_tokens, n_seqs = len(tokens["ids"]), len(seqs)

    calls: Dict[str, dict] = {}
    order: List[str] = []
    current: Dict[str, str] = {}  # module path -> its open call
    counts: Dict[str, int] = defaultdict(int)
    tensors: Dict[str, torch.Tensor] = {}
    for index, (module, io, slot), value in loaded:
        call = current.get(module)
        state = calls.get(call) if call else None
        # a new call of the module: inputs after its outputs, or a slot seen again
        if (
            state is None
            or (io == "in" and (state["post"] is not None or f"in.{slot}" in state["_slots"]))
            or (io == "out" and f"out.{slot}" in state["_slots"])
        ):
            call = fmt.call_name(module, counts[module])
            counts[module] += 1
            current[module] = call
            state = calls[call] = {
                "call": call,
                "module": module,
                "cls": "?",
                "pre": 2 * index,
                "post": None,
                "tensors": {},
                "values": {},
                "skipped": {},
                "_slots": set(),
            }
            order.append(call)
        state["_slots"].add(f"{io}.{slot}")
        if io == "out":
            state["post"] = 2 * index + 1
        tname = fmt.tensor_name(call, io, slot)
        if isinstance(value, torch.Tensor) and (
            value.layout != torch.strided or str(value.dtype)[6:] not in fmt.STORED_DTYPES
        ):
            state["skipped"][f"{io}.{slot}"] = f"tensor layout={value.layout} dtype={value.dtype}"  # as our dumper does
        elif isinstance(value, torch.Tensor):
            tensors[tname] = value.detach().contiguous()
            state["tensors"][tname] = _tensor_meta(value, n_tokens, n_seqs, mode)
        elif value is None or isinstance(value, (bool, int, float, str)):
            state["values"][f"{io}.{slot}"] = value
        else:
            state["skipped"][f"{io}.{slot}"] = type(value).__name__
    for state in calls.values():
        del state["_slots"]
    meta = {
        "pass": pass_id,
        "step": step,
        "rank": rank,
        "mode": mode,
        "tokens": tokens,
        "seqs": seqs,
        "last_rows": last_rows,
        "token_shape": [n_tokens],
        "calls": [calls[c] for c in order],
        "kept_rows": None,
        "dump_mode": "all",
        "extra": {"source": ENGINE},
    }
    return meta, tensors


def _write_pass(rank_dir: str, meta: dict, tensors: Dict[str, torch.Tensor]) -> dict:
    name = fmt.pass_file_name(meta["pass"])
    tmp = os.path.join(rank_dir, f".{name}.tmp")
    save_file(tensors, tmp, metadata={fmt.PASS_META_KEY: json.dumps(meta)})
    final = os.path.join(rank_dir, name)
    os.replace(tmp, final)
    return {
        "pass": meta["pass"],
        "file": name,
        "bytes": os.path.getsize(final),
        "tensors": len(tensors),
        "mode": meta["mode"],
        "rows": len(meta["tokens"]["ids"]),
        "step": meta["step"],
    }


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.listdir's surrogate escapes of bytes that are not UTF-8
        return False
    return True


def import_sglang(src: str, dst: str, progress=None) -> ImportResult:
    if not os.path.isdir(src):
        what = "not a directory" if os.path.exists(src) else "no such directory"
        raise DumpError(f"{show(src)}: {what}; give the folder of .pt files (<DUMPER_DIR>/<exp_name>)")
    if os.path.lexists(dst):
        raise DumpError(f"{show(dst)}: already exists; give a new folder for the converted dump")
    groups: Dict[Tuple[int, int], List[Tuple[dict, str]]] = defaultdict(list)
    result = ImportResult(dst=dst)
    unnamed = undecodable = 0
    for entry in sorted(os.listdir(src)):
        if not _utf8(entry):  # a tensor name must be UTF-8 in safetensors: skip it, say so below
            undecodable += entry.endswith(".pt")
            continue
        tags = parse_tags(entry)
        if tags is None:
            unnamed += entry.endswith(".pt")
            continue
        groups[(tags["rank"], tags["step"])].append((tags, os.path.join(src, entry)))
    if not groups:
        inner = [
            e
            for e in sorted(os.listdir(src))
            if os.path.isdir(os.path.join(src, e)) and any(parse_tags(f) for f in os.listdir(os.path.join(src, e)))
        ]
        hint = f"; it holds experiments: give one, e.g. {show(os.path.join(src, inner[0]))}" if inner else ""
        raise DumpError(f"{show(src)}: no sglang dump files (step=..___rank=..___dump_index=..___name=...pt){hint}")
    if unnamed:
        result.warnings.append(f"{unnamed} .pt file(s) whose name has no step/rank/dump_index tags ignored")
    if undecodable:
        result.warnings.append(
            f"{undecodable} .pt file(s) whose name is not valid UTF-8 ignored; rename them to import them"
        )

    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    work = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.import-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    run_info = {"tp_size": None, "model": None, "dtype": None}
    try:
        next_pass: Dict[int, int] = defaultdict(int)
        for (rank, step), entries in sorted(groups.items()):
            result.files += len(entries)
            converted = _convert_pass(entries, rank, step, next_pass[rank], result)
            if progress:
                progress(rank, step)
            if converted is None:
                continue
            meta, tensors = converted
            if not tensors:
                result.warnings.append(f"rank{rank} step {step}: no module tensors (core mode dump?); metadata only")
            rank_dir = os.path.join(work, fmt.rank_dir_name(rank))
            os.makedirs(rank_dir, exist_ok=True)
            line = _write_pass(rank_dir, meta, tensors)
            with open(os.path.join(rank_dir, fmt.MANIFEST_FILE), "a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")
            next_pass[rank] += 1
            result.ranks[rank] = next_pass[rank]
            if run_info["dtype"] is None:
                floats = [t for t in tensors.values() if t.is_floating_point()]
                run_info["dtype"] = str(floats[0].dtype)[6:] if floats else None
        if run_info["model"] is None:
            first = next(iter(sorted(groups.items())))[1][0][1]
            data = _load(first, result)
            meta = data.get("meta") if isinstance(data, dict) and isinstance(data.get("meta"), dict) else {}
            parallel = meta.get("sglang_parallel_info") if isinstance(meta.get("sglang_parallel_info"), dict) else {}
            run_info["model"] = meta.get("tokenizer_path")
            run_info["tp_size"] = parallel.get("tp_size", meta.get("world_size"))
        if not result.ranks:
            raise DumpError(f"{show(src)}: no step could be converted ({'; '.join(result.warnings[:3])})")
        if result.refused:
            result.warnings.append(f"{result.refused} file(s) refused by torch.load(weights_only=True) and skipped")
        run = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "engine": ENGINE,
            "model": run_info["model"],
            "dtype": run_info["dtype"],
            "device": None,
            "tp_size": run_info["tp_size"],
            "config": {"non_intrusive_mode": "all", "source": os.path.abspath(src)},
            "versions": {"torch": torch.__version__},
        }
        run = {k: v for k, v in run.items() if v is not None}
        with open(os.path.join(work, fmt.RUN_FILE), "w", encoding="utf-8") as handle:
            json.dump(run, handle, indent=1, sort_keys=True)
        os.rename(work, dst)  # the converted dump appears whole or not at all
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return result
