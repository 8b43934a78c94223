"""A pass's metadata from its JSON text, checked; calls read before are recalled by their text.

Every decode step of a run writes the same few hundred calls (~100 KB of JSON) around a few
fields that change (token ids, positions, the step number). Parsing and checking those calls was
most of what opening a decode step cost. Each call's exact text is remembered with its parsed,
checked object: a pass whose calls array repeats a text gets that object back (equal text parses
to equal JSON), and only new texts are parsed and checked. Where the array sits is proven on a
small probe text, the metadata with the array cut out, so the result is exactly json.loads's;
anything this reader does not follow is parsed whole.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from typing import List, Optional, Tuple

from ..errors import DumpError, show
from .metacheck import call_ok, meta_problem

# JSON escapes can smuggle in lone surrogates ("\udcff") that no later stage (parquet, the report)
# can encode. Only a \uD800-\uDFFF escape makes one: text holding one is checked whole.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
CALLS_AT = '"calls":['
REMEMBERED_CALLS = 1 << 14  # call texts kept: a large model's prefill writes thousands of calls

_calls_by_text: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
# The calls array of the last pass read (its text from the first call to "]", its calls, their
# texts): the next pass likely repeats it whole, or but for a few calls.
_last_array: Tuple[str, tuple, List[str]] = ("", (), [])
_lock = threading.Lock()  # passes are opened on two threads at once
_DECODER = json.JSONDecoder()
_MARK = object()


def parse_meta(raw: str, path: str) -> dict:
    """The checked metadata of a pass file (``raw``: its JSON text); DumpError when it is damaged."""
    found = _with_recalled_calls(raw)
    meta, calls_checked = (found, True) if found is not None else (_parsed_whole(raw, path), False)
    if not isinstance(meta, dict):
        raise DumpError(f"{show(path)}: pass metadata is not a JSON object; the file is damaged")
    missing = [k for k in ("tokens", "calls", "token_shape") if k not in meta]
    if missing:
        raise DumpError(f"{show(path)}: pass metadata lacks {missing}; the file is damaged or from another tool")
    wrong = meta_problem(meta, calls_checked)
    if wrong:
        raise DumpError(f"{show(path)}: pass metadata field {wrong} is malformed; the file is damaged")
    return meta


def _parsed_whole(raw: str, path: str):
    try:
        meta = json.loads(raw)
        readable = _encodable(raw, meta)
    except (ValueError, RecursionError):
        readable = False
    if not readable:
        raise DumpError(f"{show(path)}: pass metadata is not valid JSON or holds invalid text; the file is damaged")
    return meta


def _encodable(text: str, value) -> bool:
    """False when ``value``, parsed from ``text``, holds a lone surrogate (only a \\uD800-\\uDFFF
    escape in the text makes one: the value is checked whole only then)."""
    if not SURROGATE_ESCAPE.search(text):
        return True
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except ValueError:  # UnicodeEncodeError is one
        return False
    return True


def _with_recalled_calls(raw: str) -> Optional[dict]:
    """The metadata with its calls read through the text cache, or None when this reader cannot
    vouch for the result (then it is parsed whole, and a damaged call is named there)."""
    start = raw.find(CALLS_AT)
    if start < 0:
        return None
    calls, texts, end = _walk_calls(raw, start + len(CALLS_AT))
    if calls is None:
        return None
    # The probe: the metadata with a NaN where the array was. When it parses, its one NaN being the
    # value json.loads gives the top-level key "calls" (the last of its kind), the array stood
    # where json.loads reads that value, and the rest of the text parses the same in both.
    probe = raw[:start] + '"calls":NaN' + raw[end:]
    constants = []
    decoder = json.JSONDecoder(parse_constant=lambda name: constants.append(name) or _MARK)
    try:
        meta = decoder.decode(probe)
    except (ValueError, RecursionError):
        return None
    if type(meta) is not dict or len(constants) != 1 or meta.get("calls") is not _MARK:
        return None
    meta["calls"] = calls
    if not _encodable(probe, meta):
        return None
    global _last_array
    _last_array = (raw[start + len(CALLS_AT) : end], tuple(calls), texts)  # a tuple: no pass edits another's
    return meta


def _walk_calls(raw: str, i: int) -> Tuple[Optional[list], List[str], int]:
    """(the calls of the array whose "[" ends before ``i``, their texts, where the array ends), or
    None for the calls when the array is not one this reader follows (whitespace between
    elements, a malformed call)."""
    whole, known_calls, expected = _last_array
    if whole and raw.startswith(whole, i):
        return list(known_calls), expected, i + len(whole)
    calls: list = []
    texts: List[str] = []
    if raw.startswith("]", i):
        return calls, texts, i + 1
    while True:
        text = expected[len(calls)] if len(calls) < len(expected) else None
        call = _calls_by_text.get(text) if text is not None and raw.startswith(text, i) else None
        if call is None:
            text, call = _read_call(raw, i)
            if call is None:
                return None, [], i
        calls.append(call)
        texts.append(text)
        i += len(text)
        mark = raw[i : i + 1]
        i += 1
        if mark == "]":
            return calls, texts, i
        if mark != ",":
            return None, [], i


def _read_call(raw: str, i: int) -> Tuple[str, Optional[dict]]:
    """The call whose text starts at ``i``: recalled, or parsed, checked and remembered."""
    try:
        value, end = _DECODER.raw_decode(raw, i)
    except (ValueError, RecursionError):
        return "", None
    text = raw[i:end]
    known = _calls_by_text.get(text)
    if known is not None:
        return text, known
    if not _encodable(text, value) or not call_ok(value):
        return "", None
    with _lock:
        _calls_by_text[text] = value
        while len(_calls_by_text) > REMEMBERED_CALLS:
            _calls_by_text.popitem(last=False)
    return text, value
