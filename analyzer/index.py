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
import stat
import threading
from typing import Dict, List, Optional

import numpy as np

from .columns import Columns
from .envsettings import env_count
from .errors import DumpError
from .indexfiles import STAMP_FILE, TABLES, index_folder, table_path
from .load import Dump, show

INDEX_VERSION = 6  # 2: XXH3 row fingerprints; 3: exact float64 amax (2 rounded it); 4: written by pyarrow alone;
# 5: text columns dictionary-encoded (ENCODED); 6: each row's byte offset in its pass file


class Index:
    """The five tables of one dump (or of one rank of it). ``index.tokens`` etc. are pandas frames,
    made on first use; ``index.cols("tokens")`` is the same table as numpy columns, which the
    strict verdict reads (it never imports pandas)."""

    def __init__(self, dump: Dump, tables: dict, where: str, rank: Optional[int] = None, shared: dict = None):
        self.dump = dump
        self.where = where
        self._tables = tables  # name -> pyarrow Table (read from disk or just built)
        self._rank = rank
        self._shared = {} if shared is None else shared  # whole-dump conversions, kept for every rank
        self._frames: Dict[str, object] = {}
        self._cols: Dict[str, Columns] = {}
        self._reader = None

    def frame(self, name: str):
        if name not in self._frames:
            whole = self._shared.get(("frame", name))
            if whole is None:
                from .passtables import ENCODED
                frame = self._tables[name].to_pandas(use_threads=False)  # a LazyParquet or a pyarrow Table
                whole = self._shared[("frame", name)] = _plain_text(frame, ENCODED.get(name, ()))
            self._frames[name] = whole if self._rank is None or "rank" not in whole else whole[whole["rank"] == self._rank]
        return self._frames[name]

    def cols(self, name: str) -> Columns:
        if name not in self._cols:
            whole = self._shared.get(("cols", name))
            if whole is None:
                whole = self._shared[("cols", name)] = Columns.from_arrow(self._tables[name])
            one_rank = self._rank is None or len(self.dump.ranks) == 1 or "rank" not in whole
            self._cols[name] = whole if one_rank else _rows_of_rank(whole, self._rank)
        return self._cols[name]

    tokens = property(lambda self: self.frame("tokens"))
    seqs = property(lambda self: self.frame("seqs"))
    calls = property(lambda self: self.frame("calls"))
    tensors = property(lambda self: self.frame("tensors"))
    rows = property(lambda self: self.frame("rows"))

    def reader(self):
        """The RowReader of this index, built once: its lookup tables span every tensor row."""
        if self._reader is None:
            from .rowread import RowReader
            self._reader = RowReader(self)
        return self._reader

    def prefetch(self, table: str, names):
        """Read these columns of a table saved on disk in the background (no-op for one in memory)."""
        if isinstance(self._tables[table], LazyParquet):
            self._tables[table].prefetch(names)

    def rank(self, rank: int) -> "Index":
        return Index(self.dump, self._tables, self.where, rank, self._shared)


def _plain_text(frame, names):
    """The encoded text columns as plain strings (object), as the pandas consumers expect."""
    for name in names:
        if name in frame and str(frame[name].dtype) == "category":
            frame[name] = frame[name].astype(object)
    return frame


def _rows_of_rank(table: Columns, rank: int) -> Columns:
    """A rank's entries; a view when they lie together (tables are built rank by rank), not a copy."""
    at = np.nonzero(table["rank"] == rank)[0]
    if len(at) == len(table):
        return table
    if len(at) and at[-1] - at[0] + 1 == len(at):
        return table.take(slice(int(at[0]), int(at[-1]) + 1))
    return table.take(at)


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
    if kind != "xxh3":  # the fingerprint kind (analyzer/printindex.py); XXH3 indexes keep their old stamp
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

        def save(k: int, made: dict):
            _, (_, where, stamp) = building[k]
            if folder[where]:
                try:
                    _write_tables(where, made, stamp)
                except OSError as exc:
                    _unsaved(where, exc)
        if building:  # (nothing to build: none of the build's modules is imported)
            if kind == ROWPRINT:
                from .printindex import build_many
            else:
                from .indexbuild import build_many
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


def _unreadable_errors() -> tuple:
    """What reading a damaged saved table raises: the OS's errors, and pyarrow's (most are
    ValueErrors; a damaged footer can also give ArrowNotImplementedError)."""
    import pyarrow as pa
    return (OSError, ValueError, pa.ArrowException)


def _unsaved(where: str, exc: OSError):
    logging.getLogger("dumpdiff").warning(
        "warning: could not save the index in %s (%s); it is used from memory and rebuilt next time",
        show(where), exc.strerror or exc)


def _warn(dump: Dump):
    """What the dump lacks (killed writer, disk limit) goes to stderr for every command."""
    for note in dump.warnings():
        logging.getLogger("dumpdiff").warning("warning: %s", note)


def _open_saved(path: str):
    """A saved index file, opened for reading; anything but a regular file is damage (OSError: the
    index is rebuilt over it)."""
    return _open_regular(path, os.O_RDONLY, "rb")


def _open_regular(path: str, flags: int, mode: str):
    """Open a file of the index folder, refusing anything but a regular file (OSError): opening a
    named pipe put in its place would block, and the command with it, forever."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o644)
    except OSError:
        if os.path.exists(path) and not os.path.isfile(path):  # a pipe without a reader: ENXIO
            raise OSError(f"{show(path)} is not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{show(path)} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _read_table(path: str, lazy: bool = False):
    if lazy:
        return LazyParquet(path)
    with _open_saved(path) as handle:
        return _parquet(_whole(handle)).read(use_threads=False)  # not read_table: its dataset layer imports pandas


# How saved tables are read: each file opened with Python's open (pyarrow cannot open a path with
# non-UTF-8 bytes) and mapped into memory whole, then parsed by pyarrow from that memory, never
# through a Python file object, and never on pyarrow's own threads (use_threads=False). Both can
# leave pyarrow threads that finish a read while the interpreter exits, and abort the process
# ("terminate called without an active exception", apache/arrow#34314): a command that failed
# right after opening the indexes died of SIGABRT about one run in five. Parallel reads run on
# our threads.


def _whole(handle):
    """The file's bytes for pyarrow: mapped, not copied (copying cost 11 ms of a 0.45 s verdict on
    an H200 host); read where a file cannot be mapped (an empty one). dumpdiff's rebuilds write
    new files and rename them into place, so a mapped file is never changed under it; a tool that
    rewrites a saved table in place while a command reads it (rsync --inplace) would end that
    command with SIGBUS."""
    import mmap
    import pyarrow as pa
    try:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        data = handle.read()
    return pa.py_buffer(data)


def _parquet(data, metadata=None):
    """A parquet reader over bytes in memory (reads from it are synchronous: no I/O threads)."""
    from .parquetread import ParquetBytes
    return ParquetBytes(data, metadata)


class LazyParquet:
    """A parquet table whose columns are decoded when first asked for: the strict verdict needs 9
    of the rows table's 10 columns. The file is mapped whole when opened (a few MB per million
    rows), so a rebuild by another process (which renames new files into place) cannot change
    what this one reads."""

    def __init__(self, path: str):
        self._path = path
        with _open_saved(path) as handle:
            self._data = _whole(handle)
        self._file = _parquet(self._data)  # parses the footer: a damaged file fails here
        self.column_names = list(self._file.schema_arrow.names)
        self.num_rows = self._file.metadata.num_rows

        self._prefetch: Dict[str, concurrent.futures.Future] = {}  # name -> the read of its group of columns
        self._ready: dict = {}  # name -> column read
        self._lock = threading.Lock()  # guards _prefetch and _ready (a dump compared with itself shares
        #                                this object between both sides' threads)

    def prefetch(self, names):
        """Start decoding these columns in the background, on up to a thread per core (pyarrow
        lets go of the GIL); ``column`` waits for them. Decoding them one by one, when asked, is
        serial work the verdict path would otherwise wait for."""
        with self._lock:
            names = [n for n in names if n in self.column_names and n not in self._ready and n not in self._prefetch]
            if not names:
                return
            threads = min(len(names), os.cpu_count() or 1)
            pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dumpdiff-prefetch")
            for group in (names[k::threads] for k in range(threads)):
                future = pool.submit(self._read, group)
                self._prefetch.update((n, future) for n in group)
            pool.shutdown(wait=False)  # the threads end with the reads

    def column(self, name: str):
        with self._lock:
            self._settle()
            if name in self._ready:
                return self._ready[name]
        return self._read([name]).column(0)

    def to_pandas(self, use_threads: bool = False):
        with self._lock:
            self._settle()
        return self._read(None).to_pandas(use_threads=use_threads)

    def close(self):
        """Let go of the mapping now (both the bytes and the parser over them hold it)."""
        with self._lock:
            self._settle(quiet=True)
        self._data = self._file = None

    def _settle(self, quiet: bool = False):
        """Wait for the read-ahead (under self._lock)."""
        pending, self._prefetch = self._prefetch, {}
        for name, future in pending.items():
            try:
                self._ready[name] = future.result().column(name)
            except BaseException:
                if not quiet:
                    raise

    def _read(self, columns):
        """A table of the named columns (None: all). Each read has a ParquetFile of its own (over
        the same bytes, footer parsed once): one is not safe on two threads."""
        if self._file is None:
            raise DumpError(f"{show(self._path)}: read after the index was closed")
        try:
            return _parquet(self._data, self._file.metadata).read(columns=columns, use_threads=False)
        except _unreadable_errors() as exc:
            raise DumpError(f"{show(self._path)}: cannot be read ({exc}); the index is damaged: "
                            "rerun with --rebuild-index") from None


# Stored as differences (rows of a tensor count up; offsets step by a row's width): the offsets
# take 1% of the bytes of dictionary-then-plain encoding and decode 4x faster.
DELTA_COLUMNS = {"rows": ("row", "srow", "offset")}


def _write_tables(where: str, tables: dict, stamp: dict):
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
                pq.write_table(table, handle, use_dictionary=[c for c in table.column_names if c not in delta],
                               column_encoding={c: "DELTA_BINARY_PACKED" for c in delta})
            os.replace(path + tag, path)
        written.append(stamp_path + tag)
        with open(stamp_path + tag, "w") as handle:
            json.dump(stamp, handle)
        os.replace(stamp_path + tag, stamp_path)
    finally:
        for tmp in written:  # a full disk must not leave half-written temp files behind
            if os.path.exists(tmp):
                os.unlink(tmp)


# Worker processes that index small passes (decode steps: per-tensor Python work, little reading)
# and hash large ones in pieces, when a build has work enough for them (analyzer/workers.py: they
# never import the caller's main module, so a library caller gets them too). None: as
# index_processes() says; a number overrides it (tests).
INDEX_PROCESSES: Optional[int] = None


def index_processes() -> int:
    """How many worker processes an index build may start: DUMPDIFF_INDEX_PROCESSES (0 turns them
    off), else the CPU count less one, at most 8. Raises DumpError for a bad setting."""
    if INDEX_PROCESSES is not None:
        return INDEX_PROCESSES
    setting = env_count("DUMPDIFF_INDEX_PROCESSES")
    return setting if setting is not None else min(max((os.cpu_count() or 1) - 1, 0), 8)
