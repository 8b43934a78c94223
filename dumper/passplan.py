"""Passes that repeat an earlier pass's calls, checked call by call instead of worked out again.

Decode steps of one batch shape run the same hooked calls on tensors of the same shapes, pass after
pass, and what the general hooks work out for each tensor (its metadata, whether it is an alias,
where its rows are staged for their prints) comes out the same every time. So a fingerprint
pass of a structure (filter, token layout) is traced as the general hooks handle it and becomes
a plan. A later pass of that structure follows the plan: each hook checks that its
call is the plan's next one and that every argument is what the trace saw (the same module,
argument slots, tensor types, shapes, element types and devices, scalar values and aliases),
copies each new tensor's rows to the place the trace fixed, and does nothing more. The pass's
metadata is the trace's own (the same dicts, never changed after, so the writer sees equal calls
at once); its prints are computed from its own copies when it ends, as in any pass.

A structure is traced the second time it is met (a prefill's, met once, is never planned). A
pass following a plan also keeps each new tensor's address and version, as the general hooks keep
its storage key: a tensor the general hooks would take for an earlier capture (the same storage
and version) is an alias there, so where the trace stored it the pass leaves the plan.

At the first difference the pass leaves its plan: the calls so far, their staged rows and the
captures an alias may name are rebuilt as the general hooks would have made them, and the general
hooks go on from there. The plan is dropped and the structure traced again; one whose passes keep
differing (experts chosen per token) is no longer planned after a few misses (a miss now and then
is forgotten after a long run of followed passes).

A tensor whose shape is not the trace's, all else alike (a padded batch's attention mask, one
column longer each step), is described and staged as the general hooks do: its rows go after the
plan's in the print table, and its call's metadata is copied and patched for the pass.

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
MOST_MISSES = 3  # a structure whose plans missed this often is no longer planned
FORGIVEN_AFTER = 64  # passes in a row following a structure's plan that forget its misses
MOST_KEYS = 1024  # structures whose sightings and misses are counted (then counting starts again)
_PLAIN = capture.PLAIN_TENSORS


class _Value:
    """A scalar argument, kept in the call's values."""

    __slots__ = ("key", "raw", "stored")

    def __init__(self, key, raw, stored):
        self.key, self.raw, self.stored = key, raw, stored

    def follow(self, current, value) -> bool:
        raw = self.raw  # 1 == 1.0 == True and 0.0 == -0.0 and NaN != NaN, but the JSON tells them apart
        if type(value) is not type(raw):
            return False
        return repr(value) == repr(raw) if isinstance(raw, float) else value == raw

    def rebuild(self, current, call: Call, owners: dict) -> None:
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

    def rebuild(self, current, call: Call, owners: dict) -> None:
        call.skipped[self.key] = self.said


class _Alias:
    """A tensor captured earlier in the pass: the very object unchanged, or one with its storage
    key (hooks.Dumper._capture_tensor)."""

    __slots__ = ("name", "meta", "source", "same_object", "type", "per_token", "call_index")

    def __init__(self, name, meta, source, same_object, value, per_token, call_index):
        # source: the index of the new tensor it names among the plan's new tensors
        self.name, self.meta, self.source, self.same_object = name, meta, source, same_object
        self.type, self.per_token, self.call_index = type(value), per_token, call_index

    def follow(self, current, value) -> bool:
        seen = current.plan_seen[self.source]
        if seen is None:  # an inference tensor (no version: never an alias), or not captured
            return False
        step, ref, address, version = seen
        varying = current.plan_varying.get(self.source)
        if self.same_object:
            if not (ref() is value and value._version == version and value.data_ptr() == address):
                return False
            if varying is not None:  # the source's metadata this pass, as the general hooks alias it
                if not varying[1]:  # they know it by its storage key alone: they describe it again
                    return False
                alias = varying[2]
                if alias is None:
                    alias = varying[2] = dict(varying[0], alias=step.name)
                current.plan_patches.setdefault(self.call_index, {})[self.name] = alias
            return True
        if type(value) is not self.type or varying is not None:
            return False
        if self.per_token is not None:
            value = value.unflatten(0, (-1, self.per_token))
        earlier = ref()
        return earlier is not None and capture.storage_key(value) == _key_of(earlier, address, version)

    def rebuild(self, current, call: Call, owners: dict) -> None:
        patched = current.plan_patches.get(self.call_index, {}).get(self.name)
        call.tensors[self.name] = patched if patched is not None else dict(self.meta)


def _key_of(tensor, address, version):
    """capture.storage_key of ``tensor`` as it was captured (at ``address``, ``version``)."""
    return (tensor.device, address, tensor.shape, tensor.stride(), tensor.dtype, version)


class _New:
    """A tensor first captured here: its rows staged for their prints at a place fixed by the trace."""

    __slots__ = (
        "name",
        "meta",
        "index",
        "by_object",
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
        "call_index",
        "cls",
    )

    def __init__(self, name, meta, index, by_object, value, per_token, layout, key, first, n, call):
        # call: (the index of its call in the pass, the call's module class)
        # index: its place among the plan's new tensors; by_object: whether the general hooks
        # also know it by its identity (a later capture of the same object, unchanged, aliases it)
        self.name, self.meta, self.index, self.by_object = name, meta, index, by_object
        self.type, self.shape, self.dtype, self.device = type(value), value.shape, value.dtype, value.device
        self.per_token = per_token
        self.print_shape, self.print_dims = layout.print_shape, layout.print_dims
        self.key, self.first, self.n = key, first, n
        self.nbytes = n * key[2] * key[1].itemsize
        self.address = 0  # of its first row in the pool: set by Plan.start
        self.call_index, self.cls = call

    def follow(self, current, value) -> bool:
        if type(value) is not self.type or value.dtype is not self.dtype or value.device != self.device:
            return False
        if value.shape != self.shape:
            return self._varying(current, value)
        data = value if self.per_token is None else value.unflatten(0, (-1, self.per_token))
        if not (data.is_inference() or _seen(current, self, data)):
            return False  # the general hooks would store an alias here
        # the rows as the general hooks stage them (PassPrints.add)
        rows = data if self.print_shape is not None else rowprint.as_rows(data, self.print_dims)
        if not (current.prints.raw_copies and rawcopy.copy_rows(self.address, rows, self.nbytes)):
            staged = current.plan.pool.tensors[self.key][self.first : self.first + self.n]
            staged.copy_(rows if self.print_shape is None else rows.reshape(self.print_shape))
        return True

    def _varying(self, current, value) -> bool:
        """A tensor whose shape is not the trace's (a padded batch's attention mask grows by one
        column a step): described and staged as the general hooks do, its rows after the
        plan's; its metadata patched into a copy of its call's. Staged once its whole event is
        followed (Plan.pre, Plan.post): a pass that leaves the plan at a later argument stages
        it again the general way."""
        meta, layout, data, _, by_object = current.plan_describe(
            current, self.cls, self.name, value, self.meta["dtype"]
        )
        rows = data if layout.print_shape is not None else rowprint.as_rows(data, layout.print_dims)
        staged = current.prints.staged_bytes + sum(r.numel() * r.element_size() for _, r, _ in current.plan_pending)
        if staged + rows.numel() * rows.element_size() > current.plan_stage_bytes:
            return False  # the general hooks would print rows before the pass's end
        if not (data.is_inference() or _seen(current, self, data)):
            return False
        # [its metadata, whether the general hooks know it by identity, its aliases' metadata]
        current.plan_varying[self.index] = [meta, by_object, None]
        current.plan_patches.setdefault(self.call_index, {})[self.name] = meta
        current.plan_pending.append((meta, rows, layout.print_shape))
        # its place among the plan's rows is printed too: zeros, not an earlier pass's rows
        current.plan.pool.tensors[self.key][self.first : self.first + self.n].zero_()
        return True

    def rebuild(self, current, call: Call, owners: dict) -> None:
        varying = current.plan_varying.get(self.index)
        if varying is not None:  # staged with the pass's own rows, its owner that metadata
            call.tensors[self.name] = varying[0]
            return
        meta = call.tensors[self.name] = dict(self.meta)
        owners.setdefault(self.key, []).append((meta, self.first, self.n))


def _seen(current, step: _New, data) -> bool:
    """Keep a new tensor's address and version, as the general hooks keep its storage key;
    False where they would take it for an earlier capture."""
    address, version = data.data_ptr(), data._version
    seen = (step, weakref.ref(data), address, version)
    same_address = current.plan_addresses.get(address)
    if same_address is not None:
        # the earlier tensors at this address still alive (a freed one's memory is handed on)
        same_address = [earlier for earlier in same_address if earlier[1]() is not None]
        if same_address and _known(same_address, data, version):
            return False
        same_address.append(seen)
    current.plan_addresses[address] = same_address or [seen]
    current.plan_seen[step.index] = seen
    return True


def _known(same_address: list, data, version) -> bool:
    """Whether one of these tensors, captured earlier in the pass and alive, has ``data``'s
    storage key."""
    key = None
    for _, ref, address, earlier_version in same_address:
        earlier = ref()
        if earlier is not None and earlier_version == version:
            key = key or capture.storage_key(data)
            if _key_of(earlier, address, earlier_version) == key:
                return True
    return False


class _Event:
    """A hooked call's start (pre) or end (post), with one step per argument or output leaf."""

    __slots__ = ("post", "module", "path", "call", "call_index", "single", "slots", "steps")

    def __init__(self, post, module, path, call, call_index, leaves):
        self.post, self.module, self.path, self.call, self.call_index = post, module, path, call, call_index
        self.single = leaves is None  # one bare tensor, taken without the general walk
        self.slots = None if leaves is None else tuple(slot for slot, _ in leaves)
        self.steps: list = []


class Trace:
    """A general pass's hooked calls, as the hooks handled each leaf, to become a plan."""

    def __init__(self) -> None:
        self.events: List[_Event] = []
        self.ok = True  # False: something happened that a plan does not follow
        self.rows: Dict[tuple, int] = {}  # staged rows per (device, element type, width), first-staged order
        self._new: Dict[str, _New] = {}  # by tensor name, for the aliases naming them
        self._calls: Dict[int, int] = {}  # id of a call -> its index among the pass's calls

    def event(self, post: bool, module, path, call: Call, leaves=None) -> None:
        index = self._calls[id(call)] if post else self._calls.setdefault(id(call), len(self._calls))
        self.events.append(_Event(post, module, path, call, index, leaves))

    def value(self, key: str, raw, stored) -> None:
        self.events[-1].steps.append(_Value(key, raw, stored))

    def other(self, key: str, value, said: str, what=None) -> None:
        self.events[-1].steps.append(_Other(key, value, said, what))

    def alias(self, name: str, meta: dict, value, same_object: bool, per_token) -> None:
        source = self._new.get(meta["alias"])
        if source is None:
            self.ok = False
            return
        event = self.events[-1]
        event.steps.append(_Alias(name, meta, source.index, same_object, value, per_token, event.call_index))

    def new(self, name: str, meta: dict, value, per_token, layout, staged, by_object: bool) -> None:
        """``staged``: (the rows' (device, element type, width), their count) from PassPrints.add."""
        if staged is None:  # not staged: only mode fingerprint is planned, where every tensor is
            self.ok = False
            return
        key, n = staged
        first = self.rows.get(key, 0)
        self.rows[key] = first + n
        event = self.events[-1]
        call = (event.call_index, event.call.cls)
        step = _New(name, meta, len(self._new), by_object, value, per_token, layout, key, first, n, call)
        self._new[name] = step
        event.steps.append(step)

    @property
    def new_count(self) -> int:
        return len(self._new)


class Plan:
    """A traced pass's calls, followed by later passes of its structure."""

    def __init__(self, trace: Trace, calls_meta: list, pool: "_Pool") -> None:
        self.events = trace.events
        self.count = len(self.events)
        self.calls_meta = calls_meta  # the traced pass's, as written: never changed after
        self.rows = dict(trace.rows)
        self.new_count = trace.new_count
        self.devices = {key[0] for key in self.rows if key[0].type == "cuda"}
        self.pool = pool
        self._new = [step for event in self.events for step in event.steps if type(step) is _New]
        self._generation = -1
        for key, rows in self.rows.items():
            pool.ensure(key, rows)

    def start(self, current, describe) -> None:
        """Make ``current`` (a new pass) follow this plan; ``describe``: the general hooks'
        description of a tensor (hooks.Dumper._describe), for a tensor whose shape varies."""
        pool = self.pool
        if self._generation != pool.generation:  # a pool tensor was replaced: new addresses
            for step in self._new:
                device, dtype, width = step.key
                step.address = pool.tensors[step.key].data_ptr() + step.first * width * dtype.itemsize
            self._generation = pool.generation
        pool.wait(self.devices)
        current.plan, current.plan_at, current.plan_pool, current.plan_describe = self, 0, pool, describe
        current.plan_seen, current.plan_addresses, current.plan_unopened = [None] * self.new_count, {}, {}
        current.plan_varying, current.plan_patches, current.plan_pending = {}, {}, []
        # rows staged by the pass itself (of tensors whose shape varies) stay until its end: the
        # plan's rows come first in its print table
        current.plan_stage_bytes, current.prints.stage_bytes = current.prints.stage_bytes, 1 << 62

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
        if current.plan_pending:
            _stage_pending(current)
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
        if current.plan_pending:
            _stage_pending(current)
        return True

    def next_is_post_of(self, current, module) -> bool:
        at = current.plan_at
        return at < self.count and self.events[at].post and self.events[at].module is module

    def finish(self, current) -> None:
        """The pass followed the whole plan: its prints' blocks are the pool's rows it filled."""
        current.prints.take_rows({key: (self.pool.tensors[key], rows) for key, rows in self.rows.items()})

    def calls_meta_of(self, current) -> list:
        """The pass's calls' metadata: the trace's, copied where a tensor's varied."""
        if not current.plan_patches:
            return self.calls_meta
        calls = list(self.calls_meta)
        for index, tensors in current.plan_patches.items():
            call = calls[index] = dict(calls[index])
            call["tensors"] = dict(call["tensors"], **tensors)
        return calls

    def leave(self, current) -> None:
        """The state the general hooks would have made of the events followed so far: the calls,
        the staged rows and their owners, and the captures a later alias may name (those of a
        partly followed event are captured again)."""
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
                step.rebuild(current, call, owners)
                if type(step) is _New:
                    _known_again(current, current.plan_seen[step.index])
        current.calls, current.nesting, current.counts, current.order = calls, nesting, counts, current.plan_at
        current.prints.take_rows(
            {key: (self.pool.tensors[key], max(first + n for _, first, n in rows)) for key, rows in owners.items()},
            owners,
        )
        current.prints.stage_bytes = current.plan_stage_bytes
        current.plan_pending.clear()  # the event not followed: the general hooks capture it again
        current.plan = None


def _known_again(current, seen) -> None:
    """A new tensor followed under the plan, registered as the general hooks register it."""
    if seen is None:  # an inference tensor: the general hooks keep no key for it
        return
    step, ref, address, version = seen
    tensor = ref()
    if tensor is None:  # freed: nothing can alias it any more
        return
    key = _key_of(tensor, address, version)
    current.seen[key] = (step.name, ref)
    varying = current.plan_varying.get(step.index)
    meta, by_object = (step.meta, step.by_object) if varying is None else varying[:2]
    if by_object:  # the metadata as it was at capture, before its print range was set
        meta = {field: value for field, value in meta.items() if field != "print"}
        current.seen_objects[id(tensor)] = (ref, key, dict(meta, alias=step.name))


def _stage_pending(current) -> None:
    """Stage the rows of the varying tensors of the event just followed."""
    for meta, rows, shape in current.plan_pending:
        current.prints.add(meta, rows, shape)
    current.plan_pending.clear()


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
        self._read_by: Dict[torch.device, object] = {}  # per GPU: an event after the last prints that read the pool

    def ensure(self, key: tuple, rows: int) -> None:
        have = self.tensors.get(key)
        if have is None or have.shape[0] < rows:
            device, dtype, width = key
            with torch.inference_mode(False):  # written by passes in and out of inference mode
                self.tensors[key] = torch.empty((rows, width), dtype=dtype, device=device)
            self.generation += 1

    def wait(self, devices) -> None:
        """Order a pass's copies into the pool after the last pass's print kernels, whatever
        stream each ran on."""
        for device in devices:
            event = self._read_by.get(device)
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)

    def read(self) -> None:
        """A pass's print kernels reading the pool have been queued on its GPUs' current streams."""
        for device in {key[0] for key in self.tensors if key[0].type == "cuda"}:
            event = self._read_by[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))


class Plans:
    """One dumper's plans, by structure key, the most recently used kept."""

    def __init__(self) -> None:
        self._plans: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._sightings: Dict[tuple, int] = {}
        self._misses: Dict[tuple, int] = {}
        self._streaks: Dict[tuple, int] = {}  # passes in a row that followed the structure's plan
        self.pool = _Pool()
        self.followed = 0  # passes that followed a plan to their end
        self.left = 0  # passes that left their plan

    def clear(self) -> None:
        """Forget every plan and free the pool (dumping stopped, or its hooks changed)."""
        if self._plans or self._sightings or self.pool.tensors:
            self._plans.clear()
            self._sightings.clear()
            self._misses.clear()
            self._streaks.clear()
            self.pool = _Pool()

    def find(self, key: tuple) -> Optional[Plan]:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def tracing(self, key: tuple) -> bool:
        """Whether a pass of this structure, without a plan, is traced to make one: from the
        second time it is met, while its plans have not missed too often."""
        if not PLANS:
            return False
        if len(self._sightings) >= MOST_KEYS:
            self._sightings.clear()
            self._misses.clear()
            self._streaks.clear()
        met = self._sightings[key] = self._sightings.get(key, 0) + 1
        return met >= 2 and self._misses.get(key, 0) < MOST_MISSES

    def add(self, key: tuple, trace: Trace, calls_meta: list) -> None:
        try:
            self._plans[key] = Plan(trace, calls_meta, self.pool)
        except Exception:  # noqa: BLE001 - no memory for the pool: the general hooks go on
            self._misses[key] = MOST_MISSES
            return
        while len(self._plans) > MOST_PLANS:
            self._plans.popitem(last=False)

    def followed_to_the_end(self, key: tuple) -> None:
        self.followed += 1
        streak = self._streaks[key] = self._streaks.get(key, 0) + 1
        if streak >= FORGIVEN_AFTER:
            self._misses.pop(key, None)

    def missed(self, key: tuple) -> None:
        self.left += 1
        self._plans.pop(key, None)
        self._streaks.pop(key, None)
        self._misses[key] = self._misses.get(key, 0) + 1
