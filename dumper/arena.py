"""Static device buffers for what a CUDA graph records: one arena per device, a byte budget.

While a graph is being captured the dumper may not allocate per call outside the graph's pool,
sync or copy to the host; it copies each selected tensor into a slot of an arena instead, and
that copy becomes a node of the graph, rerun by every replay. A slot is a view of the arena
at a fixed offset, so after each replay it holds that replay's values.

Every graph's recordings start at offset 0: graphs of one model are replayed one after the other
on one stream, and the dumper copies a replay's slots off (ordered on the stream) before the next
replay can write them, so the budget is the largest single graph's need, not the sum over graphs.
The forwards one graph captures follow each other in the arena: one replay runs them all.
Nothing here needs CUDA: an arena on the CPU keeps the same books (tests/test_graph_capture.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

ALIGN = 256  # bytes: each slot starts aligned for any element type and vectorized copies
# Every arena ever allocated, kept for the life of the process: a graph keeps copying into its
# slots on every replay, also after the dumper is removed, and must never write freed memory.
_KEPT: List[torch.Tensor] = []


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Arenas:
    """The budget and the arenas (one per device, allocated on first use) shared by every
    recording of one dumper."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._arenas: Dict[torch.device, torch.Tensor] = {}

    def arena(self, device: torch.device) -> torch.Tensor:
        """The device's arena: ``budget`` bytes, allocated once (inside a capture it comes from the
        graph's private pool) and never freed while the process lives."""
        found = self._arenas.get(device)
        if found is None:
            # the budget rounded up to the slot alignment: a last slot's aligned end may pass the
            # budget by less than ALIGN, and a replay's copy takes the bytes up to that end
            found = self._arenas[device] = torch.empty(_aligned(self.budget), dtype=torch.uint8, device=device)
            _KEPT.append(found)
        return found

    def layout(self, after: Optional[List["Layout"]] = None) -> "Layout":
        """A new recording's slots, laid out past those of ``after`` (the recordings one graph
        already holds: a graph that captures several forwards replays them all before any is
        copied off)."""
        base: Dict[torch.device, int] = {}
        for earlier in after or ():
            for device, end in earlier.used.items():
                base[device] = max(base.get(device, 0), end)
        return Layout(self, base)

    @property
    def reserved(self) -> int:
        return sum(a.numel() for a in self._arenas.values())


class Layout:
    """The slots of one recording: where each tensor's copy lies, and what did not fit."""

    def __init__(self, arenas: Arenas, base: Optional[Dict[torch.device, int]] = None) -> None:
        self.arenas = arenas
        self.base = dict(base or {})  # per device, where this recording's slots begin
        self.used: Dict[torch.device, int] = {}  # per device, where its slots end (aligned)
        self.slots: List[Tuple[str, torch.device, int, torch.dtype, tuple]] = []  # name, device, offset, dtype, shape
        self.needed: Dict[torch.device, int] = {}  # bytes the selection needs per device, fitted or not
        self.first_missing: Optional[Tuple[str, int]] = None  # (tensor name, bytes) of the first that did not fit

    def take(self, name: str, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """A slot shaped like ``tensor`` (contiguous), or None when the budget is spent (then every
        later tensor is only counted: the error says what the whole selection needs)."""
        device = tensor.device
        nbytes = tensor.numel() * tensor.element_size()
        start = self.needed.get(device, self.base.get(device, 0))
        self.needed[device] = start + _aligned(nbytes)
        if self.first_missing is not None or start + nbytes > self.arenas.budget:
            if self.first_missing is None:
                self.first_missing = (name, nbytes)
            return None
        self.used[device] = start + _aligned(nbytes)
        self.slots.append((name, device, start, tensor.dtype, tuple(tensor.shape)))
        raw = self.arenas.arena(device)[start : start + nbytes]
        return raw.view(tensor.dtype).view(tensor.shape)

    def record(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` into its slot (a graph node when capturing); False if it did not fit."""
        slot = self.take(name, tensor)
        if slot is None:
            return False
        slot.copy_(tensor)
        return True

    def overflow_message(self, shape) -> Optional[str]:
        if self.first_missing is None:
            return None
        name, nbytes = self.first_missing
        needed = max(self.needed.values())
        return (
            f"DUMPER_GRAPH_BUFFER_BYTES={self.arenas.budget} is too small for the CUDA graph captured at "
            f"token shape {list(shape)}: {name} ({nbytes} bytes) did not fit, and the selection needs "
            f"{needed} bytes; raise it to at least {needed}, or select less (DUMPER_FILTER, or "
            "DUMPER_NON_INTRUSIVE_MODE=fingerprint: 24 bytes a row)"
        )

    def host_copy(self) -> Dict[str, torch.Tensor]:
        """Every slot's values as host tensors: one copy per device of the bytes laid out (into
        pinned memory, without waiting, from a GPU: record an event after this and wait on it
        before reading). The tensors are views of that one copy."""
        blocks = {}
        for device, used in self.used.items():
            source = self.arenas.arena(device)[self.base.get(device, 0) : used]
            if device.type == "cuda":
                block = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
                block.copy_(source, non_blocking=True)
            else:
                block = source.clone()
            blocks[device] = block
        out = {}
        for name, device, offset, dtype, shape in self.slots:
            size = 1
            for dim in shape:
                size *= dim
            nbytes = size * dtype.itemsize
            start = offset - self.base.get(device, 0)
            out[name] = blocks[device][start : start + nbytes].view(dtype).view(shape)
        return out
