"""Turn a hooked call's args, kwargs and outputs into named tensors and JSON metadata.

Nested tuples, lists, dicts, dataclasses and HF ``ModelOutput`` become slots such as ``0``,
``hidden_states``, ``position_embeddings.1`` or ``logits``. Scalars are kept as JSON values;
any other object is counted as skipped with its type name, so nothing disappears silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

MAX_DEPTH = 4
JSON_SCALARS = (bool, int, float, str, type(None))


def flatten(value: Any, prefix: str = "", depth: int = 0, output: bool = False) -> List[Tuple[str, Any]]:
    """(slot, leaf) pairs; a leaf is a tensor, a JSON scalar or any other object. ``output``: a
    call's output, whose dataclasses are opened whatever their size (sglang's
    LogitsProcessorOutput has 24 fields and holds the logits)."""
    leaves: List[Tuple[str, Any]] = []
    _flatten_into(leaves, value, prefix, depth, output)
    return leaves


_LEAVES = (torch.Tensor,) + JSON_SCALARS


def _flatten_into(leaves: list, value: Any, prefix: str, depth: int, output: bool) -> None:
    # a list filled in place, not nested generators: a decoder layer's call passes a dozen
    # keyword arguments, on every layer of every step
    if isinstance(value, _LEAVES) or depth >= MAX_DEPTH:
        leaves.append((prefix, value))
    elif isinstance(value, dict):  # includes HF ModelOutput (an OrderedDict)
        for key, item in value.items():
            _flatten_into(leaves, item, f"{prefix}.{key!s}" if prefix else str(key), depth + 1, output)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _flatten_into(leaves, item, f"{prefix}.{index}" if prefix else str(index), depth + 1, output)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type) and (output or _is_small_dataclass(value)):
        for field in dataclasses.fields(value):
            name = field.name
            _flatten_into(leaves, getattr(value, name), f"{prefix}.{name}" if prefix else name, depth + 1, output)
    else:
        leaves.append((prefix, value))


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not a wrapper subclass: plain storage
_INDEX_SLOTS = tuple(str(i) for i in range(16))


def call_inputs(args: tuple, kwargs: dict) -> list:
    """(slot, leaf) pairs of a call's arguments, slots unique. Most calls pass tensors alone and
    no keywords (a linear, a norm, an activation): named at once, without the general walk, as
    it would name them (hooks run hundreds of times a step)."""
    if not kwargs and len(args) <= len(_INDEX_SLOTS):
        for arg in args:
            if type(arg) not in PLAIN_TENSORS:
                break
        else:
            return list(zip(_INDEX_SLOTS, args))
    leaves: List[Tuple[str, Any]] = []
    _flatten_into(leaves, list(args), "", 0, False)
    _flatten_into(leaves, dict(kwargs), "", 0, False)
    return unique_slots(leaves)


def call_outputs(output) -> list:
    """(slot, leaf) pairs of a call's output; a bare tensor is slot "0"."""
    if type(output) in PLAIN_TENSORS:
        return [("0", output)]
    return unique_slots(flatten(output, output=True))


def unique_slots(leaves: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """The leaves with slot names made unique: {"a.b": x, "a": {"b": y}} flattens to two "a.b"
    slots, and the second would overwrite the first; it becomes "a.b~1"."""
    seen = set()
    named = []
    for slot, value in leaves:
        slot = slot or "0"  # a bare tensor
        name, k = slot, 0
        while name in seen:
            k += 1
            name = f"{slot}~{k}"
        seen.add(name)
        named.append((name, value))
    return named


def _is_small_dataclass(value) -> bool:
    # Engine state objects passed in (sglang's ForwardBatch) are dataclasses with dozens of
    # fields and pools of the whole KV cache; they are pass metadata, not an operator's input.
    return len(dataclasses.fields(value)) <= 16


def find_token_dims(
    shape: Sequence[int], token_shape: Sequence[int], n_seqs: int
) -> Tuple[Optional[list], Optional[str], str]:
    """Which dims of a tensor index token rows.

    Returns (token_dims, rows, why): token_dims moved to the front and flattened give one row
    per token row (rows "all"), or one row per sequence's last token (rows "last"). Leading
    dims are preferred; a later dim is taken only for the [B, heads, S, D] attention layout.
    """
    shape = tuple(shape)
    n_tokens = 1
    for size in token_shape:
        n_tokens *= size
    k = len(token_shape)
    if n_tokens == 0 or not shape:
        return None, None, "scalar or empty"
    if shape[:k] == tuple(token_shape) and len(shape) > k - 1:
        return list(range(k)), "all", ""
    if shape[0] == n_tokens and k > 1:
        return [0], "all", ""
    if k == 2:
        batch, seq = token_shape
        if shape[0] == batch and seq > 1:
            if len(shape) > 1 and shape[1] == 1:
                return [0, 1], "last", ""
            later = [d for d in range(2, len(shape)) if shape[d] == seq]
            if len(later) == 1:
                return [0, later[0]], "all", ""
    if k == 1 and n_seqs and shape[0] == n_seqs and n_seqs != n_tokens:
        return [0], "last", ""
    return None, None, f"no dim matches the pass's token layout {list(token_shape)}"


def rows_per_token(shape: Sequence[int], token_shape: Sequence[int], cls: str) -> Optional[int]:
    """k when a norm's tensor holds k rows per token row, token-major: a flat-token engine's
    per-head norm (sglang's Qwen3 q_norm and k_norm take q.reshape(-1, head_dim), [T*heads, D]).
    A norm works on each row alone, and in a flat engine its k*T rows come from that reshape of
    a [T, ...] tensor, whose rows stay token by token (a head-major layout would be misread; none
    is known). Limited to norm modules: elsewhere a k*T-row tensor may be a buffer sorted another
    way (MoE tokens grouped by expert)."""
    if len(token_shape) != 1 or len(shape) < 2 or "Norm" not in cls:
        return None
    tokens, first = token_shape[0], shape[0]
    if tokens <= 0 or first <= tokens or first % tokens:
        return None
    return first // tokens


class Layout:
    """How a tensor of one shape is stored and printed in one pass: its token dims, and the
    [rows, width] view its row fingerprints are taken from (rowprint.as_rows, with the whole
    tensor as one row where its token rows are not the pass's count). Worked out once per shape
    and pass: hooks meet hundreds of tensors a step, of a few shapes."""

    __slots__ = ("shape", "dims", "rows", "why", "token_dims", "print_shape", "print_dims")

    def __init__(self, shape, dims, rows, why, expected_rows: Optional[int] = None) -> None:
        self.shape = tuple(shape)
        self.dims, self.rows, self.why = dims, rows, why
        self.token_dims = None if dims is None else tuple(dims)
        # print_shape: the rows are data.reshape(print_shape) (token dims leading, or one row);
        # else (print_shape None) rowprint.as_rows(data, print_dims) moves the token dims first
        self.print_dims = dims
        self.print_shape: Optional[tuple] = None
        n = None if dims is None else math.prod(self.shape[d] for d in dims)
        if dims is None or (expected_rows is not None and n != expected_rows):
            self.print_dims, self.print_shape = None, (1, math.prod(self.shape))
        elif list(dims) == list(range(len(dims))):
            self.print_shape = (n, math.prod(self.shape[len(dims) :]))


def storage_key(tensor: torch.Tensor):
    """Identity of a tensor's current contents: equal keys mean equal bytes (PyTorch counts every
    in-place write in the version; one that bypasses it, through a numpy view, is not seen; .data
    assigned keeps the version but changes the address, shape, strides or type). Of the tensor as
    stored: a norm's [T, k, ...] view is never taken for the same [T*k, ...] storage, whose rows
    are laid out otherwise. None for an inference tensor: it has no version counter, so it is
    never taken for an earlier one."""
    if tensor.is_inference():
        return None
    # data_ptr: the storage's address plus the offset; the caller's weak reference proves the
    # first tensor alive, so no other storage can start at that address meanwhile
    return (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor._version)


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy taken at hook time: later in-place kernels must not rewrite it."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def select_rows(tensor: torch.Tensor, token_dims: list, rows: torch.Tensor) -> torch.Tensor:
    """Move token dims to the front, flatten them, keep the given rows."""
    moved = tensor.movedim(token_dims, list(range(len(token_dims))))
    flat = moved.reshape((-1,) + tuple(moved.shape[len(token_dims) :]))
    return flat.index_select(0, rows.to(flat.device))
