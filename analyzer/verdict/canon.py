"""One rank of a dump, its tensors renamed by the mapping rules (mapping.py) to the names the
other run gives them: per pass, each name's source tensor (and which part of it, for a fused
tensor cut in parts), its element type and row width; per renamed call, its class and where it
completes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Callable, Dict, List, Optional, Tuple

from ..index.table import Index
from .mapping import Rule


@dataclasses.dataclass(frozen=True)
class Piece:
    tensor: str  # the tensor as the dump names it
    part: int  # which part of its last dim (-1: the whole tensor)
    parts: int  # how many parts it is cut in
    sizes: Optional[Tuple[int, ...]]  # the parts' widths on one rank, when a rule gives them
    dtype: str
    width: int  # elements per token row of the whole tensor
    call: str  # the call that holds it, as the dump names it
    rule: str  # why it carries this name ("" : its own name)


@dataclasses.dataclass
class CallInfo:
    module: str
    cls: str
    post: int  # completion order of its source call in the first pass that holds it
    source: str  # the source call's name


@dataclasses.dataclass
class Mapped:
    pieces: Dict[str, Piece]  # renamed tensor -> its source (the first tensor, in table order, that bears the name)
    calls: Dict[str, CallInfo]  # renamed call (module#k) -> info
    leaves: set  # renamed calls whose source module holds no dumped module
    ignored: set  # source calls every tensor of which a rule left out
    rules_used: List[str]


def call_of(name: str) -> str:
    """'model.layers.0.mlp#0.out.0' -> 'model.layers.0.mlp#0'."""
    return name.split(".out.", 1)[0].split(".in.", 1)[0] if "#" in name else name


def io_of(name: str) -> str:
    rest = name[len(call_of(name)) :]
    return "in" if rest.startswith(".in.") else "out"


def module_of(call: str) -> str:
    module = call.rsplit("#", 1)[0]
    return "" if module == "<root>" else module


_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")  # the dumper's layer_id= filter key reads this


def dumped_by(setting) -> Callable[[str], bool]:
    """Whether a run dumped with this DUMPER_FILTER (run.json's config) hooked a module of this
    path: 'X' and 'name=X' search the path, 'layer_id=N' matches its layer number. A 'cls=' filter
    names classes, which differ between runs: every module may have been left out."""
    text = setting if isinstance(setting, str) else ""
    key, sep, pattern = text.partition("=")
    if not sep or key not in ("name", "layer_id", "cls"):
        key, pattern = "name", text
    if not pattern:
        return lambda path: True
    try:
        regex = re.compile(pattern)
    except re.error:
        return lambda path: False
    if key == "cls":
        return lambda path: False
    if key == "layer_id":
        return lambda path: bool((found := _LAYER_ID.search(path)) and regex.fullmatch(found.group(1)))
    return lambda path: bool(regex.search(path))


def map_rank(index: Index, rules: List[Rule], side: str, engine: str, other: str) -> Mapped:
    """The rank's tensors under their mapped names. Every pass repeats its calls and tensors (a
    long decode run, thousands of times): each distinct tensor and call is read once, from its
    first entry; which pass holds a tensor is asked of the index when its rows are read."""
    tensors, calls = index.cols("tensors"), index.cols("calls")
    info = {}  # call -> (module, cls, post) of its first entry
    at = calls.firsts("call")
    for call, module, cls, post in zip(*(calls[n][at].tolist() for n in ("call", "module", "cls", "post"))):
        info[call] = (module, cls, int(post))
    at = tensors.firsts("tensor")
    columns = ("tensor", "call", "io", "slot", "dtype", "shape", "token_dims")
    entries = list(zip(*(tensors[n][at].tolist() for n in columns)))
    slots: Dict[str, set] = {}
    for _, call, io, slot, _, _, _ in entries:
        slots.setdefault(call, set()).add(f"{io}.{slot}")
    modules = {module for module, _, _ in info.values()}
    parents = {m[:i] for m in modules for i in range(len(m)) if m[i] == "."} | ({""} if len(modules) > 1 else set())
    pieces: Dict[str, Piece] = {}
    mapped_calls: Dict[str, CallInfo] = {}
    leaves, seen_calls, kept_calls, used = set(), set(), set(), {}
    for tensor, call, _, _, dtype, shape, dims in entries:
        module, cls, post = info.get(call, (module_of(call), "", 0))
        seen_calls.add(call)
        targets = _rename(tensor, cls, frozenset(slots.get(call, ())), rules, side, engine, other)
        if len(targets) == 1 and targets[0][0] is None:  # left out by a rule
            if targets[0][4]:
                used[targets[0][4]] = None
            continue
        kept_calls.add(call)
        width = _row_width(shape, dims)
        for name, part, parts, sizes, why in targets:
            if why:
                used[why] = None
            pieces.setdefault(name, Piece(tensor, part, parts, sizes, str(dtype), width, call, why))
            renamed = call_of(name)
            if renamed not in mapped_calls or (renamed == call and mapped_calls[renamed].source != call):
                mapped_calls[renamed] = CallInfo(module_of(renamed), cls, post, call)
            if module not in parents:
                leaves.add(renamed)
    return Mapped(pieces, mapped_calls, leaves, seen_calls - kept_calls, list(used))


def _rename(tensor: str, cls: str, slots, rules: List[Rule], side: str, engine: str, other: str) -> list:
    """[(name, part, parts, sizes, why)] this tensor is known by; [(None, ..., why)] when a rule
    leaves it out."""
    for rule in rules:
        if not rule.applies(side, engine, other, cls, slots):
            continue
        found = re.fullmatch(rule.match, tensor)
        if found is None:
            continue
        if rule.ignore:
            return [(None, -1, 0, None, rule.why)]
        if rule.split:
            names = [found.expand(t) for t in rule.split]
            return [(n, i, len(names), rule.sizes, rule.why) for i, n in enumerate(names)]
        return [(found.expand(t), -1, 1, None, rule.why) for t in rule.to]
    return [(tensor, -1, 1, None, "")]


def _row_width(shape, dims) -> int:
    shape = json.loads(shape) if isinstance(shape, str) else list(shape)
    dims = json.loads(dims) if isinstance(dims, str) else dims
    if not isinstance(shape, list):
        return 0
    token = set(dims or ())
    return int(math.prod(s for d, s in enumerate(shape) if d not in token))


def float_type(dtype: str) -> bool:
    return "float" in dtype
