"""The index of a dump in row fingerprints of dumper/rowprint.py (the "rowprint" kind).

An index holds one kind of fingerprint, and two dumps are compared only in the same kind. The
XXH3 kind (analyzer/index/fingerprint.py) is the fastest to compute on a host from a full dump's bytes;
the rowprint kind is what a dumper computes on the device: a fingerprint dump holds nothing else,
and a full dump may carry it (DUMPER_FINGERPRINTS). So a comparison is made in rowprint when
either dump is a fingerprint dump (the full side's rows are printed here from their bytes, with
the same torch function on the CPU) or when both carry the prints (then nothing is hashed at
all); in XXH3 otherwise (analyzer/index/printkind.py decides).
"""

from __future__ import annotations

import logging
from typing import Dict, List

import numpy as np

from dumpdiff.dumper import format as fmt

from ..dump.dtypes import BY_NAME, DType
from ..dump.layout import usable_layout
from ..dump.load import Dump, PassFile, show
from ..errors import DumpError
from .passtables import pass_tables, stored_tensors
from .rowplan import holds_token_ids, may_hold_token_ids, pass_rows

ROWPRINT_VERSION = 1  # dumper/rowprint.py's VERSION; not imported: that imports torch


def build_many(dumps: List[Dump], progress: bool = True, on_built=None) -> List[dict]:
    """The five tables of each dump, in rowprint fingerprints (indexbuild.build_many's contract)."""
    from .build import _tables_of, index_pass

    built = []
    printed = 0
    for k, dump in enumerate(dumps):
        parts = []
        for rank in dump.ranks.values():
            for ref in rank.passes:
                pf = PassFile(ref)
                parts.append(index_pass(pf, tensor_tables=print_tables))
                printed += not _carried_whole(pf)
        tables = _tables_of(parts)
        if on_built is not None:
            on_built(k, tables)
        built.append(tables)
    if printed:
        logging.getLogger("dumpdiff").info("row fingerprints of %d pass files computed from their bytes", printed)
    return built


def _carried_whole(pf: PassFile) -> bool:
    return fmt.ROWPRINTS_TENSOR in pf.names


def print_tables(pf: PassFile, n_rows: int, valid: np.ndarray, on_bytes=None) -> Dict[str, dict]:
    """The calls, tensors and rows tables of one pass from the prints it carries, or, for stored
    tensors that carry none, from their bytes."""
    meta, path = pf.meta, pf.ref.path
    version = meta.get("rowprint")
    carried = None
    if fmt.ROWPRINTS_TENSOR in pf.names:
        if version != ROWPRINT_VERSION:
            raise DumpError(
                f"{show(path)}: row fingerprints of version {version!r}; this dumpdiff reads version "
                f"{ROWPRINT_VERSION}: analyze with the dumpdiff that wrote the dump"
            )
        carried, _ = pf.bits(fmt.ROWPRINTS_TENSOR)
        if carried.ndim != 2 or carried.shape[0] != 3 or carried.dtype != np.uint64:
            raise DumpError(
                f"{show(path)}: the row fingerprint table has shape {list(carried.shape)}; the file is damaged"
            )
    tensor_metas, stored_names = stored_tensors(pf)
    in_file = [n for n in stored_names if n in pf.names]
    layout = usable_layout(pf, in_file) if in_file else None
    plans = pass_rows(meta, n_rows, valid)
    token_ids = meta["tokens"]["ids"]
    stored_rows = {}
    for name in stored_names:
        tmeta = tensor_metas[name]
        dtype = BY_NAME.get(tmeta.get("dtype"))
        if dtype is None:
            raise DumpError(
                f"{show(path)}: tensor {name!r} has element type {tmeta.get('dtype')!r}; the file is damaged"
            )
        held = name in pf.names
        bits, begin = None, None
        if held and layout is not None:  # the header gives shape and place: bytes are read only if needed
            dtype, shape, begin, _ = layout.get(name)
        elif held:
            bits, dtype = pf.bits(name)
            shape = list(bits.shape)
        else:
            shape = _stored_shape(tmeta, meta)
        plan = plans.plan(path, name, tmeta, shape)
        place = tmeta.get("print")
        if held and bits is None and (place is None or carried is None or may_hold_token_ids(plan, dtype)):
            bits, dtype = pf.bits(name)
        if place is not None and carried is not None:
            stats = _carried_rows(carried, place, plan, name, path)
        elif held:
            stats = _printed_here(plan.rows(bits), dtype)
        else:
            raise DumpError(
                f"{show(path)}: tensor {name!r} has neither bytes nor row fingerprints; the file is damaged"
            )
        fps, amax, nonfinite = stats
        if not held:
            is_ids = _prints_token_ids(plan, dtype, fps, token_ids)
        else:  # bits not read: by its shape it cannot hold the token ids
            is_ids = bits is not None and holds_token_ids(plan, plan.rows(bits), dtype, token_ids)
        columns = {
            "row": plan.kept_rows,
            "fp": fps,
            "rowshape": plan.row_shape_text(dtype.name),
            "amax": amax,
            "nonfinite": nonfinite,
            "srow": plan.srow.astype(np.int32),
            "offset": plan.row_offsets(begin, dtype),
        }
        stored_rows[name] = (columns, plan.why, is_ids)
        if on_bytes and bits is not None:
            on_bytes(bits.nbytes)
    return pass_tables(meta["calls"], tensor_metas, stored_rows)


def _stored_shape(tmeta: dict, meta: dict) -> list:
    """The shape a tensor of a fingerprint dump would be stored in: its rows kept by DUMPER_POSITIONS
    or DUMPER_LAST_ROWS, token dims first, when it was selected; else its own."""
    shape = list(tmeta["shape"])
    if not tmeta.get("selected"):
        return shape
    dims = tmeta.get("token_dims") or []
    return [len(meta.get("kept_rows") or [])] + [s for d, s in enumerate(shape) if d not in dims]


def _carried_rows(carried: np.ndarray, place, plan, name: str, path: str):
    """(fingerprints int64, largest |x| float64, NaN/inf counts int32) of a tensor's kept rows
    from the pass's fingerprint table."""
    rows = plan.view_shape[0] if plan.by_token else 1
    ok = isinstance(place, list) and len(place) == 2 and all(isinstance(v, int) and v >= 0 for v in place)
    if not ok or place[1] != rows or place[0] + place[1] > carried.shape[1]:
        raise DumpError(
            f"{show(path)}: tensor {name!r}'s row fingerprints {place!r} do not fit its {rows} rows or the "
            f"table of {carried.shape[1]}; the file is damaged"
        )
    mine = carried[:, place[0] : place[0] + place[1]][:, plan.srow]
    return mine[0].view(np.int64), mine[1].view(np.float64), mine[2].astype(np.int32)


def _printed_here(rows: np.ndarray, dtype: DType):
    """The rowprint stats of rows held as bits, computed with the dumper's own torch function."""
    from dumpdiff.dumper import rowprint

    from ..dump.torchbits import to_torch

    n = rows.shape[0]
    width = int(np.prod(rows.shape[1:], dtype=np.int64))
    stats = rowprint.row_stats(to_torch(rows, dtype).reshape(n, width)).numpy()
    return stats[0].view(np.int64), stats[1].view(np.float64), stats[2].astype(np.int32)


def _prints_token_ids(plan, dtype: DType, fps: np.ndarray, token_ids) -> bool:
    """Whether a tensor known by its prints alone holds the pass's token ids: its rows print as
    the ids themselves in its element type would."""
    if not may_hold_token_ids(plan, dtype) or not len(fps):
        return False
    import torch

    from dumpdiff.dumper import rowprint

    ids = torch.tensor(np.asarray(token_ids, dtype=np.int64)[plan.kept_rows]).reshape(-1, 1)
    try:
        expected = rowprint.fingerprints(ids.to(getattr(torch, dtype.name))).numpy()
    except (RuntimeError, TypeError):  # a type torch cannot hold these ids in
        return False
    return bool(np.array_equal(expected, fps))
