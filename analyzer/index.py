"""The parquet index of a dump: one row per tensor row-slice with its fingerprint.

Built once per dump by reading every committed pass a single time; later questions ("are these
rows bit-identical?") are answered from the index without touching tensor bytes. Tables, each
a parquet file readable by pandas or duckdb:

    tokens.parquet   rank, pass, row, seq, pos, id, valid, mode, step   (one per token row)
    seqs.parquet     rank, pass, seq, first, end, prefix_ids            (one per sequence per pass)
    calls.parquet    rank, pass, call, module, cls, pre, post, skipped  (one per hooked call)
    tensors.parquet  rank, pass, tensor, call, io, slot, dtype, shape, token_dims, rows, stored,
                     selected, is_ids, why                               (one per captured tensor)
    rows.parquet     rank, pass, tensor, row, fp, rowshape, amax, nonfinite, srow
                     (one per token row of each tensor; row -1 = a tensor without token rows)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
import torch

from dumper import format as fmt

from .errors import DumpError
from .fingerprint import as_signed, fingerprints
from .load import Dump, PassFile, show

INDEX_VERSION = 1
INDEX_DIR = "index"
TABLES = ("tokens", "seqs", "calls", "tensors", "rows")


class Index:
    def __init__(self, dump: Dump, tables: Dict[str, pd.DataFrame], where: str):
        self.dump = dump
        self.where = where
        for name in TABLES:
            setattr(self, name, tables[name])

    def rank(self, rank: int) -> "Index":
        return Index(self.dump, {n: getattr(self, n)[getattr(self, n)["rank"] == rank] for n in TABLES}, self.where)


def index_location(dump: Dump) -> str:
    """Inside the dump when writable; else a per-dump folder in the user's cache."""
    inside = os.path.join(dump.path, INDEX_DIR)
    if os.access(dump.path, os.W_OK):
        return inside
    digest = hashlib.sha256(os.path.abspath(dump.path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~/.cache/dumpdiff/index"), digest)


def _stamp(dump: Dump) -> dict:
    return {"index_version": INDEX_VERSION,
            "ranks": {str(r): [[p.pass_id, p.nbytes] for p in d.passes] for r, d in dump.ranks.items()}}


def load_index(dump: Dump, rebuild: bool = False, progress: bool = True) -> Index:
    where = index_location(dump)
    stamp_path = os.path.join(where, "stamp.json")
    if not rebuild and os.path.exists(stamp_path):
        try:
            with open(stamp_path) as handle:
                fresh = json.load(handle) == _stamp(dump)
            if fresh:
                return Index(dump, {n: pd.read_parquet(os.path.join(where, f"{n}.parquet")) for n in TABLES}, where)
        except (OSError, ValueError):
            pass  # a stale or damaged index is rebuilt below
    tables = build_tables(dump, progress=progress)
    _write_tables(where, tables, _stamp(dump))
    return Index(dump, tables, where)


def _write_tables(where: str, tables: Dict[str, pd.DataFrame], stamp: dict):
    os.makedirs(where, exist_ok=True)
    tag = f".tmp.{os.getpid()}"
    stamp_path = os.path.join(where, "stamp.json")
    if os.path.exists(stamp_path):
        os.unlink(stamp_path)  # readers never pair a new stamp with old tables
    for name, frame in tables.items():
        path = os.path.join(where, f"{name}.parquet")
        frame.to_parquet(path + tag, index=False)
        os.replace(path + tag, path)
    with open(stamp_path + tag, "w") as handle:
        json.dump(stamp, handle)
    os.replace(stamp_path + tag, stamp_path)


def build_tables(dump: Dump, progress: bool = True) -> Dict[str, pd.DataFrame]:
    parts: Dict[str, List[pd.DataFrame]] = {n: [] for n in TABLES}
    refs = [ref for rank in dump.ranks.values() for ref in rank.passes]
    total = sum(ref.nbytes for ref in refs)
    bar = _progress(total, f"indexing {show(dump.label)}", progress)
    for ref in refs:
        for name, frame in index_pass(PassFile(ref)).items():
            parts[name].append(frame)
        bar.update(ref.nbytes)
    bar.close()
    return {n: pd.concat(frames, ignore_index=True) if frames else pd.DataFrame() for n, frames in parts.items()}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=(not enabled) or None, leave=False)


def index_pass(pf: PassFile) -> Dict[str, pd.DataFrame]:
    meta, ref = pf.meta, pf.ref
    tokens = meta["tokens"]
    n_rows = len(tokens["ids"])
    if not all(len(tokens.get(k, ())) == n_rows for k in ("pos", "seq", "valid")):
        raise DumpError(f"{show(ref.path)}: token lists of unequal length in the pass metadata; the file is damaged")
    base = {"rank": ref.rank, "pass": ref.pass_id}
    token_frame = pd.DataFrame({"row": np.arange(n_rows, dtype=np.int32), "seq": tokens["seq"],
                                "pos": np.asarray(tokens["pos"], dtype=np.int64),
                                "id": np.asarray(tokens["ids"], dtype=np.int64),
                                "valid": np.asarray(tokens["valid"], dtype=bool)}).assign(
        mode=meta.get("mode", "unknown"), step=meta.get("step", -1), **base)
    seq_frame = pd.DataFrame([{"seq": s["seq"], "first": s["rows"][0], "end": s["rows"][1],
                               "prefix_ids": json.dumps(s["prefix_ids"]) if "prefix_ids" in s else None}
                              for s in meta.get("seqs", [])], columns=["seq", "first", "end", "prefix_ids"]).assign(**base)
    call_rows, tensor_rows, row_frames = [], [], []
    stored_rows: Dict[str, tuple] = {}  # stored tensor name -> (rows frame, why, is_ids)
    valid = np.asarray(tokens["valid"], dtype=bool)
    tensor_metas = {name: tmeta for call in meta["calls"] for name, tmeta in call["tensors"].items()}
    for call in meta["calls"]:
        call_rows.append({"call": call["call"], "module": call["module"], "cls": call["cls"], "pre": call["pre"],
                          "post": call["post"] if call["post"] is not None else -1,
                          "skipped": json.dumps(call.get("skipped", {})) if call.get("skipped") else None})
        for name, tmeta in call["tensors"].items():
            parsed = fmt.TENSOR_NAME_RE.match(name)
            io, slot = (parsed.group("io"), parsed.group("slot") or "") if parsed else ("?", name)
            stored = tmeta.get("alias") or name
            if stored not in stored_rows:
                if stored not in tensor_metas:
                    raise DumpError(f"{show(ref.path)}: {name!r} is an alias of {stored!r}, which the pass does not hold; "
                                    "the file is damaged")
                stored_rows[stored] = _tensor_rows(pf, stored, tensor_metas[stored], meta, n_rows, valid)
            frame, row_why, is_ids = stored_rows[stored]
            why = tmeta.get("why") or row_why
            tensor_rows.append({"tensor": name, "call": call["call"], "io": io, "slot": slot,
                                "dtype": tmeta["dtype"], "shape": json.dumps(tmeta["shape"]),
                                "token_dims": json.dumps(tmeta.get("token_dims")), "rows": tmeta.get("rows"),
                                "stored": stored, "selected": bool(tensor_metas[stored].get("selected", False)),
                                "is_ids": is_ids,
                                "why": why})
            row_frames.append(frame.assign(tensor=name))
    rows = pd.concat(row_frames, ignore_index=True) if row_frames else pd.DataFrame(
        columns=["row", "fp", "rowshape", "amax", "nonfinite", "srow", "tensor"])
    return {"tokens": token_frame, "seqs": seq_frame,
            "calls": pd.DataFrame(call_rows, columns=["call", "module", "cls", "pre", "post", "skipped"]).assign(**base),
            "tensors": pd.DataFrame(tensor_rows).assign(**base), "rows": rows.assign(**base)}


def token_rows_of(tmeta: dict, meta: dict, n_rows: int) -> Optional[List[int]]:
    """Which token row each stored row of a tensor belongs to; None if it has no token rows."""
    if tmeta.get("token_dims") is None:
        return None
    if tmeta.get("selected"):
        return list(meta.get("kept_rows") or [])
    if tmeta.get("rows") == "last":
        return list(meta.get("last_rows") or [])
    return list(range(n_rows))


def stored_row_view(tensor: torch.Tensor, tmeta: dict) -> torch.Tensor:
    """The stored tensor as [rows, ...]: token dims moved to the front and flattened."""
    if tmeta.get("selected"):
        return tensor
    dims = tmeta["token_dims"]
    moved = tensor.movedim(dims, list(range(len(dims))))
    return moved.reshape((-1,) + tuple(moved.shape[len(dims):]))


def _tensor_rows(pf: PassFile, stored: str, tmeta: dict, meta: dict, n_rows: int, valid: np.ndarray):
    """(rows frame, why it has no token rows or None, whether it holds the pass's token ids)."""
    tensor = pf.tensor(stored)
    if list(tensor.shape) != list(tmeta["shape"]) and not tmeta.get("selected"):
        raise DumpError(f"{show(pf.ref.path)}: tensor {stored!r} has shape {list(tensor.shape)}, metadata says "
                        f"{tmeta['shape']}; the file is damaged")
    token_rows = token_rows_of(tmeta, meta, n_rows)
    why = None
    if token_rows is not None:
        view = stored_row_view(tensor, tmeta)
        if view.shape[0] != len(token_rows):
            token_rows, why = None, f"{view.shape[0]} rows where the pass has {len(token_rows)}"
    if token_rows is None:
        view, token_rows = tensor.reshape((1,) + tuple(tensor.shape)), [-1]
    keep = np.array([r < 0 or bool(valid[r]) for r in token_rows], dtype=bool)
    srow = np.nonzero(keep)[0]
    view = view[torch.from_numpy(srow)] if not keep.all() else view
    kept_rows = np.asarray(token_rows, dtype=np.int32)[srow]
    fps = as_signed(fingerprints(view)) if view.shape[0] else np.zeros(0, np.int64)
    rest = tuple(s for s in view.shape[1:] if s != 1)
    if view.is_floating_point():
        as_float = view.float().reshape(view.shape[0], -1)
        finite = torch.isfinite(as_float)
        amax = torch.where(finite, as_float.abs(), torch.zeros((), dtype=torch.float32)).amax(dim=1) \
            if as_float.shape[1] else torch.zeros(view.shape[0])
        nonfinite = (~finite).sum(dim=1)
        amax, nonfinite = amax.double().numpy(), nonfinite.numpy().astype(np.int32)
    else:
        amax, nonfinite = np.full(view.shape[0], np.nan), np.zeros(view.shape[0], np.int32)
    frame = pd.DataFrame({"row": kept_rows, "fp": fps, "rowshape": f"{str(tensor.dtype)[6:]}{list(rest)}",
                          "amax": amax, "nonfinite": nonfinite, "srow": srow.astype(np.int32)})
    is_ids = bool(
        why is None and token_rows != [-1] and not tensor.is_floating_point() and len(rest) == 0
        and view.numel() == len(kept_rows)
        and np.array_equal(view.reshape(-1).to(torch.int64).numpy(), np.asarray(meta["tokens"]["ids"])[kept_rows]))
    return frame, why, is_ids

