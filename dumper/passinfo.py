"""What an engine adapter tells the dumper about one forward pass: its token rows.

A token row is one (sequence, position) the pass computes. Rows are listed in the order the
activations lay them out: row-major over ``token_shape`` ([B, S] for HF, [T] for flat engines).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional


@dataclasses.dataclass
class PassInfo:
    mode: str
    token_shape: List[int]
    ids: List[int]
    pos: List[int]
    seq: List[str]  # sequence key per row; "" for padding rows
    valid: List[bool]
    last_rows: List[int]  # per sequence, the row whose logits predict its next token
    prefix_ids: dict = dataclasses.field(default_factory=dict)  # seq -> ids before its first row
    extra: dict = dataclasses.field(default_factory=dict)  # engine fields (seq_lens, rids, ...)
    # seq -> callable returning the sequence's token ids before this pass, for engines that
    # know them (sglang's requests); asked only when the dump lacks that part of the sequence.
    history: dict = dataclasses.field(default_factory=dict)

    def seqs(self) -> list:
        """Per sequence in the pass: key, first and last+1 row, known prefix ids."""
        spans: dict = {}
        for row, (key, ok) in enumerate(zip(self.seq, self.valid)):
            if ok:
                first, _ = spans.get(key, (row, row))
                spans[key] = (first, row + 1)
        out = []
        for key, (first, end) in spans.items():
            entry = {"seq": key, "rows": [first, end]}
            if key in self.prefix_ids:
                entry["prefix_ids"] = list(self.prefix_ids[key])
            out.append(entry)
        return out

    def first_positions(self) -> dict:
        """seq -> (position of its first row in this pass, position after its last row)."""
        spans: dict = {}
        for key, pos, ok in zip(self.seq, self.pos, self.valid):
            if ok:
                lo, hi = spans.get(key, (pos, pos + 1))
                spans[key] = (min(lo, pos), max(hi, pos + 1))
        return spans

    def to_meta(self) -> dict:
        return {
            "mode": self.mode,
            "token_shape": list(self.token_shape),
            "tokens": {"ids": self.ids, "pos": self.pos, "seq": self.seq, "valid": self.valid},
            "last_rows": self.last_rows,
            "seqs": self.seqs(),
            "extra": self.extra,
        }

    def kept_rows(self, positions=None, last_k: int = 0) -> Optional[List[int]]:
        """Rows kept by DUMPER_POSITIONS / DUMPER_LAST_ROWS; None keeps all."""
        if positions is None and not last_k:
            return None
        keep = [ok and (positions is None or positions(p)) for p, ok in zip(self.pos, self.valid)]
        if last_k:
            for first, end in (tuple(s["rows"]) for s in self.seqs()):
                for row in range(first, max(first, end - last_k)):
                    keep[row] = False
        return [row for row, k in enumerate(keep) if k]


def int_list(value) -> List[int]:
    """Token ids, positions or lengths as plain ints, from a tensor, an array or a list."""
    if value is None:
        return []
    if hasattr(value, "detach"):
        return value.detach().cpu().reshape(-1).tolist()
    return [int(v) for v in value]


def mode_of(past_len_min: int, past_len_max: int, new_tokens: int) -> str:
    if past_len_max == 0:
        return "prefill"
    if new_tokens == 1:
        return "decode"
    return "extend" if past_len_min > 0 else "mixed"


class UndescribedPass(ValueError):
    """An adapter cannot tell a forward's token rows (no token ids among its arguments): the
    dumper runs that forward undumped and says so once."""


class WarmupPass(UndescribedPass):
    """A forward the engine runs for itself (a warm-up or profiling run, no request in it): never
    dumped, and nothing to warn about."""
