"""A pass's metadata as the JSON string a pass file's header holds, each call's text reused from
the previous pass where the call is equal.

The writer encodes every pass's metadata (one entry per hooked call, with each tensor's shape,
token dims, alias and print range): at 32 layers about 200 KB, a few milliseconds of the C
encoder, which holds the interpreter lock all the while and so stalls the model's thread. Decode
steps of one batch repeat their calls exactly, and comparing two calls' dicts costs about a
twentieth of encoding one; so a call equal to the same-named call of the previous pass takes that
pass's text. Equal dicts give equal JSON but for the scalars a call's arguments pass ("values"),
where Python has 1 == 1.0 == True and 0.0 == -0.0: those are compared by type and text too. The
text is kept escaped as the contents of a JSON string, as the safetensors header holds it
(stfile.py): escaping text escapes each part alone, so the parts join as the whole would. The
reuse also relies on a submitted pass's metadata never changing in place afterwards (the hooks
build new dicts for every pass; a graph replay's are copies of its recorded ones, made once per
batch size and never changed after). Key order may come from the earlier pass; the JSON objects
are the same.
"""

from __future__ import annotations

import json
from typing import Dict, Tuple

_COMPACT = (",", ":")
_CALLS_MARK = "\x00calls of this pass\x00"  # stands in for the calls while the rest is encoded


class MetaJson:
    """Encoder of one rank's passes, in order."""

    def __init__(self) -> None:
        self._previous: Dict[str, Tuple[dict, str]] = {}  # call name -> (its dict, its escaped JSON)

    def dumps_escaped(self, meta: dict) -> str:
        """``json.dumps(meta)`` (compact) as it stands between the quotes of a JSON string."""
        calls = meta.get("calls")
        if not isinstance(calls, list):
            return _escape(json.dumps(meta, separators=_COMPACT))
        previous, now, parts = self._previous, {}, []
        for call in calls:  # each a dict named by its "call" (passstate.Call.to_meta)
            found = previous.get(call["call"])
            same = found is not None and (
                found[0] is call  # a planned pass's call is the traced pass's own (passplan.py)
                or (found[0] == call and _same_scalars(found[0].get("values"), call.get("values")))
            )
            text = found[1] if same else _escape(json.dumps(call, separators=_COMPACT))
            now[call["call"]] = (call, text)
            parts.append(text)
        self._previous = now
        head = _escape(json.dumps(dict(meta, calls=_CALLS_MARK), separators=_COMPACT))
        return head.replace(_escape(json.dumps(_CALLS_MARK)), "[" + ",".join(parts) + "]", 1)


def _escape(text: str) -> str:
    return json.dumps(text)[1:-1]


def _same_scalars(before, now) -> bool:
    """Equal values (already known) that JSON also writes alike: same types, same float text."""
    if not before:
        return True
    for key, value in now.items():
        earlier = before[key]
        if type(earlier) is not type(value) or (isinstance(value, float) and repr(earlier) != repr(value)):
            return False
    return True
