"""What one forward pass has captured so far: its calls, tensors and the row bookkeeping."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .capture import Layout, find_token_dims
from .passinfo import PassInfo
from .passprints import PassPrints


class Call:
    __slots__ = ("name", "names", "module", "cls", "pre", "post", "tensors", "values", "skipped", "obj")

    def __init__(self, names, module, cls, pre, obj=None) -> None:
        # names: (the call's name, its first input's tensor name, its first output's); module:
        # the module's path in this call; obj: the module itself
        self.name, self.names, self.module, self.cls, self.pre = names[0], names, module, cls, pre
        self.obj = obj
        self.post = None
        self.tensors: Dict[str, dict] = {}
        self.values: Dict[str, Any] = {}
        self.skipped: Dict[str, str] = {}

    def to_meta(self) -> dict:
        meta = {
            "call": self.name,
            "module": self.module,
            "cls": self.cls,
            "pre": self.pre,
            "post": self.post,
            "tensors": self.tensors,
        }
        if self.values:
            meta["values"] = self.values
        if self.skipped:
            meta["skipped"] = self.skipped
        return meta


class PassState:
    """Everything captured during one forward pass of the root module."""

    def __init__(
        self,
        info: PassInfo,
        kept_rows: Optional[List[int]],
        exp_dir: str,
        mode: str = "all",
        prints: Optional[PassPrints] = None,
        print_host_tensors: bool = False,
    ) -> None:
        self.info = info
        self.mode = mode  # fixed for the whole pass, whatever a control thread changes
        self.prints = prints  # the row fingerprints computed on the device (mode fingerprint, or carried)
        self.print_host_tensors = print_host_tensors  # also those of CPU tensors (else GPU tensors only)
        self.kept_rows = kept_rows
        self.kept_index = torch.tensor(kept_rows, dtype=torch.long) if kept_rows is not None else None
        self.exp_dir = exp_dir
        self.calls: List[Call] = []
        self.nesting: List[Call] = []  # the calls open now, outermost first
        self.holders: List[tuple] = []  # (module, its name) of the open calls that place a shared module's calls
        self.counts: Dict[str, int] = {}
        self.order = 0
        self.tensors: Dict[str, torch.Tensor] = {}
        self.seen: Dict[tuple, tuple] = {}  # storage key -> (tensor name, weakref), for aliases
        self.seen_objects: Dict[int, tuple] = {}  # id -> (weakref, storage key, alias metadata)
        self.kept_index_by_device: Dict[torch.device, torch.Tensor] = {}
        self.n_seqs = len(info.last_rows)
        self.layouts: Dict[torch.Size, Layout] = {}  # by tensor shape: what a shape alone decides
        self.cuda_used = False
        self.recording = None  # an arena.Layout while the pass is captured into a CUDA graph
        # passplan.py: the plan this pass follows (None: the general hooks, also after leaving
        # it), the index of its next event, the pool its rows are staged in, its new tensors
        # (in the plan's order, and by address), the shared modules' calls not selected; or the
        # trace making a plan
        self.plan = None
        self.plan_at = 0
        self.plan_pool = None
        self.plan_seen: Optional[list] = None
        self.plan_addresses: Optional[dict] = None
        self.plan_unopened: Optional[dict] = None
        self.plan_varying: Optional[dict] = None  # by new tensor index: one whose shape is not the trace's
        self.plan_patches: Optional[dict] = None  # call index -> {tensor name: its metadata this pass}
        self.plan_pending: Optional[list] = None  # varying tensors' rows, staged once their event is followed
        self.plan_describe = None
        self.plan_stage_bytes = 0
        self.plan_key: Optional[tuple] = None
        self.trace = None

    def layout(self, shape, found: Optional[tuple] = None) -> Layout:
        """A tensor shape's Layout in this pass; ``found``: its (token dims, rows, why), when
        known otherwise than from the shape (capture.find_token_dims)."""
        dims, rows, why = found or find_token_dims(shape, self.info.token_shape, self.n_seqs)
        expected = len(self.info.last_rows) if rows == "last" else len(self.info.ids)
        return Layout(shape, dims, rows, why, expected)
