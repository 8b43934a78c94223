"""Building a dump's index: every committed pass read once, sequentially, its tensor rows hashed
while the next bytes are read. Small passes (decode steps) are indexed in worker processes or a
side thread while the large ones stream from disk. Reading a saved index (analyzer/index/store.py)
imports none of this."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import math
import queue
import sys
import threading
from typing import Dict, List, Optional

import numpy as np

from ..dump.layout import usable_layout
from ..dump.load import Dump, PassFile, show
from ..dump.readahead import RangeAdvisor, will_need
from ..errors import DumpError
from . import arrow as arrowbuild
from .batches import chunks
from .files import TABLES
from .fingerprint import row_stats
from .passtables import ENCODED, pass_tables, stored_tensors
from .rowplan import may_hold_token_ids, pass_rows, row_columns
from .rows import FileEnded, read_exactly
from .settings import hash_threads, index_processes
from .smallpass import small_pass_tables
from .workers import WorkerPool

PASSES_PER_PROCESS = 16  # fewer small passes per worker than this: start-up costs more than it saves


def _process_pool(n_small: int, large_bytes: int):
    workers = min(index_processes(), max(n_small // PASSES_PER_PROCESS, large_bytes // (2 * PIECE_BYTES)))
    if workers < 2:
        return None
    try:
        pool = WorkerPool(workers, __name__)
    except OSError as exc:  # no process support here (a sandbox, an odd install): threads do it
        logging.getLogger("dumpdiff").warning("indexing on threads alone: %s", exc)
        return None
    logging.getLogger("dumpdiff").info("indexing in %d worker processes", workers)
    return pool


def _start_in_processes(small_refs: dict, advance, large_refs: dict):
    """(pool, futures of the small passes, pieces of the large ones) indexing in worker
    processes, or (None, None, {}) when there is too little work or processes cannot be started
    here (then threads do it). A large pass is hashed in pieces of about PIECE_BYTES of its
    tensors, each in a worker: per-row hashing holds the GIL, so threads of one process take
    turns. Pieces: position -> (its PassFile, its tensors' metadata, [(future, bytes)])."""
    pool = _process_pool(len(small_refs), sum(ref.nbytes for ref in large_refs.values()))
    if pool is None:
        return None, None, {}
    try:
        pieces = {i: _submit_pieces(pool, ref) for i, ref in large_refs.items()}  # first: the longest work
        futures = {i: pool.submit(_index_small_pass, ref, ahead) for i, ref, ahead in _with_read_ahead(small_refs)}
    except concurrent.futures.BrokenExecutor:  # a worker died already: threads do it
        pool.shutdown(wait=True, cancel_futures=True)
        return None, None, {}
    except BaseException:  # a damaged large pass: no piece already submitted is worked on for nothing
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    for i, future in futures.items():
        future.add_done_callback(lambda f, n=small_refs[i].nbytes: f.cancelled() or advance(n))
    return pool, futures, {i: piece for i, piece in pieces.items() if piece is not None}


PIECE_BYTES = 64 << 20  # a large pass goes to worker processes in pieces of about this many tensor bytes


def _submit_pieces(pool, ref):
    """(PassFile, tensor metadata, [(future, bytes)]) of a large pass hashed in pieces by the
    pool, or None when its header is not one this reader follows (safetensors reads it then)."""
    pf = PassFile(ref)
    tensor_metas, stored_names = stored_tensors(pf)
    layout = usable_layout(pf, stored_names)
    if layout is None:
        return None
    order = sorted(stored_names, key=lambda n: layout.get(n)[2])
    sizes = [layout.get(n)[3] - layout.get(n)[2] for n in order]
    return (
        pf,
        tensor_metas,
        [
            (pool.submit(_index_piece, ref, [order[i] for i in piece]), sum(sizes[i] for i in piece))
            for piece in chunks(sizes, PIECE_BYTES)
        ],
    )


_opened: Dict[str, PassFile] = {}


def _index_piece(ref, names: List[str]) -> Dict[str, tuple]:
    """A worker process's job: the row columns of some tensors of a large pass."""
    global READ_AHEAD_BYTES
    READ_AHEAD_BYTES = min(READ_AHEAD_BYTES, PIECE_BYTES)  # several workers read at once: each holds less
    pf = _opened.get(ref.path)
    if pf is None:  # the pieces of one pass mostly go to the same few workers: its metadata is parsed once
        _opened.clear()
        pf = _opened[ref.path] = PassFile(ref)
    tokens = pf.meta["tokens"]
    return _stored_rows(pf, len(tokens["ids"]), np.asarray(tokens["valid"], dtype=bool), names)


def _index_small_pass(ref, ahead: List[str]) -> Dict[str, dict]:
    """A worker process's job: one small pass's table columns."""
    will_need(ahead)
    return index_pass(PassFile(ref, whole=True, buffer_for=_reused_buffer))


_scratch = threading.local()


def _reused_buffer(nbytes: int) -> np.ndarray:
    """This thread's buffer for whole small pass files, grown as needed. A fresh buffer per file
    costs the kernel zeroing every page of it (as much CPU as copying the file in); the tables
    keep nothing that points into it, so the next pass on this thread reuses it."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _scratch.buffer = np.empty(max(nbytes, 2 * len(buffer) if buffer is not None else 0), dtype=np.uint8)
    return buffer


# Small passes are read one file at a time by the thread indexing them, which would wait on each
# cold read while the large passes stream: the kernel is asked to read the next few ahead.
SMALL_READ_AHEAD = 16


def _with_read_ahead(small_refs: dict):
    """(position, ref, the files to ask the kernel for when its indexing starts), in order."""
    paths = [ref.path for ref in small_refs.values()]
    for k, (i, ref) in enumerate(small_refs.items()):
        yield (
            i,
            ref,
            paths[1 : 1 + SMALL_READ_AHEAD] if k == 0 else paths[k + SMALL_READ_AHEAD : k + SMALL_READ_AHEAD + 1],
        )


def build_many(dumps: List[Dump], progress: bool = True, on_built=None) -> List[dict]:
    """The five tables of each dump as pyarrow Tables (no pandas: importing it costs more than
    indexing a decode step's worth of passes). ``on_built(k, tables)`` is called, on another
    thread, as soon as dump k's tables are made, while later dumps are still being indexed."""
    refs = [(k, ref) for k, dump in enumerate(dumps) for rank in dump.ranks.values() for ref in rank.passes]
    bar = _progress(sum(ref.nbytes for _, ref in refs), f"indexing {', '.join(show(d.label) for d in dumps)}", progress)
    lock = threading.Lock()  # bytes are reported from the hashing threads

    def one(i, ref):
        counted = [0]

        def advance(nbytes: int) -> None:
            with lock:
                counted[0] += nbytes
                bar.update(nbytes)

        if i in pieces:  # hashed by worker processes: its pieces' rows are gathered here
            pf, tensor_metas, futures = pieces[i]

            def gathered(pf, n_rows, valid, on_bytes):
                stored_rows = {}
                for future, nbytes in futures:
                    stored_rows.update(future.result())
                    on_bytes(nbytes)
                return pass_tables(pf.meta["calls"], tensor_metas, stored_rows)

            tables = index_pass(pf, on_bytes=advance, tensor_tables=gathered)
        else:
            whole = ref.nbytes < INLINE_PASS_BYTES
            tables = index_pass(
                PassFile(ref, whole=whole, buffer_for=_reused_buffer if whole else None), on_bytes=advance
            )
        with lock:
            bar.update(max(ref.nbytes - counted[0], 0))  # the header and metadata
        return tables

    # Small passes (decode steps: per-tensor Python work, little reading) are indexed while the
    # large ones stream from disk (one after the other, the disk would idle): by worker processes
    # when there are many (the work holds the GIL), else by a second thread.
    small_refs = {i: ref for i, (_, ref) in enumerate(refs) if ref.nbytes < INLINE_PASS_BYTES}
    large_refs = {i: ref for i, (_, ref) in enumerate(refs) if ref.nbytes >= INLINE_PASS_BYTES}
    side, small, pieces = _start_in_processes(small_refs, lambda n: _locked(lock, bar.update, n), large_refs)
    if side is None:
        side = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumpdiff-index-small")
        small = {
            i: side.submit(lambda i, ref, ahead: will_need(ahead) or one(i, ref), i, ref, ahead)
            for i, ref, ahead in _with_read_ahead(small_refs)
        }
    finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumpdiff-index-tables")

    def finish(k: int, parts: list) -> dict:
        tables = _tables_of([small[i].result() if part is None else part for i, part in parts])
        if on_built is not None:
            on_built(k, tables)
        return tables

    try:
        finishing = []
        for k in range(len(dumps)):  # a dump's tables are made (and saved) while the next one streams
            parts = [(i, None if i in small else one(i, ref)) for i, (j, ref) in enumerate(refs) if j == k]
            finishing.append(finisher.submit(finish, k, parts))
        built = [future.result() for future in finishing]
    except concurrent.futures.BrokenExecutor as exc:  # a worker process was killed (out of memory?)
        raise DumpError(
            f"a worker process indexing the dumps died ({exc}); if the system is short "
            "of memory, rerun with DUMPDIFF_INDEX_PROCESSES=0 (one process) or 2"
        ) from None
    finally:
        for future in [*small.values(), *(f for _, _, done in pieces.values() for f, _ in done)]:
            future.cancel()  # after an error: no pass is indexed for nothing
        side.shutdown(wait=True, cancel_futures=True)
        finisher.shutdown(wait=True, cancel_futures=True)
        _read_buffers.clear()  # a library caller's process does not keep them after the build
        _scratch.__dict__.pop("buffer", None)
    bar.close()
    return built


def _tables_of(parts: List[dict]) -> dict:
    return {
        name: arrowbuild.table(arrowbuild.concat([part[name] for part in parts]), encode=ENCODED.get(name, ()))
        for name in TABLES
    }


def _progress(total: int, desc: str, enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return _NoBar()  # as tqdm would be (disable=None: off when stderr is no terminal), without its 25 ms import
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def index_pass(pf: PassFile, on_bytes=None, tensor_tables=None) -> Dict[str, dict]:
    """The five tables' columns (arrowbuild columns) for one pass file; ``on_bytes(n)`` reports
    tensor bytes as they are done; ``tensor_tables(pf, n_rows, valid, on_bytes)`` makes the calls,
    tensors and rows tables of a large pass (default: read here, tensor by tensor)."""
    meta, ref = pf.meta, pf.ref
    tokens = meta["tokens"]
    n_rows = len(tokens["ids"])
    if not all(len(tokens.get(k, ())) == n_rows for k in ("pos", "seq", "valid")):
        raise DumpError(f"{show(ref.path)}: token lists of unequal length in the pass metadata; the file is damaged")
    seqs = meta.get("seqs", [])
    valid = np.asarray(tokens["valid"], dtype=bool)
    tables = {
        "tokens": {
            "row": np.arange(n_rows, dtype=np.int32),
            "seq": list(tokens["seq"]),
            "pos": np.asarray(tokens["pos"], dtype=np.int64),
            "id": np.asarray(tokens["ids"], dtype=np.int64),
            "valid": valid,
            "mode": [meta.get("mode", "unknown")] * n_rows,
            "step": _repeat(meta.get("step"), n_rows),
        },
        "seqs": {
            "seq": [q["seq"] for q in seqs],
            "first": np.array([q["rows"][0] for q in seqs], dtype=np.int64),
            "end": np.array([q["rows"][1] for q in seqs], dtype=np.int64),
            "prefix_ids": [json.dumps(q["prefix_ids"]) if "prefix_ids" in q else None for q in seqs],
        },
    }
    small = (
        small_pass_tables(pf, n_rows, valid, on_bytes)
        if ref.nbytes < INLINE_PASS_BYTES and tensor_tables is None
        else None
    )
    tables.update(small or (tensor_tables or _tensor_by_tensor)(pf, n_rows, valid, on_bytes))
    for table in tables.values():  # every table says whose rows it holds
        n = arrowbuild.length(next(iter(table.values())))
        table["rank"], table["pass"] = _repeat(ref.rank, n), _repeat(ref.pass_id, n)
    return tables


def _tensor_by_tensor(pf: PassFile, n_rows: int, valid: np.ndarray, on_bytes=None) -> Dict[str, dict]:
    """The calls, tensors and rows tables of a large pass: every stored tensor is read once and
    hashed by a pool of threads (see _stored_rows)."""
    tensor_metas, stored_names = stored_tensors(pf)
    return pass_tables(
        pf.meta["calls"], tensor_metas, _stored_rows(pf, n_rows, valid, stored_names, on_bytes, tensor_metas)
    )


def _stored_rows(
    pf: PassFile, n_rows: int, valid: np.ndarray, stored_names: List[str], on_bytes=None, tensor_metas=None
) -> Dict[str, tuple]:
    """Stored tensor name -> (row columns, why it has no token rows, whether it holds the token ids),
    for the named tensors of a pass. A tensor whose rows lie in order in the file (nearly all) is
    streamed by one hashing thread a block of rows at a time, the kernel reading ahead; the rest
    are read whole by a read-ahead thread and hashed while the next are read."""
    tensor_metas = tensor_metas if tensor_metas is not None else stored_tensors(pf)[0]
    token_ids = pf.meta["tokens"]["ids"]
    plans = pass_rows(pf.meta, n_rows, valid)
    layout = usable_layout(pf, stored_names)
    streamed = {}
    if layout is not None:
        streamed = {
            name: plan
            for name, plan in ((n, _plan_in_blocks(pf, plans, n, tensor_metas[n], layout)) for n in stored_names)
            if plan is not None
        }
    whole = [n for n in stored_names if n not in streamed]
    advisor = RangeAdvisor(pf.ref.path, STREAM_AHEAD_BYTES) if streamed else None

    def stream(name):
        return _rows_in_blocks(pf, name, streamed[name], layout.get(name), token_ids, on_bytes, advisor)

    def work(stored, tensor, dtype, begin, release):
        try:
            plan = plans.plan(pf.ref.path, stored, tensor_metas[stored], tensor.shape)
            view = plan.rows(tensor)
            return row_columns(plan, view, dtype, row_stats(view, dtype), token_ids, begin)
        finally:
            release()

    stored_rows: Dict[str, tuple] = {}
    in_order = sorted(streamed, key=lambda n: layout.get(n)[2])
    try:
        if hash_threads() <= 1:
            for name in in_order:
                stored_rows[name] = stream(name)
            for stored, tensor, dtype, begin, release in read_tensors(pf, whole, on_bytes, layout):
                stored_rows[stored] = work(stored, tensor, dtype, begin, release)
                del tensor
            return stored_rows
        pending: "collections.deque" = collections.deque(
            (name, _tensor_pool().submit(stream, name)) for name in in_order
        )
        try:
            for stored, tensor, dtype, begin, release in read_tensors(pf, whole, on_bytes, layout):
                pending.append((stored, _tensor_pool().submit(work, stored, tensor, dtype, begin, release)))
                del tensor
                while pending and pending[0][1].done():
                    done, future = pending.popleft()
                    stored_rows[done] = future.result()
            while pending:
                done, future = pending.popleft()
                stored_rows[done] = future.result()
        finally:
            for _, future in pending:  # after an error: let no task outlive this pass
                future.cancel()
            concurrent.futures.wait([future for _, future in pending])
        return stored_rows
    finally:
        if advisor is not None:
            advisor.close()


# Rows are read this many bytes of whole rows at a time (one row, if wider) into a buffer of the
# hashing thread's: it stays in the CPU's cache between the copy from the page cache and the
# hashing. On the 2-core VM, reading a 3 GB prefill so against reading each tensor whole into
# buffers up to 256 MB ahead: cold 1.7-2.2 vs 0.6-1.0 GB/s, a third of the kernel CPU; warm 7.3-8.1 vs
# 4.5-5.3 GB/s (interleaved runs).
ROW_BLOCK_BYTES = 2 << 20
STREAM_AHEAD_BYTES = 64 << 20  # the kernel is asked to read this far beyond the streamed reads


def _plan_in_blocks(pf: PassFile, plans, name: str, tmeta: dict, layout):
    """The row plan of a tensor read a block of rows at a time, or None to read it whole: rows not
    consecutive runs of its bytes (token dims that do not lead), no rows, or possibly the token
    ids (checked against the whole tensor)."""
    dtype, shape, begin, end = layout.get(name)
    if end == begin:
        return None
    plan = plans.plan(pf.ref.path, name, tmeta, shape)
    if not (plan.by_token and plan.contiguous and plan.view_shape[0]) or may_hold_token_ids(plan, dtype):
        return None
    return plan


def _rows_in_blocks(pf: PassFile, name: str, plan, entry, token_ids, on_bytes=None, advisor=None) -> tuple:
    """A tensor's row columns, its bytes read ROW_BLOCK_BYTES of whole rows at a time into one
    reused buffer: memory stays bounded whatever the tensor's size; each row's figures are those
    of the whole tensor's. ``advisor``: told each read's range, to have the kernel read ahead."""
    dtype, shape, begin, end = entry
    n_view = plan.view_shape[0]
    width = math.prod(plan.view_shape[1:]) * dtype.size
    per_block = max(1, ROW_BLOCK_BYTES // max(width, 1))
    firsts = list(range(0, n_view, per_block))
    cuts = np.searchsorted(plan.srow, firsts + [n_view]).tolist()  # each block's kept rows: a run of srow
    buffer = _read_buffers.take(min(per_block, n_view) * width)
    parts = []
    try:
        with _open_pass(pf) as handle:
            for block, first in enumerate(firsts):
                last = min(first + per_block, n_view)
                nbytes = (last - first) * width
                if advisor is not None:
                    advisor.reach(begin + first * width, begin + last * width)
                _read_range(handle, begin + first * width, buffer[:nbytes], pf, name)
                rows = buffer[:nbytes].view(dtype.bits).reshape((last - first,) + tuple(plan.view_shape[1:]))
                kept = plan.srow[cuts[block] : cuts[block + 1]] - first
                parts.append(row_stats(rows if len(kept) == last - first else rows[kept], dtype))
                if on_bytes:
                    on_bytes(nbytes)
    finally:
        _read_buffers.give(buffer)
    fps, amax, nonfinite = zip(*parts)
    stats = (np.concatenate(fps), None if amax[0] is None else np.concatenate(amax), np.concatenate(nonfinite))
    return row_columns(plan, None, dtype, stats, token_ids, begin)


def _open_pass(pf: PassFile):
    try:
        return open(pf.ref.path, "rb", buffering=0)
    except OSError as exc:
        raise DumpError(f"{show(pf.ref.path)}: cannot read ({exc}); the file is damaged") from None


def _read_range(handle, at: int, into: np.ndarray, pf: PassFile, name: str) -> None:
    """Fill ``into`` with the file's bytes from ``at``; the file ending first is a truncated file."""
    try:
        read_exactly(handle.fileno(), into, at)
    except FileEnded:
        raise DumpError(f"{show(pf.ref.path)}: ends inside tensor {name!r}; the file is truncated") from None
    except OSError as exc:
        raise DumpError(f"{show(pf.ref.path)}: cannot read ({exc}); the file is damaged") from None


def _locked(lock, func, *args) -> None:
    with lock:
        func(*args)


def _repeat(value: Optional[int], n: int) -> np.ndarray:
    return np.full(n, -1 if value is None else value, dtype=np.int64)


# --- reading pass files for the index: sequential, read ahead, bounded memory --------------------
READ_AHEAD_BYTES = 256 << 20  # tensor bytes read ahead of the hashing (one tensor is always allowed)
POOLED_BYTES = READ_AHEAD_BYTES // 4  # larger read buffers are not kept for reuse
INLINE_PASS_BYTES = 32 << 20  # smaller pass files are hashed by the calling thread alone
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _tensor_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=hash_threads(), thread_name_prefix="dumpdiff-index"
            )
        return _pool


class _ReadBuffers:
    """Read buffers let go of, kept for the next tensors and passes of a build (at most
    READ_AHEAD_BYTES, none over POOLED_BYTES: a huge one, the logits, would crowd out the rest;
    the smallest let go first).
    A fresh buffer costs the kernel zeroing each page, as much CPU as reading into it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: List[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        if buffer.nbytes > POOLED_BYTES:
            return
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._free) > READ_AHEAD_BYTES:
                self._free.pop(0)  # the smallest go first: a larger buffer serves any smaller tensor

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_read_buffers = _ReadBuffers()


def read_tensors(pf: PassFile, names: List[str], on_bytes=None, layout=None):
    """Yield (name, bits, DType, first byte in the file or None, release) for every name, in file order. A thread reads ahead with
    plain sequential reads (no memory map: the page cache is not charged to this process), so
    reading overlaps hashing. ``release()`` says the tensor is done with: its buffer is reused,
    and at most READ_AHEAD_BYTES (or one tensor) are held between a read and its release.
    ``layout``: the file's, when the caller has it already."""
    layout = usable_layout(pf, names, layout)
    if layout is None:
        for name in names:  # safetensors reads them and names what is wrong with the file
            tensor, dtype = pf.bits(name)
            yield name, tensor, dtype, None, (lambda nbytes=tensor.nbytes: on_bytes and on_bytes(nbytes))
        return
    order = sorted(names, key=lambda n: layout.get(n)[2])
    results: "queue.Queue" = queue.Queue()
    state = {"held": 0, "stop": False}
    cond = threading.Condition()

    def reader() -> None:
        try:
            with _open_pass(pf) as handle:
                for name in order:
                    dtype, shape, begin, end = layout.get(name)
                    nbytes = end - begin
                    with cond:
                        while state["held"] and state["held"] + nbytes > READ_AHEAD_BYTES and not state["stop"]:
                            cond.wait()
                        if state["stop"]:
                            return
                        buffer = _read_buffers.take(nbytes)
                        state["held"] += buffer.nbytes  # what it holds, not the tensor: a reused buffer may be larger
                    _read_range(handle, begin, buffer[:nbytes], pf, name)
                    tensor = (
                        buffer[:nbytes].view(dtype.bits).reshape(shape) if nbytes else np.empty(shape, dtype=dtype.bits)
                    )
                    results.put((name, tensor, dtype, begin, nbytes, buffer, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            results.put((None, None, None, None, 0, None, exc))

    thread = threading.Thread(target=reader, name="dumpdiff-index-read", daemon=True)
    thread.start()
    try:
        for _ in order:
            name, tensor, dtype, begin, nbytes, buffer, error = results.get()
            if error is not None:
                if isinstance(error, OSError):
                    raise DumpError(f"{show(pf.ref.path)}: cannot read ({error}); the file is damaged") from None
                raise error

            def release(nbytes=nbytes, buffer=buffer, released=[]) -> None:  # noqa: B006 - one list per tensor
                # the consumer keeps nothing pointing into it; given back twice, it would be
                # handed out to two tensors at once
                if released:
                    raise RuntimeError("a read buffer was released twice")
                released.append(True)
                _read_buffers.give(buffer)
                with cond:
                    state["held"] -= buffer.nbytes
                    cond.notify_all()
                if on_bytes:
                    on_bytes(nbytes)

            yield name, tensor, dtype, begin, release
            del tensor
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        thread.join()
