"""Joins on integer keys in numpy: how the verdict path matches rows of two tables without pandas."""

from __future__ import annotations

import numpy as np


def row_key(passes, token_rows) -> np.ndarray:
    """One int64 per (pass, token row); row -1 (a tensor without token rows) is a key too."""
    return (np.asarray(passes, np.int64) << 32) | (np.asarray(token_rows, np.int64) + 1)


def join(side: np.ndarray, probe: np.ndarray):
    """(positions in side, positions in probe) of every pair of equal keys, many to many,
    ordered by probe position, then by position in side."""
    order = np.argsort(side, kind="stable")
    keys = side[order]
    start, end = np.searchsorted(keys, probe, "left"), np.searchsorted(keys, probe, "right")
    counts = end - start
    probe_pos = np.repeat(np.arange(len(probe)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return order[np.repeat(start, counts) + within], probe_pos


def lookup(side: np.ndarray, probe: np.ndarray) -> np.ndarray:
    """For each probe key, the position of the first equal key in side; -1 where none."""
    order = np.argsort(side, kind="stable")
    keys = side[order]
    at = np.searchsorted(keys, probe, "left")
    inside = at < len(keys)
    found = np.full(len(probe), -1, np.int64)
    hit = inside.copy()
    hit[inside] = keys[at[inside]] == probe[inside]
    found[hit] = order[at[hit]]
    return found
