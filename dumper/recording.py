"""One forward pass recorded into a CUDA graph, and the pass file each replay of it becomes.

At capture time the hooks run as in an eager pass (the same calls, names, token dims, aliases),
but each selected tensor is copied into a static slot (arena.Layout) instead of to the host, and
the pass's token rows are not known yet: the graph's inputs hold no real tokens then. After a
replay, the replay's own pass metadata (read from its real inputs) and its real batch size turn
the slots into a pass like an eager one: the rows of padding (a batch padded up to the captured
size) are trimmed off every tensor, its shape says the real batch, DUMPER_POSITIONS and
DUMPER_LAST_ROWS select rows as they do eagerly, and the pass metadata's ``graph`` entry says how
many rows of padding were trimmed. Plain tensors on any device: nothing here needs CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import capture
from . import format as fmt
from .arena import Layout
from .passinfo import PassInfo


class ReplayMismatch(ValueError):
    """A replay's pass metadata or batch does not fit the graph it replays (one line)."""


@dataclasses.dataclass
class Recording:
    token_shape: List[int]  # of the captured forward: the graph's (padded) batch
    mode: str  # DUMPER_NON_INTRUSIVE_MODE at capture: what the graph's copies hold
    filter: str
    layout: Layout
    calls: List[dict] = dataclasses.field(default_factory=list)  # call metadata, as an eager pass's
    args: tuple = ()  # the captured forward's arguments: a graph's static inputs, read at each replay
    kwargs: dict = dataclasses.field(default_factory=dict)
    replays: int = 0
    pending: Optional[PassInfo] = None  # read before the replay (before_replay)
    # (batch, kept rows) -> _ReplayPlan
    _plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def replay_pass(
        self, info: PassInfo, batch_rows: Optional[int], kept_rows: Callable[[PassInfo], Optional[List[int]]]
    ) -> Tuple[PassInfo, List[dict], Optional[List[int]], Dict[str, torch.Tensor], Callable, dict]:
        """What one replay writes: (the pass's info with padding rows trimmed, its calls' metadata,
        the kept rows, the slots' host views (their bytes counted for the writer's queue), the
        function the writer runs once the host copy is complete (trim, select), the ``graph``
        entry of the pass metadata)."""
        captured = self.token_shape[0]
        info = trim_info(info, self.token_shape, batch_rows)
        batch = info.token_shape[0]
        kept = kept_rows(info)
        # Replays of one batch size and row selection write the same metadata: worked out once
        # (decode steps replay one graph thousands of times; at 16 layers the metadata took a
        # millisecond per replay), shared by their passes and never changed after.
        key = (batch, None if kept is None else tuple(kept))
        plan = self._plans.pop(key, None) or _ReplayPlan(self, batch, kept)
        self._plans[key] = plan  # the most recent last
        while len(self._plans) > PLANS_KEPT:
            del self._plans[next(iter(self._plans))]
        views = self.layout.host_copy()
        trimmed = {name: (views[name][:keep] if views[name].dim() else views[name]) for name, keep in plan.keep.items()}
        if fmt.ROWPRINTS_TENSOR in views and plan.table_index is not None:
            trimmed[fmt.ROWPRINTS_TENSOR] = views[fmt.ROWPRINTS_TENSOR][:, : len(plan.table_index)]

        def prepare(host: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            """Run by the writer once the copy is complete: rows selected as an eager pass's
            (the other tensors are written from the host copy as they lie)."""
            out = {}
            for name, tensor in host.items():
                if name == fmt.ROWPRINTS_TENSOR:
                    out[name] = views[name].index_select(1, plan.table_index)
                elif plan.selects.get(name) is not None:
                    out[name] = capture.select_rows(tensor, plan.dims_of[name], plan.selects[name])
                else:
                    out[name] = tensor
            return out

        self.replays += 1
        graph = {
            "captured_token_shape": list(self.token_shape),
            "batch_rows": batch,
            "padding_rows_trimmed": captured - batch,
            "replay": self.replays,
        }
        return info, plan.calls, kept, trimmed, prepare, graph


PLANS_KEPT = 8  # replay plans kept per recording: batch sizes and selections seen lately


class _ReplayPlan:
    """What every replay of one recording with one batch size and row selection writes alike:
    its calls' metadata trimmed to the batch, each stored tensor's kept first-dim rows and
    selected rows, and the fingerprint table's columns."""

    def __init__(self, recording: Recording, batch: int, kept: Optional[List[int]]) -> None:
        captured = recording.token_shape[0]
        # each tensor's metadata is changed by replacing its values (tuples): a copy of the dicts will do
        self.calls = [dict(call, tensors={n: dict(m) for n, m in call["tensors"].items()}) for call in recording.calls]
        self.keep: Dict[str, int] = {}  # stored tensor -> first-dim rows kept
        self.selects: Dict[str, Optional[torch.Tensor]] = {}  # stored tensor -> rows selected
        columns: List[torch.Tensor] = []  # the capture table's columns of each print, in order
        kept_index = torch.tensor(kept, dtype=torch.long) if kept is not None else None
        stored = {slot[0] for slot in recording.layout.slots}  # aliases have no slot of their own
        printed = 0
        for call in self.calls:
            for name, meta in call["tensors"].items():
                dims, rows = meta["token_dims"], meta["rows"]
                keep_first = meta["shape"][0] if meta["shape"] else 0
                select = None
                captured_rows = _token_rows(meta) if dims is not None else None
                if dims is not None:
                    factor = meta["shape"][0] // captured
                    keep_first = batch * factor
                    meta["shape"] = (keep_first, *meta["shape"][1:])
                    if "held_as" in meta:
                        held = meta["held_as"]
                        meta["held_as"] = (held[0] // captured * batch, *held[1:])
                    if kept_index is not None and "alias" not in meta:
                        meta["selected"] = rows == "all"
                        select = kept_index if rows == "all" else None
                if name in stored:
                    self.keep[name], self.selects[name] = keep_first, select
                if "print" in meta:
                    first, count = meta["print"]
                    if dims is not None and count == captured_rows:
                        count = count // captured * batch
                        index = torch.arange(first, first + count)
                        if select is not None:
                            index = index[select]
                    else:
                        index = torch.arange(first, first + count)
                    meta["print"] = (printed, len(index))
                    printed += len(index)
                    columns.append(index)
        self.table_index = torch.cat(columns) if columns else None
        self.dims_of = {name: meta["token_dims"] for call in self.calls for name, meta in call["tensors"].items()}


def _token_rows(meta: dict) -> int:
    """Token rows a tensor with token dims holds: its token dims' sizes multiplied."""
    count = 1
    for dim in meta["token_dims"]:
        count *= meta["shape"][dim]
    return count


def trim_info(info: PassInfo, captured: List[int], batch_rows: Optional[int]) -> PassInfo:
    """The replay's pass metadata for its real batch: an engine that describes the real batch
    keeps it; one whose metadata is read from the graph's padded static inputs (HF) loses its
    padding rows (those of batch entries ``batch_rows`` and later)."""
    shape = list(info.token_shape)
    if shape[1:] != list(captured[1:]) or not shape or shape[0] > captured[0]:
        raise ReplayMismatch(
            f"the replay's token shape {shape} does not fit the graph captured at token shape {list(captured)}"
        )
    batch = shape[0] if batch_rows is None else batch_rows
    if not 0 <= batch <= shape[0]:
        raise ReplayMismatch(f"batch_rows={batch_rows} is not within the replay's {shape[0]} batch rows")
    if batch == shape[0]:
        return info
    per_entry = 1
    for size in shape[1:]:
        per_entry *= size
    rows = batch * per_entry
    keys = set(info.seq[:rows])
    return dataclasses.replace(
        info,
        token_shape=[batch] + shape[1:],
        ids=info.ids[:rows],
        pos=info.pos[:rows],
        seq=info.seq[:rows],
        valid=info.valid[:rows],
        last_rows=[row for row in info.last_rows if row < rows],
        prefix_ids={k: v for k, v in info.prefix_ids.items() if k in keys},
        history={k: v for k, v in info.history.items() if k in keys},
    )
