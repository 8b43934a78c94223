"""Joins on integer keys in numpy: how the verdict path matches rows of two tables without pandas."""

from __future__ import annotations

import numpy as np


def row_key(passes, token_rows) -> np.ndarray:
    """One int64 per (pass, token row); row -1 (a tensor without token rows) is a key too."""
    return (np.asarray(passes, np.int64) << 32) | (np.asarray(token_rows, np.int64) + 1)


DENSE_KEYS = 8 << 20  # key ranges up to which unique keys are looked up in a table (tens of MB)


def join(side: np.ndarray, probe: np.ndarray):
    """(positions in side, positions in probe) of every pair of equal keys, many to many,
    ordered by probe position, then by position in side."""
    table = _positions_table(side) if _small_ints(probe) else None
    if table is not None:  # unique keys in a small range: one lookup per probe key, no sort
        positions, low = table
        probe = np.asarray(probe, np.int64) - low
        at = positions[np.clip(probe, 0, len(positions) - 1)]
        hit = np.nonzero((at >= 0) & (probe >= 0) & (probe < len(positions)))[0]
        return at[hit], hit
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


def _positions_table(side: np.ndarray):
    """(position of each key in side, indexed by key - low; -1 for none, low) when side's keys
    are unique and span at most DENSE_KEYS values; else None."""
    if not len(side) or not _small_ints(side):
        return None
    low, high = int(side.min()), int(side.max())
    if high - low >= DENSE_KEYS:
        return None
    at = np.asarray(side, np.int64) - low
    positions = np.full(high - low + 1, -1, np.int64)
    positions[at] = np.arange(len(side))
    if not np.array_equal(positions[at], np.arange(len(side))):  # a key twice: the sorted join
        return None
    return positions, low


def _small_ints(keys) -> bool:
    """Integers that int64 holds whatever their values (not uint64)."""
    kind = np.asarray(keys).dtype
    return kind.kind == "i" or (kind.kind == "u" and kind.itemsize < 8)
