"""The parquet index of a dump: one row per tensor row-slice with its fingerprint.

Built once per dump by reading every committed pass a single time; later questions ("are these
rows bit-identical?") are answered from the index without touching tensor bytes. Tables, each
a parquet file readable by pandas or duckdb:

    tokens.parquet   rank, pass, row, seq, pos, id, valid, mode, step   (one per token row)
    seqs.parquet     rank, pass, seq, first, end, prefix_ids            (one per sequence per pass)
    calls.parquet    rank, pass, call, module, cls, pre, post, skipped  (one per hooked call)
    tensors.parquet  rank, pass, tensor, call, io, slot, dtype, shape, token_dims, rows, stored,
                     selected, is_ids, why                               (one per captured tensor)
    rows.parquet     rank, pass, tensor, row, fp, rowshape, amax, nonfinite, srow
                     (one per token row of each tensor; row -1 = a tensor without token rows)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import signal
import sys
import threading
from typing import Dict, List, Optional

import numpy as np

from . import arrowbuild
from .columns import Columns
from .errors import DumpError
from .filelayout import usable_layout
from .fingerprint import row_stats
from .load import Dump, PassFile, show
from .passtables import ENCODED, pass_tables, stored_tensors
from .rowplan import pass_rows, row_columns
from .smallpass import small_pass_tables

INDEX_VERSION = 5  # 2: XXH3 row fingerprints; 3: exact float64 amax (2 rounded it); 4: written by pyarrow alone;
# 5: text columns dictionary-encoded (ENCODED)
INDEX_DIR = "index"
TABLES = ("tokens", "seqs", "calls", "tensors", "rows")


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
                whole = self._shared[("frame", name)] = _plain_text(self._tables[name].to_pandas(), ENCODED.get(name, ()))
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
    """Inside the dump when writable; else a per-dump folder in the user's cache."""
    inside = os.path.join(dump.path, INDEX_DIR)
    if os.access(dump.path, os.W_OK):
        return inside
    digest = hashlib.sha256(os.path.abspath(dump.path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~/.cache/dumpdiff/index"), digest)


def _stamp(dump: Dump) -> dict:
    """What the index was built from. Size alone is not enough: a re-dump into the same folder
    (DUMPER_CLEANUP_PREVIOUS) writes new files of the same pass ids and sizes, so each file's
    inode and mtime are part of it too, and a stale index is never reused."""
    files = {}
    for r, d in dump.ranks.items():
        files[str(r)] = []
        for p in d.passes:
            st = os.stat(p.path)
            files[str(r)].append([p.pass_id, p.nbytes, st.st_ino, st.st_mtime_ns])
    return {"index_version": INDEX_VERSION, "ranks": files}


def load_index(dump: Dump, rebuild: bool = False, progress: bool = True) -> Index:
    return load_indexes([dump], rebuild, progress)[0]


def load_indexes(dumps: List[Dump], rebuild: bool = False, progress: bool = True, prefetch=None) -> List[Index]:
    """The index of each dump: read when fresh, else built, all missing ones in one build (a
    reference's large prefill streams from disk while a decode run's steps are worked on), and
    saved. ``prefetch``: (table, columns) to start reading in the background as soon as an
    index is opened, while the next one opens."""
    for dump in dumps:
        _warn(dump)
    places = [index_location(dump) for dump in dumps]
    with contextlib.ExitStack() as held:
        folder = _locked_folders(places, held)  # place -> its folder's identity (None: not saved)
        tables: Dict[object, dict] = {}
        todo = {}  # folder -> (dump, where, stamp): one dump given twice (or spelt two ways) is built once
        for dump, where in zip(dumps, places):
            key = folder[where] or where
            if key in tables or key in todo:
                continue
            stamp = _stamp(dump)
            fresh = _read_fresh(where, stamp) if folder[where] and not rebuild else None
            if fresh is not None:
                tables[key] = fresh
                if prefetch and isinstance(fresh.get(prefetch[0]), LazyParquet):
                    fresh[prefetch[0]].prefetch(prefetch[1])
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
        if building:  # (nothing to build: no progress bar, not even its import)
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
            handle = open(os.path.join(where, ".lock"), "a")
        except OSError as exc:  # a full or read-only disk: the comparison needs no saved index
            _unsaved(where, exc)
            found[where] = None
            continue
        stat = os.fstat(handle.fileno())
        found[where] = (stat.st_dev, stat.st_ino)
        if found[where] in handles:
            handle.close()  # locking it again through a second open file would wait for ourselves
        else:
            handles[found[where]] = held.enter_context(handle)
    for identity in sorted(handles):
        fcntl.flock(handles[identity], fcntl.LOCK_EX)
    return found


def _read_fresh(where: str, stamp: dict) -> Optional[dict]:
    try:
        with open(os.path.join(where, "stamp.json")) as handle:
            if json.load(handle) != stamp:
                return None
        # Python's open, not pyarrow's: pyarrow cannot open a path with non-UTF-8 bytes.
        return {n: _read_table(os.path.join(where, f"{n}.parquet"), lazy=n == "rows") for n in TABLES}
    except (OSError, ValueError):
        return None  # absent, stale or damaged: rebuilt


def _unsaved(where: str, exc: OSError):
    logging.getLogger("dumpdiff").warning(
        "warning: could not save the index in %s (%s); it is used from memory and rebuilt next time",
        show(where), exc.strerror or exc)


def _warn(dump: Dump):
    """What the dump lacks (killed writer, disk limit) goes to stderr for every command."""
    for note in dump.warnings():
        logging.getLogger("dumpdiff").warning("warning: %s", note)


def _read_table(path: str, lazy: bool = False):
    import pyarrow.parquet as pq
    if lazy:
        return LazyParquet(path)
    with open(path, "rb") as handle:
        return pq.ParquetFile(handle).read()  # not read_table: its dataset layer imports pandas


class LazyParquet:
    """A parquet table whose columns are read when first asked for: the strict verdict needs 7
    of the rows table's 9 columns. The file stays open, so a rebuild by another process (which
    renames new files into place) cannot change what this one reads."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq
        self._path = path
        self._handle = open(path, "rb")
        self._file = pq.ParquetFile(self._handle)  # reads the footer: a damaged file fails here
        self.column_names = list(self._file.schema_arrow.names)
        self.num_rows = self._file.metadata.num_rows

        self._prefetch: Optional[concurrent.futures.Future] = None
        self._ready: dict = {}  # name -> column read ahead

    def prefetch(self, names):
        """Start reading these columns in the background, all at once (pyarrow decodes them on
        several threads); ``column`` waits for them. Reading them one by one, when asked, is
        serial work the verdict path would otherwise wait for."""
        names = [n for n in names if n in self.column_names and n not in self._ready]
        if self._prefetch is None and names:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dumpdiff-prefetch")
            self._prefetch = pool.submit(self._read, names, True)
            self._prefetch.names = names
            pool.shutdown(wait=False)  # the thread ends with the read

    def column(self, name: str):
        self._settle()
        if name in self._ready:
            return self._ready[name]
        return self._read([name]).column(0)

    def to_pandas(self):
        self._settle()
        return self._read(None).to_pandas()

    def _settle(self):
        """Wait for the read-ahead: one reader of the file at a time."""
        if self._prefetch is not None:
            future, self._prefetch = self._prefetch, None
            self._ready.update(zip(future.names, future.result().columns))

    def _read(self, columns, threads: bool = False):
        try:
            return self._file.read(columns=columns, use_threads=threads)  # threads for the read-ahead only
        except (OSError, ValueError) as exc:
            raise DumpError(f"{show(self._path)}: cannot be read ({exc}); the index is damaged: "
                            "rerun with --rebuild-index") from None


def _write_tables(where: str, tables: dict, stamp: dict):
    """Called under the index lock. The stamp goes first and comes back last, so a build killed
    half-way leaves no stamp and is redone, never trusted; each file is renamed into place whole.
    One file at a time: pyarrow writing Python file objects from several threads crashes (SIGSEGV)
    when the disk fills up."""
    tag = f".tmp.{os.getpid()}"
    stamp_path = os.path.join(where, "stamp.json")
    if os.path.exists(stamp_path):
        os.unlink(stamp_path)
    import pyarrow.parquet as pq
    written = []
    try:
        for name, table in tables.items():
            path = os.path.join(where, f"{name}.parquet")
            written.append(path + tag)
            with open(path + tag, "wb") as handle:
                pq.write_table(table, handle)
            os.replace(path + tag, path)
        written.append(stamp_path + tag)
        with open(stamp_path + tag, "w") as handle:
            json.dump(stamp, handle)
        os.replace(stamp_path + tag, stamp_path)
    finally:
        for tmp in written:  # a full disk must not leave half-written temp files behind
            if os.path.exists(tmp):
                os.unlink(tmp)


# Processes that index small passes (decode steps: per-tensor Python work, little reading) when
# a dump has many. Off (0) unless the command line turns it on: a worker process imports the
# parent's main module, which only an entry point written for it (ours) survives.
INDEX_PROCESSES = 0
PASSES_PER_PROCESS = 16  # fewer small passes per worker than this: start-up costs more than it saves


def allow_index_processes():
    """Let build_many index many small passes in worker processes (the CPU count less one, at
    most 8; DUMPDIFF_INDEX_PROCESSES overrides, 0 turns it off)."""
    global INDEX_PROCESSES
    setting = os.environ.get("DUMPDIFF_INDEX_PROCESSES", "")
    INDEX_PROCESSES = int(setting) if setting.isdigit() else min(max((os.cpu_count() or 1) - 1, 0), 8)


def _process_pool(n_small: int):
    workers = min(INDEX_PROCESSES, n_small // PASSES_PER_PROCESS)
    if workers < 2:
        return None
    try:
        import multiprocessing
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    except (ImportError, OSError, ValueError):  # no process support here (a sandbox): threads do it
        return None
    logging.getLogger("dumpdiff").info("indexing %d small passes in %d worker processes", n_small, workers)
    return pool


def _start_in_processes(small_refs: dict, advance):
    """(pool, futures) indexing the small passes in worker processes, or (None, None) when there
    are too few or processes cannot be started here (then a thread does it)."""
    pool = _process_pool(len(small_refs))
    if pool is None:
        return None, None
    # Workers start with SIGINT blocked: Ctrl-C reaches the whole process group, and a worker
    # still importing would print its own traceback; this process stops them instead.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
    try:
        futures = {i: pool.submit(_index_small_pass, ref, ahead) for i, ref, ahead in _with_read_ahead(small_refs)}
    except (OSError, concurrent.futures.BrokenExecutor):  # processes are started here, not before
        pool.shutdown(wait=True, cancel_futures=True)
        return None, None
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for i, future in futures.items():
        future.add_done_callback(lambda f, n=small_refs[i].nbytes: f.cancelled() or advance(n))
    return pool, futures


def _index_small_pass(ref, ahead: List[str]) -> Dict[str, dict]:
    """A worker process's job: one small pass's table columns."""
    _will_need(ahead)
    return index_pass(PassFile(ref, whole=True))


# Small passes are read one file at a time by the thread indexing them, which would wait on each
# cold read while the large passes stream: the kernel is asked to read the next few ahead.
SMALL_READ_AHEAD = 16


def _with_read_ahead(small_refs: dict):
    """(position, ref, the files to ask the kernel for when its indexing starts), in order."""
    paths = [ref.path for ref in small_refs.values()]
    for k, (i, ref) in enumerate(small_refs.items()):
        yield i, ref, paths[1:1 + SMALL_READ_AHEAD] if k == 0 else paths[k + SMALL_READ_AHEAD:k + SMALL_READ_AHEAD + 1]


def _will_need(paths: List[str]):
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no such hint here: the read itself fetches the file
            pass


def build_many(dumps: List[Dump], progress: bool = True, on_built=None) -> List[dict]:
    """The five tables of each dump as pyarrow Tables (no pandas: importing it costs more than
    indexing a decode step's worth of passes). ``on_built(k, tables)`` is called, on another
    thread, as soon as dump k's tables are made, while later dumps are still being indexed."""
    refs = [(k, ref) for k, dump in enumerate(dumps) for rank in dump.ranks.values() for ref in rank.passes]
    bar = _progress(sum(ref.nbytes for _, ref in refs), f"indexing {', '.join(show(d.label) for d in dumps)}", progress)
    lock = threading.Lock()  # bytes are reported from the hashing threads

    def one(ref):
        counted = [0]

        def advance(nbytes: int):
            with lock:
                counted[0] += nbytes
                bar.update(nbytes)
        tables = index_pass(PassFile(ref, whole=ref.nbytes < INLINE_PASS_BYTES), on_bytes=advance)
        with lock:
            bar.update(max(ref.nbytes - counted[0], 0))  # the header and metadata
        return tables

    # Small passes (decode steps: per-tensor Python work, little reading) are indexed while the
    # large ones stream from disk (one after the other, the disk would idle): by worker processes
    # when there are many (the work holds the GIL), else by a second thread.
    small_refs = {i: ref for i, (_, ref) in enumerate(refs) if ref.nbytes < INLINE_PASS_BYTES}
    side, small = _start_in_processes(small_refs, lambda n: _locked(lock, bar.update, n))
    if side is None:
        side = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumpdiff-index-small")
        small = {i: side.submit(lambda ref, ahead: _will_need(ahead) or one(ref), ref, ahead)
                 for i, ref, ahead in _with_read_ahead(small_refs)}
    finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumpdiff-index-tables")

    def finish(k: int, parts: list) -> dict:
        tables = _tables_of([small[i].result() if part is None else part for i, part in parts])
        if on_built is not None:
            on_built(k, tables)
        return tables
    try:
        finishing = []
        for k in range(len(dumps)):  # a dump's tables are made (and saved) while the next one streams
            parts = [(i, None if i in small else one(ref)) for i, (j, ref) in enumerate(refs) if j == k]
            finishing.append(finisher.submit(finish, k, parts))
        built = [future.result() for future in finishing]
    finally:
        for future in small.values():  # after an error: no pass is indexed for nothing
            future.cancel()
        side.shutdown(wait=True, cancel_futures=True)
        finisher.shutdown(wait=True, cancel_futures=True)
    bar.close()
    return built


def _tables_of(parts: List[dict]) -> dict:
    return {name: arrowbuild.table(arrowbuild.concat([part[name] for part in parts]), encode=ENCODED.get(name, ()))
            for name in TABLES}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=(not enabled) or None, leave=False)


def index_pass(pf: PassFile, on_bytes=None) -> Dict[str, dict]:
    """The five tables' columns (arrowbuild columns) for one pass file; ``on_bytes(n)`` reports
    tensor bytes as they are done."""
    meta, ref = pf.meta, pf.ref
    tokens = meta["tokens"]
    n_rows = len(tokens["ids"])
    if not all(len(tokens.get(k, ())) == n_rows for k in ("pos", "seq", "valid")):
        raise DumpError(f"{show(ref.path)}: token lists of unequal length in the pass metadata; the file is damaged")
    seqs = meta.get("seqs", [])
    valid = np.asarray(tokens["valid"], dtype=bool)
    tables = {
        "tokens": {"row": np.arange(n_rows, dtype=np.int32), "seq": list(tokens["seq"]),
                   "pos": np.asarray(tokens["pos"], dtype=np.int64), "id": np.asarray(tokens["ids"], dtype=np.int64),
                   "valid": valid, "mode": [meta.get("mode", "unknown")] * n_rows,
                   "step": _repeat(meta.get("step"), n_rows)},
        "seqs": {"seq": [q["seq"] for q in seqs], "first": np.array([q["rows"][0] for q in seqs], dtype=np.int64),
                 "end": np.array([q["rows"][1] for q in seqs], dtype=np.int64),
                 "prefix_ids": [json.dumps(q["prefix_ids"]) if "prefix_ids" in q else None for q in seqs]},
    }
    small = small_pass_tables(pf, n_rows, valid, on_bytes) if ref.nbytes < INLINE_PASS_BYTES else None
    tables.update(small or _tensor_by_tensor(pf, n_rows, valid, on_bytes))
    for table in tables.values():  # every table says whose rows it holds
        n = arrowbuild.length(next(iter(table.values())))
        table["rank"], table["pass"] = _repeat(ref.rank, n), _repeat(ref.pass_id, n)
    return tables


def _tensor_by_tensor(pf: PassFile, n_rows: int, valid: np.ndarray, on_bytes=None) -> Dict[str, dict]:
    """The calls, tensors and rows tables of a large pass: every stored tensor is read once, in
    the order its bytes lie in the file, by a read-ahead thread, and hashed by a pool of threads
    while the next tensors are read."""
    tensor_metas, stored_names = stored_tensors(pf)
    stored_rows: Dict[str, tuple] = {}  # stored tensor name -> (row columns, why, is_ids)
    token_ids = pf.meta["tokens"]["ids"]
    plans = pass_rows(pf.meta, n_rows, valid)

    def work(stored, tensor, dtype, release):
        try:
            plan = plans.plan(pf.ref.path, stored, tensor_metas[stored], tensor.shape)
            view = plan.rows(tensor)
            return row_columns(plan, view, dtype, row_stats(view, dtype), token_ids)
        finally:
            release()

    if HASH_THREADS <= 1:
        for stored, tensor, dtype, release in read_tensors(pf, stored_names, on_bytes):
            stored_rows[stored] = work(stored, tensor, dtype, release)
            del tensor
    else:
        pending: "collections.deque" = collections.deque()
        try:
            for stored, tensor, dtype, release in read_tensors(pf, stored_names, on_bytes):
                pending.append((stored, _tensor_pool().submit(work, stored, tensor, dtype, release)))
                del tensor
                while len(pending) > 2 * HASH_THREADS or (pending and pending[0][1].done()):
                    done, future = pending.popleft()
                    stored_rows[done] = future.result()
            while pending:
                done, future = pending.popleft()
                stored_rows[done] = future.result()
        finally:
            for _, future in pending:  # after an error: let no task outlive this pass
                future.cancel()
            concurrent.futures.wait([future for _, future in pending])
    return pass_tables(pf.meta["calls"], tensor_metas, stored_rows)


def _locked(lock, func, *args):
    with lock:
        func(*args)


def _repeat(value: Optional[int], n: int) -> np.ndarray:
    return np.full(n, -1 if value is None else value, dtype=np.int64)


# --- reading pass files for the index: sequential, read ahead, bounded memory --------------------
READ_AHEAD_BYTES = 256 << 20  # tensor bytes read ahead of the hashing (one tensor is always allowed)
INLINE_PASS_BYTES = 32 << 20  # smaller pass files are hashed by the calling thread alone
# Tensors hashed at once (DUMPDIFF_HASH_THREADS; default: the CPU count, at most 8).
HASH_THREADS = max(1, int(os.environ.get("DUMPDIFF_HASH_THREADS", "0") or 0) or min(os.cpu_count() or 1, 8))
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _tensor_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="dumpdiff-index")
        return _pool


def read_tensors(pf: PassFile, names: List[str], on_bytes=None):
    """Yield (name, bits, DType, release) for every name, in file order. A thread reads ahead with
    plain sequential reads (no memory map: the page cache is not charged to this process), so
    reading overlaps hashing. ``release()`` says the tensor is done with: its buffer is reused,
    and at most READ_AHEAD_BYTES (or one tensor) are held between a read and its release."""
    layout = usable_layout(pf, names)
    if layout is None:
        for name in names:  # safetensors reads them and names what is wrong with the file
            tensor, dtype = pf.bits(name)
            yield name, tensor, dtype, (lambda nbytes=tensor.nbytes: on_bytes and on_bytes(nbytes))
        return
    order = sorted(names, key=lambda n: layout.get(n)[2])
    results: "queue.Queue" = queue.Queue()
    state = {"held": 0, "stop": False, "pool": []}  # pool: freed buffers, reused (no fresh pages)
    cond = threading.Condition()

    def take_buffer(nbytes: int) -> np.ndarray:
        with cond:
            pool = state["pool"]
            fits = [i for i, b in enumerate(pool) if nbytes <= b.nbytes <= 2 * nbytes + (1 << 20)]
            if fits:
                return pool.pop(min(fits, key=lambda i: pool[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def reader():
        try:
            with open(pf.ref.path, "rb", buffering=0) as handle:
                for name in order:
                    dtype, shape, begin, end = layout.get(name)
                    nbytes = end - begin
                    with cond:
                        while state["held"] and state["held"] + nbytes > READ_AHEAD_BYTES and not state["stop"]:
                            cond.wait()
                        if state["stop"]:
                            return
                        state["held"] += nbytes
                    buffer = take_buffer(nbytes)
                    handle.seek(begin)
                    view, got = memoryview(buffer)[:nbytes], 0
                    while got < nbytes:
                        n = handle.readinto(view[got:])
                        if not n:
                            raise DumpError(f"{show(pf.ref.path)}: ends inside tensor {name!r}; the file is truncated")
                        got += n
                    tensor = buffer[:nbytes].view(dtype.bits).reshape(shape) if nbytes else \
                        np.empty(shape, dtype=dtype.bits)
                    results.put((name, tensor, dtype, nbytes, buffer, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            results.put((None, None, None, 0, None, exc))

    thread = threading.Thread(target=reader, name="dumpdiff-index-read", daemon=True)
    thread.start()
    try:
        for _ in order:
            name, tensor, dtype, nbytes, buffer, error = results.get()
            if error is not None:
                if isinstance(error, OSError):
                    raise DumpError(f"{show(pf.ref.path)}: cannot read ({error}); the file is damaged") from None
                raise error
            def release(nbytes=nbytes, buffer=buffer):  # the consumer keeps nothing pointing into it
                with cond:
                    state["held"] -= nbytes
                    if sum(b.nbytes for b in state["pool"]) + buffer.nbytes <= READ_AHEAD_BYTES:
                        state["pool"].append(buffer)
                    cond.notify_all()
                if on_bytes:
                    on_bytes(nbytes)

            yield name, tensor, dtype, release
            del tensor
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        thread.join()
