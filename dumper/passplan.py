"""Passes that repeat an earlier pass's calls, checked call by call instead of worked out again.

Decode steps of one batch shape run the same hooked calls on tensors of the same shapes, pass after
pass, and what the general hooks work out for each tensor (its metadata, whether it is an alias,
where its rows are staged for their prints) comes out the same every time. So the first
fingerprint pass of a structure (filter, token layout) is traced as the general hooks handle it
and becomes a plan. A later pass of that structure follows the plan: each hook checks that its
call is the plan's next one and that every argument is what the trace saw (the same module,
argument slots, tensor types, shapes, element types and devices, scalar values and aliases),
copies each new tensor's rows to the place the trace fixed, and does nothing more. The pass's
metadata is the trace's own (the same dicts, never changed after, so the writer sees equal calls
at once); its prints are computed from its own copies when it ends, as in any pass.

At the first difference the pass leaves its plan: the calls so far are rebuilt as the general
hooks would have recorded them, with their staged rows, and the general hooks go on from there.
The plan is dropped and the next pass of that structure is traced again; a structure that keeps
changing (experts chosen per token) stops being planned after a few misses. A tensor staged under
the plan is not known to the general hooks as an earlier capture, so a later capture of it is
stored again instead of as an alias: its rows print the same.

Every plan stages into one pool of rows per (device, element type, row width), as large as the
largest plan needs: a plan's copies go to fixed addresses, and one pass runs at a time.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from . import capture, rawcopy, rowprint
from .passstate import Call

PLANS = True  # False: every pass takes the general hooks (tests and benchmarks compare the two)
MOST_PLANS = 32  # structures planned at once (one per batch shape seen lately)
MOST_MISSES = 3  # a structure whose plan missed this often is no longer planned
_PLAIN = capture.PLAIN_TENSORS


class _Value:
    """A scalar argument, kept in the call's values."""

    __slots__ = ("key", "raw", "stored")

    def __init__(self, key, raw, stored):
        self.key, self.raw, self.stored = key, raw, stored

    def follow(self, current, value) -> bool:
        raw = self.raw  # 1 == 1.0 == True and 0.0 == -0.0, but their JSON differs
        return type(value) is type(raw) and value == raw and (type(raw) is not float or repr(value) == repr(raw))

    def rebuild(self, call: Call, owners: dict) -> None:
        call.values[self.key] = self.stored


class _Other:
    """An argument neither tensor nor scalar, or a tensor the dump cannot hold: named as skipped."""

    __slots__ = ("key", "type", "what", "said")

    def __init__(self, key, value, said, what=None):
        # what: a plain tensor's (element type, layout, device), which decided that it is skipped
        self.key, self.type, self.said, self.what = key, type(value), said, what

    def follow(self, current, value) -> bool:
        if type(value) is not self.type:
            return False
        return self.what is None or (value.dtype, value.layout, value.device) == self.what

    def rebuild(self, call: Call, owners: dict) -> None:
        call.skipped[self.key] = self.said


class _Alias:
    """A tensor captured earlier in the pass: the very object unchanged, or one with its storage
    key (hooks.Dumper._capture_tensor)."""

    __slots__ = ("name", "meta", "source", "same_object", "type", "per_token")

    def __init__(self, name, meta, source, same_object, value, per_token):
        self.name, self.meta, self.source, self.same_object = name, meta, source, same_object
        self.type, self.per_token = type(value), per_token

    def follow(self, current, value) -> bool:
        kept = current.plan_kept[self.source]
        if kept is None or kept[1] is None:
            return False
        ref, key = kept
        if self.same_object:
            return ref() is value and capture.storage_key(value) == key
        if type(value) is not self.type or ref() is None:
            return False
        if self.per_token is not None:
            if value.dim() == 0 or value.shape[0] % self.per_token:
                return False
            value = value.unflatten(0, (-1, self.per_token))
        return capture.storage_key(value) == key

    def rebuild(self, call: Call, owners: dict) -> None:
        call.tensors[self.name] = dict(self.meta)


class _New:
    """A tensor first captured here: its rows staged for their prints at a place fixed by the trace."""

    __slots__ = (
        "name",
        "meta",
        "type",
        "shape",
        "dtype",
        "device",
        "per_token",
        "print_shape",
        "print_dims",
        "key",
        "first",
        "n",
        "nbytes",
        "address",
        "rows",
        "keep",
    )

    def __init__(self, name, meta, value, per_token, layout, key, first, n):
        self.name, self.meta, self.per_token = name, meta, per_token
        self.type, self.shape, self.dtype, self.device = type(value), value.shape, value.dtype, value.device
        self.print_shape, self.print_dims = layout.print_shape, layout.print_dims
        self.key, self.first, self.n = key, first, n
        self.nbytes = n * key[2] * key[1].itemsize
        self.address, self.rows = 0, None  # in the pool: set by Plan.prepare
        self.keep: Optional[int] = None  # the slot keeping it for a later alias's check

    def follow(self, current, value) -> bool:
        if (
            type(value) is not self.type
            or value.shape != self.shape
            or value.dtype is not self.dtype
            or value.device != self.device
        ):
            return False
        data = value if self.per_token is None else value.unflatten(0, (-1, self.per_token))
        if self.keep is not None:
            current.plan_kept[self.keep] = (weakref.ref(data), capture.storage_key(data))
        # the rows as the general hooks stage them (PassPrints.add)
        rows = data if self.print_shape is not None else rowprint.as_rows(data, self.print_dims)
        if not (current.prints.raw_copies and rawcopy.copy_rows(self.address, rows, self.nbytes)):
            self.rows.copy_(rows if self.print_shape is None else rows.reshape(self.print_shape))
        return True

    def rebuild(self, call: Call, owners: dict) -> None:
        meta = call.tensors[self.name] = dict(self.meta)
        owners.setdefault(self.key, []).append((meta, self.first, self.n))


class _Event:
    """A hooked call's start (pre) or end (post), with one step per argument or output leaf."""

    __slots__ = ("post", "module", "path", "call", "single", "slots", "steps")

    def __init__(self, post, module, path, call, leaves):
        self.post, self.module, self.path, self.call = post, module, path, call
        self.single = leaves is None  # one bare tensor, taken without the general walk
        self.slots = None if leaves is None else tuple(slot for slot, _ in leaves)
        self.steps: list = []


class Trace:
    """A general pass's hooked calls, as the hooks handled each leaf, to become a plan."""

    def __init__(self) -> None:
        self.events: List[_Event] = []
        self.ok = True  # False: something happened that a plan does not follow
        self.rows: Dict[tuple, int] = {}  # staged rows per (device, element type, width), first-staged order
        self.kept = 0
        self._new: Dict[str, _New] = {}  # by tensor name, for the aliases naming them

    def event(self, post: bool, module, path, call: Call, leaves=None) -> None:
        self.events.append(_Event(post, module, path, call, leaves))

    def value(self, key: str, raw, stored) -> None:
        self.events[-1].steps.append(_Value(key, raw, stored))

    def other(self, key: str, value, said: str, what=None) -> None:
        self.events[-1].steps.append(_Other(key, value, said, what))

    def alias(self, name: str, meta: dict, value, same_object: bool, per_token) -> None:
        source = self._new.get(meta["alias"])
        if source is None:
            self.ok = False
            return
        if source.keep is None:
            source.keep, self.kept = self.kept, self.kept + 1
        self.events[-1].steps.append(_Alias(name, meta, source.keep, same_object, value, per_token))

    def new(self, name: str, meta: dict, value, per_token, layout, staged) -> None:
        """``staged``: (the rows' (device, element type, width), their count) from PassPrints.add."""
        if staged is None:  # not staged: only mode fingerprint is planned, where every tensor is
            self.ok = False
            return
        key, n = staged
        first = self.rows.get(key, 0)
        self.rows[key] = first + n
        step = self._new[name] = _New(name, meta, value, per_token, layout, key, first, n)
        self.events[-1].steps.append(step)


class Plan:
    """A traced pass's calls, followed by later passes of its structure."""

    def __init__(self, trace: Trace, calls_meta: list, pool: "_Pool") -> None:
        self.events = trace.events
        self.count = len(self.events)
        self.calls_meta = calls_meta  # the traced pass's, as written: never changed after
        self.rows = dict(trace.rows)
        self.kept = trace.kept
        self.on_cuda = any(key[0].type == "cuda" for key in self.rows)
        self.pool = pool
        self._new = [step for event in self.events for step in event.steps if type(step) is _New]
        self._generation = -1
        for key, rows in self.rows.items():
            pool.ensure(key, rows)

    def start(self, current) -> None:
        """Make ``current`` (a new pass) follow this plan."""
        pool = self.pool
        if self._generation != pool.generation:  # a pool tensor was replaced: new addresses
            for step in self._new:
                rows = pool.tensors[step.key][step.first : step.first + step.n]
                step.rows, step.address = rows, rows.data_ptr()
            self._generation = pool.generation
        if self.on_cuda and pool.read_by is not None:
            # the last pass's print kernels read the pool on the stream current then
            torch.cuda.current_stream().wait_event(pool.read_by)
        current.plan, current.plan_at, current.plan_kept = self, 0, [None] * self.kept

    def pre(self, current, module, path, args, kwargs) -> bool:
        """Follow the plan's next event, the start of a call of ``module`` (``path``: its name, for
        a shared module); False, where it differs, with ``current`` still at that event."""
        at = current.plan_at
        if at >= self.count:
            return False
        event = self.events[at]
        if event.module is not module or event.post or (path is not None and path != event.path):
            return False
        try:
            if event.single:
                if kwargs or len(args) != 1 or not event.steps[0].follow(current, args[0]):
                    return False
            elif not _follow(current, event, capture.call_inputs(args, kwargs)):
                return False
        except Exception:  # noqa: BLE001 - whatever a check trips on (a sparse tensor), the general hooks handle
            return False
        current.plan_at = at + 1
        return True

    def post(self, current, module, output) -> bool:
        """Follow the plan's next event, the end of a call of ``module``."""
        at = current.plan_at
        if at >= self.count:
            return False
        event = self.events[at]
        if event.module is not module or not event.post:
            return False
        try:
            if type(output) in _PLAIN:
                if not (event.single and event.steps[0].follow(current, output)):
                    return False
            elif event.single or not _follow(current, event, capture.call_outputs(output)):
                return False
        except Exception:  # noqa: BLE001 - as in pre
            return False
        current.plan_at = at + 1
        return True

    def next_is_post_of(self, current, module) -> bool:
        at = current.plan_at
        return at < self.count and self.events[at].post and self.events[at].module is module

    def finish(self, current) -> None:
        """The pass followed the whole plan: its prints' blocks are the pool's rows it filled."""
        current.prints.take_rows({key: (self.pool.tensors[key], rows) for key, rows in self.rows.items()})

    def leave(self, current) -> None:
        """The state the general hooks would have made of the events followed so far."""
        made: Dict[int, Call] = {}
        calls, nesting, counts, owners = [], [], {}, {}
        for event in self.events[: current.plan_at]:
            template = event.call
            if event.post:
                call = made[id(template)]
                call.post = template.post
                nesting.remove(call)
            else:
                call = made[id(template)] = Call(
                    template.names, template.module, template.cls, template.pre, template.obj
                )
                calls.append(call)
                nesting.append(call)
                counts[template.module] = counts.get(template.module, 0) + 1
            for step in event.steps:
                step.rebuild(call, owners)
        current.calls, current.nesting, current.counts, current.order = calls, nesting, counts, current.plan_at
        current.prints.take_rows(
            {key: (self.pool.tensors[key], max(first + n for _, first, n in rows)) for key, rows in owners.items()},
            owners,
        )
        current.plan = None


def _follow(current, event: _Event, leaves: list) -> bool:
    steps = event.steps
    if event.single or len(leaves) != len(steps):
        return False
    for (slot, value), step, expected in zip(leaves, steps, event.slots):
        if slot != expected or not step.follow(current, value):
            return False
    return True


class _Pool:
    """The rows plans stage into: one tensor per (device, element type, width), grown to the
    largest plan's rows."""

    def __init__(self) -> None:
        self.tensors: Dict[tuple, torch.Tensor] = {}
        self.generation = 0
        self.read_by = None  # a CUDA event recorded after the last pass's print kernels were queued

    def ensure(self, key: tuple, rows: int) -> None:
        have = self.tensors.get(key)
        if have is None or have.shape[0] < rows:
            device, dtype, width = key
            self.tensors[key] = torch.empty((rows, width), dtype=dtype, device=device)
            self.generation += 1


class Plans:
    """One dumper's plans, by structure key, the most recently used kept."""

    def __init__(self) -> None:
        self._plans: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._misses: Dict[tuple, int] = {}
        self.pool = _Pool()
        self.followed = 0  # passes that followed a plan to their end
        self.left = 0  # passes that left their plan

    def clear(self) -> None:
        """Forget every plan and free the pool (dumping stopped, or its hooks changed)."""
        if self._plans or self._misses or self.pool.tensors:
            self._plans.clear()
            self._misses.clear()
            self.pool = _Pool()

    def find(self, key: tuple) -> Optional[Plan]:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def tracing(self, key: tuple) -> bool:
        """Whether a pass of this structure, without a plan, is traced to make one."""
        return PLANS and self._misses.get(key, 0) < MOST_MISSES

    def add(self, key: tuple, trace: Trace, calls_meta: list) -> None:
        self._plans[key] = Plan(trace, calls_meta, self.pool)
        while len(self._plans) > MOST_PLANS:
            self._plans.popitem(last=False)

    def missed(self, key: tuple) -> None:
        self.left += 1
        self._plans.pop(key, None)
        self._misses[key] = self._misses.get(key, 0) + 1
