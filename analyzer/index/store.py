"""The parquet index of a dump: one row per tensor row-slice with its fingerprint.

Built once per dump by reading every committed pass a single time; later questions ("are these
rows bit-identical?") are answered from the index without touching tensor bytes. Tables, each
a parquet file readable by pandas or duckdb:

    tokens.parquet   rank, pass, row, seq, pos, id, valid, mode, step   (one per token row)
    seqs.parquet     rank, pass, seq, first, end, prefix_ids            (one per sequence per pass)
    calls.parquet    rank, pass, call, module, cls, pre, post, skipped  (one per hooked call)
    tensors.parquet  rank, pass, tensor, call, io, slot, dtype, shape, token_dims, rows, stored,
                     selected, is_ids, why                               (one per captured tensor)
    rows.parquet     rank, pass, tensor, row, fp, rowshape, amax, nonfinite, srow, offset
                     (one per token row of each tensor; row -1 = a tensor without token rows;
                     offset: the row's first byte in the pass file, -1 where it is not one range)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
from typing import Dict, List, Optional

from ..dump.load import Dump, show
from .files import STAMP_FILE, TABLES, index_folder, table_path
from .saved import LazyParquet, _open_regular, _open_saved, _read_table, _unreadable_errors
from .table import Index

INDEX_VERSION = 6  # 2: XXH3 row fingerprints; 3: exact float64 amax (2 rounded it); 4: written by pyarrow alone;
# 5: text columns dictionary-encoded (ENCODED); 6: each row's byte offset in its pass file


def index_location(dump: Dump) -> str:
    return index_folder(dump.path)


def _stamp(dump: Dump, kind: str = "xxh3") -> dict:
    """What the index was built from. Size alone is not enough: a re-dump into the same folder
    (DUMPER_CLEANUP_PREVIOUS) writes new files of the same pass ids and sizes, so each file's
    inode and mtime are part of it too, and a stale index is never reused."""
    files = {}
    for r, d in dump.ranks.items():
        files[str(r)] = []
        for p in d.passes:
            st = os.stat(p.path)
            files[str(r)].append([p.pass_id, p.nbytes, st.st_ino, st.st_mtime_ns])
    stamp = {"index_version": INDEX_VERSION, "ranks": files}
    if kind != "xxh3":  # the fingerprint kind (prints.py); XXH3 indexes keep their old stamp
        stamp["fingerprint"] = kind
    return stamp


def load_index(dump: Dump, rebuild: bool = False, progress: bool = True) -> Index:
    return load_indexes([dump], rebuild, progress)[0]


def load_indexes(dumps: List[Dump], rebuild: bool = False, progress: bool = True, prefetch=None) -> List[Index]:
    """The index of each dump: read when fresh, else built, all missing ones in one build (a
    reference's large prefill streams from disk while a decode run's steps are worked on), and
    saved. ``prefetch``: (table, columns) to start reading in the background as soon as an
    index is opened, while the next one opens."""
    for dump in dumps:
        _warn(dump)
    from .printkind import ROWPRINT, index_kind

    kind = index_kind(dumps)  # one fingerprint kind for dumps compared together
    places = [index_location(dump) for dump in dumps]
    if kind == ROWPRINT:  # a folder of its own: a full dump compared both ways is not rebuilt each time
        places = [os.path.join(place, ROWPRINT) for place in places]
    with contextlib.ExitStack() as held:
        folder = _locked_folders(places, held)  # place -> its folder's identity (None: not saved)
        tables: Dict[object, dict] = {}
        todo = {}  # folder -> (dump, where, stamp) of the indexes to build
        wanted = {}  # one dump given twice (or spelt two ways) is opened once
        for dump, where in zip(dumps, places):
            wanted.setdefault(folder[where] or where, (dump, where))

        def open_saved(dump: Dump, where: str):
            stamp = _stamp(dump, kind)
            fresh = _read_fresh(where, stamp) if folder[where] and not rebuild else None
            if fresh is not None and prefetch and isinstance(fresh.get(prefetch[0]), LazyParquet):
                fresh[prefetch[0]].prefetch(prefetch[1])
            return stamp, fresh

        # both indexes are opened at once: each waits on its own files
        with concurrent.futures.ThreadPoolExecutor(len(wanted), thread_name_prefix="dumpdiff-open") as pool:
            opened = dict(zip(wanted, pool.map(lambda key: open_saved(*wanted[key]), list(wanted))))
        for key, (dump, where) in wanted.items():
            stamp, fresh = opened[key]
            if fresh is not None:
                tables[key] = fresh
            else:
                todo[key] = (dump, where, stamp)
        building = list(todo.items())

        def save(k: int, made: dict) -> None:
            _, (_, where, stamp) = building[k]
            if folder[where]:
                try:
                    _write_tables(where, made, stamp)
                except OSError as exc:
                    _unsaved(where, exc)

        if building:  # (nothing to build: none of the build's modules is imported)
            if kind == ROWPRINT:
                from .prints import build_many
            else:
                from .build import build_many
            built = build_many([dump for _, (dump, _, _) in building], progress=progress, on_built=save)
            tables.update((key, made) for (key, _), made in zip(building, built))
    return [Index(dump, tables[folder[where] or where], where) for dump, where in zip(dumps, places)]


def _locked_folders(places: List[str], held: contextlib.ExitStack) -> dict:
    """Take each index folder's lock; {place: the folder's identity (device, inode of its lock
    file), or None where it cannot be made: that index is used from memory}. One process at a
    time reads or builds an index folder: two commands on the same dump at once never see each
    other's half-replaced tables (the second waits, then reuses the index). A folder named two
    ways (relative, absolute, through a link) is locked once, and folders are locked in the
    order of their identities, the same in every process: two commands on one pair, whatever
    their argument order and spelling, wait for each other instead of deadlocking. Closing the
    files releases the locks, also when the process dies."""
    found, handles = {}, {}
    for where in dict.fromkeys(places):
        try:
            os.makedirs(where, exist_ok=True)
            handle = _open_regular(os.path.join(where, ".lock"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, "ab")
        except OSError as exc:  # a full or read-only disk (or no regular lock file): no saved index is needed
            _unsaved(where, exc)
            found[where] = None
            continue
        info = os.fstat(handle.fileno())
        found[where] = (info.st_dev, info.st_ino)
        if found[where] in handles:
            handle.close()  # locking it again through a second open file would wait for ourselves
        else:
            handles[found[where]] = held.enter_context(handle)
    for identity in sorted(handles):
        fcntl.flock(handles[identity], fcntl.LOCK_EX)
    return found


def _read_fresh(where: str, stamp: dict) -> Optional[dict]:
    try:
        with _open_saved(os.path.join(where, STAMP_FILE)) as handle:
            if json.loads(handle.read()) != stamp:
                return None
        # Python's open, not pyarrow's: pyarrow cannot open a path with non-UTF-8 bytes. The
        # tables are read at once (pyarrow lets go of the GIL): each read waits on the disk.
        with concurrent.futures.ThreadPoolExecutor(len(TABLES), thread_name_prefix="dumpdiff-tables") as pool:
            read = {n: pool.submit(_read_table, table_path(where, n), n == "rows") for n in TABLES}
    except (OSError, ValueError):
        return None  # absent, stale or damaged: rebuilt
    tables = {n: future.result() for n, future in read.items() if future.exception() is None}
    if len(tables) < len(TABLES):
        for table in tables.values():  # one is damaged: the rows table opened beside it is let go now
            if isinstance(table, LazyParquet):
                table.close()
        error = next(f.exception() for f in read.values() if f.exception() is not None)
        if not isinstance(error, _unreadable_errors()):
            raise error
        return None
    return tables


def _unsaved(where: str, exc: OSError) -> None:
    logging.getLogger("dumpdiff").warning(
        "warning: could not save the index in %s (%s); it is used from memory and rebuilt next time",
        show(where),
        exc.strerror or exc,
    )


def _warn(dump: Dump) -> None:
    """What the dump lacks (killed writer, disk limit) goes to stderr for every command."""
    for note in dump.warnings():
        logging.getLogger("dumpdiff").warning("warning: %s", note)


# Stored as differences (rows of a tensor count up; offsets step by a row's width): the offsets
# take 1% of the bytes of dictionary-then-plain encoding and decode 4x faster.
DELTA_COLUMNS = {"rows": ("row", "srow", "offset")}


def _write_tables(where: str, tables: dict, stamp: dict) -> None:
    """Called under the index lock. The stamp goes first and comes back last, so a build killed
    half-way leaves no stamp and is redone, never trusted; each file is renamed into place whole.
    One file at a time: pyarrow writing Python file objects from several threads crashes (SIGSEGV)
    when the disk fills up."""
    tag = f".tmp.{os.getpid()}"
    stamp_path = os.path.join(where, STAMP_FILE)
    if os.path.exists(stamp_path):
        os.unlink(stamp_path)
    import pyarrow.parquet as pq

    written = []
    try:
        for name, table in tables.items():
            path = table_path(where, name)
            written.append(path + tag)
            delta = [c for c in DELTA_COLUMNS.get(name, ()) if c in table.column_names]
            with open(path + tag, "wb") as handle:
                pq.write_table(
                    table,
                    handle,
                    use_dictionary=[c for c in table.column_names if c not in delta],
                    column_encoding={c: "DELTA_BINARY_PACKED" for c in delta},
                )
            os.replace(path + tag, path)
        written.append(stamp_path + tag)
        with open(stamp_path + tag, "w") as handle:
            json.dump(stamp, handle)
        os.replace(stamp_path + tag, stamp_path)
    finally:
        for tmp in written:  # a full disk must not leave half-written temp files behind
            if os.path.exists(tmp):
                os.unlink(tmp)
