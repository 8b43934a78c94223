"""The shape of pass metadata (dumper/format.py), checked once when a pass is opened, so that
every later stage can trust it: a damaged or forged header becomes a DumpError naming the field,
never a TypeError deep inside."""

from __future__ import annotations

from typing import Optional


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def is_str(v) -> bool:
    return isinstance(v, str)


def _list_of(v, ok) -> bool:
    return isinstance(v, list) and all(ok(x) for x in v)


def _optional(v, ok) -> bool:
    return v is None or ok(v)


def ints_within(values, low: int, high: int) -> bool:
    """A list of ints (JSON ints: never bools) with low <= v < high. Written out, not with the
    helpers above: it runs for every dim of every tensor of every pass (a decode step has hundreds)."""
    if type(values) is not list:
        return False
    for v in values:
        if type(v) is not int or v < low or v >= high:
            return False
    return True


def _tensor_meta_ok(t) -> bool:
    if type(t) is not dict or not ints_within(t.get("shape"), 0, 2**63):
        return False
    dims = t.get("token_dims")
    return (
        type(t.get("dtype")) is str
        and t.get("rows") in (None, "all", "last")
        and (dims is None or (ints_within(dims, 0, len(t["shape"])) and len(set(dims)) == len(dims)))
        and _optional(t.get("alias"), is_str)
        and _optional(t.get("why"), is_str)
        and type(t.get("selected", False)) is bool
    )


def call_ok(c) -> bool:
    """One entry of the metadata's calls list is well-formed."""
    return (
        isinstance(c, dict)
        and all(is_str(c.get(k)) for k in ("call", "module", "cls"))
        and is_int(c.get("pre"))
        and _optional(c.get("post"), is_int)
        and isinstance(c.get("tensors"), dict)
        and all(is_str(k) and _tensor_meta_ok(v) for k, v in c["tensors"].items())
        and isinstance(c.get("values", {}), dict)
        and isinstance(c.get("skipped", {}), dict)
    )


def meta_problem(meta: dict, calls_checked: bool = False) -> Optional[str]:
    """The first field of the pass metadata the analyzer relies on that is malformed, or None.
    ``calls_checked``: each call already passed call_ok (recalled by its text)."""
    tokens = meta.get("tokens")
    if not isinstance(tokens, dict):
        return "tokens"
    columns = {"ids": is_int, "pos": is_int, "seq": is_str, "valid": lambda v: isinstance(v, bool)}
    for key, ok in columns.items():
        if not _list_of(tokens.get(key), ok) or len(tokens[key]) != len(tokens.get("ids") or []):
            return f"tokens.{key}"
    if any(pos < 0 for pos, valid in zip(tokens["pos"], tokens["valid"]) if valid):  # found by the fuzzer:
        return "tokens.pos"  # a negative position indexed a sequence's token list from its end
    in_pass = lambda r: is_int(r) and 0 <= r < len(tokens["ids"])  # noqa: E731
    checks = {
        "token_shape": _list_of(meta.get("token_shape"), is_int),
        "mode": _optional(meta.get("mode"), is_str),
        "step": _optional(meta.get("step"), is_int),
        "kept_rows": _optional(meta.get("kept_rows"), lambda v: _list_of(v, in_pass)),
        "last_rows": _optional(meta.get("last_rows"), lambda v: _list_of(v, in_pass)),
        "seqs": _list_of(
            meta.get("seqs", []),
            lambda q: (
                isinstance(q, dict)
                and is_str(q.get("seq"))
                and _list_of(q.get("rows"), is_int)
                and len(q["rows"]) == 2
                and ("prefix_ids" not in q or _list_of(q["prefix_ids"], is_int))
            ),
        ),
        "calls": isinstance(meta.get("calls"), list),
    }
    bad = next((key for key, ok in checks.items() if not ok), None)
    if bad or calls_checked:
        return bad
    return next((f"calls[{i}]" for i, call in enumerate(meta["calls"]) if not call_ok(call)), None)
