"""Background writer: one atomic safetensors file per forward pass, a fsynced manifest journal.

The forward pass only hands over tensors already copied off the live buffers; this thread
moves them to the host, writes ``.tmp`` files, renames them into place and only then appends
the manifest line. A reader trusts the manifest alone, so a crash at any instant leaves either
a whole pass or no pass. Memory is bounded: ``submit`` blocks (back-pressure) while more than
``queue_bytes`` wait. Disk trouble (limit reached, free-space floor, ENOSPC) stops dumping with
one loud log line and an INCOMPLETE marker; the model process keeps running.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from typing import Callable, Dict, Optional

import torch

from . import format as fmt
from . import stfile
from .metajson import MetaJson

log = logging.getLogger("dumper")


@dataclasses.dataclass
class PassRecord:
    exp_dir: str
    rank: int
    meta: dict
    tensors: Dict[str, torch.Tensor]
    ready: Optional[object] = None  # a CUDA event to wait on before reading host copies
    nbytes: int = 0
    cleanup: bool = False  # DUMPER_CLEANUP_PREVIOUS: empty the rank folder once its lock is held
    finish: bool = False  # not a pass: close the experiment's rank folders (see PassWriter.finish)
    # run by the writer once ``ready`` is reached: the tensors to write, made from ``tensors`` (a
    # graph replay's host copy: padding trimmed, rows selected)
    prepare: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None


LOCK_FILE = ".lock"  # held (flock) by the one writer of a rank folder; its text says whether it closed


class _RankJournal:
    """The open manifest of one (experiment, rank) folder, held under an exclusive lock.

    The lock file also tells readers whether the writer closed cleanly: it holds
    "writing pid=<pid>" while a process writes and "closed" after ``close``, so a dump whose
    writer was killed says so (readers report that passes may be missing).
    """

    def __init__(self, rank_dir: str, cleanup: bool = False) -> None:
        os.makedirs(rank_dir, exist_ok=True)
        self.rank_dir = rank_dir
        self.meta_json = MetaJson()  # this folder's passes, in order: equal calls reuse their JSON
        self.lock_file = open(os.path.join(rank_dir, LOCK_FILE), "a+")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.seek(0)
            holder = self.lock_file.read(100).strip()
            self.lock_file.close()
            raise WriterBusy(
                f"another process ({holder}) is writing {rank_dir}; its dump is left untouched; "
                "give this run its own DUMPER_EXP_NAME"
            ) from None
        try:
            self._set_state(f"writing pid={os.getpid()}")
            if cleanup:  # only now, under the lock: a live writer's folder is never wiped
                for name in os.listdir(rank_dir):
                    if name != LOCK_FILE:
                        os.unlink(os.path.join(rank_dir, name))
            self.manifest_path = os.path.join(rank_dir, fmt.MANIFEST_FILE)
            self.next_pass, self.passes_found = _recover(rank_dir, self.manifest_path)
            self.manifest = os.open(self.manifest_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # & ~umask
            self.dir_fd = os.open(rank_dir, os.O_RDONLY)
        except BaseException:
            self.lock_file.close()  # e.g. a full disk: release the folder for a later try
            raise

    def _set_state(self, text: str) -> None:
        self.lock_file.truncate(0)
        self.lock_file.write(text + "\n")
        self.lock_file.flush()

    def commit(self, line: bytes) -> None:
        """Make a renamed pass file durable, then append its manifest line: the whole line or none."""
        os.fsync(self.dir_fd)  # the rename reaches the disk before the line that names the file
        start = os.fstat(self.manifest).st_size
        try:
            view = memoryview(line)
            while view:  # a short write (disk full) must not leave a torn line
                view = view[os.write(self.manifest, view) :]
            os.fsync(self.manifest)
        except BaseException:
            try:
                os.ftruncate(self.manifest, start)  # a later append must never glue onto a torn line
            except OSError:
                pass
            raise

    def close(self) -> None:
        os.close(self.manifest)
        os.close(self.dir_fd)
        self._set_state("closed")
        self.lock_file.close()


def _recover(rank_dir: str, manifest_path: str):
    """Continue after passes an earlier process committed to the same folder, cleaning up after
    one that was killed (we hold the lock, so whatever it left uncommitted is garbage): a torn last
    manifest line (no newline) is cut, else the next line would be glued onto it and the manifest
    would become unreadable; temp files and pass files the manifest does not name are removed.
    Returns (next pass id, passes the manifest names)."""
    data = b""
    if os.path.exists(manifest_path):
        with open(manifest_path, "rb") as handle:
            data = handle.read()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("dumper: cut a torn last line from %s (a writer was killed mid-append)", manifest_path)
        os.truncate(manifest_path, keep)
        data = data[:keep]
    last, named = -1, set()
    for line in data.splitlines():
        try:
            entry = json.loads(line)
            last = max(last, int(entry["pass"]))
            named.add(entry["file"])
        except (ValueError, KeyError, TypeError):
            continue  # not ours to judge; readers report it
    for name in os.listdir(rank_dir):
        # ".pass-N.safetensors.tmp" is ours; ".tmpXXXXXX" the temp file safetensors' save_file wrote
        # through when it wrote pass files (a dump of an earlier version may hold one)
        uncommitted = (
            name.startswith(".tmp")
            or name.endswith(".tmp")
            or (name.startswith("pass-") and name.endswith(".safetensors") and name not in named)
        )
        if uncommitted:
            os.unlink(os.path.join(rank_dir, name))
    return last + 1, len(named)


_writers = itertools.count(1)  # several dumpers installed in turn in one process are told apart


class PassWriter:
    def __init__(self, queue_bytes: int, max_bytes: int = 0, min_free_bytes: int = 0) -> None:
        self.queue_bytes = max(queue_bytes, 1)
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.bytes_written = 0
        self.passes_written = 0
        self.stopped_reason: Optional[str] = None
        # Names this writer in each manifest line: a rerun that appends to an experiment (a new
        # server, the same DUMPER_DIR) shows as a second session, which the analyzer reports.
        self.session = f"pid {os.getpid()} writer {next(_writers)} from {time.strftime('%Y-%m-%d %H:%M:%S')}"
        self._pending_bytes = 0
        # Host copies of the pass being captured, per pass object (reserve()); a pass that is
        # abandoned (the forward raised) drops out of this map when it is garbage collected.
        self._capturing: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
        self.peak_pending_bytes = 0  # most host bytes held at once: queued passes + the one being captured
        self.write_seconds = 0.0  # time the writer thread spent writing (throughput = bytes_written / this)
        self._cond = threading.Condition()
        self._queue: "queue.Queue[Optional[PassRecord]]" = queue.Queue()
        self._journals: Dict[str, _RankJournal] = {}
        self._folders_seen: set = set()  # rank folders this writer has opened
        self._run_written: set = set()
        self._run_pending: Dict[str, dict] = {}  # exp_dir -> run.json content, written under the rank lock
        self._closed = False
        # Started by the first submit: a dumper installed with dumping disabled owns no thread.
        self._thread: Optional[threading.Thread] = None
        # A script that ends without remove() must not lose the passes still queued: the writer
        # thread is a daemon (it must never keep an engine alive), so flush and close at exit.
        # Only in this process: a forked child inherits the handler but owns none of the files.
        ref, pid = weakref.ref(self), os.getpid()
        self._at_exit = lambda: ref() is not None and os.getpid() == pid and ref().close()
        atexit.register(self._at_exit)

    # --- producer side (forward pass thread) ---------------------------------------------
    def reserve(self, nbytes: int, owner) -> None:
        """Called by the hooks before copying ``nbytes`` more of the pass ``owner`` off the live
        buffers: waits (back-pressure inside the forward pass) while earlier passes still queued
        and this pass's copies together would exceed queue_bytes. A pass bigger than queue_bytes
        is still admitted, alone: the host memory held never exceeds max(queue_bytes, one pass)."""
        with self._cond:
            held = self._capturing.get(owner, 0)
            while self._pending_bytes and self._pending_bytes + held + nbytes > self.queue_bytes:
                self._cond.wait()
            self._capturing[owner] = held + nbytes
            self._note_peak()

    def _note_peak(self) -> None:
        held = self._pending_bytes + sum(self._capturing.values())
        if held > self.peak_pending_bytes:
            self.peak_pending_bytes = held

    def submit(self, record: PassRecord) -> bool:
        if self.stopped_reason:
            self._release(record)
            return False
        record.nbytes = sum(t.numel() * t.element_size() for t in record.tensors.values())
        self._start()
        with self._cond:
            reserved = self._release(record)
            # Back-pressure: never hold more than queue_bytes, but always admit one pass.
            while not reserved and self._pending_bytes and self._pending_bytes + record.nbytes > self.queue_bytes:
                self._cond.wait()
            self._pending_bytes += record.nbytes
            self._note_peak()
        self._queue.put(record)
        return True

    def _start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dumper-writer", daemon=True)
                self._thread.start()

    def _release(self, record: PassRecord) -> bool:
        """Forget the reservation of the pass whose tensors ``record`` carries; True if it had one."""
        with self._cond:
            for owner in list(self._capturing.keys()):
                if getattr(owner, "tensors", None) is record.tensors:
                    del self._capturing[owner]
                    self._cond.notify_all()
                    return True
        return False

    def flush(self) -> None:
        """Block until every submitted pass is committed (or dropped after a stop)."""
        self._queue.join()

    def finish(self, exp_dir: str) -> None:
        """Commit what is queued and close the experiment's rank folders ("closed" in the lock
        file), so readers know the dump is whole; a later pass to it simply reopens it. Done on
        the writer thread, in queue order: no pass file is ever closed under a write."""
        if self._thread is None:
            return  # nothing was ever written
        self._queue.put(PassRecord(exp_dir, -1, {}, {}, finish=True))
        self.flush()

    def _finish_now(self, exp_dir: str) -> None:
        prefix = os.path.join(exp_dir, "")
        for rank_dir in [d for d in self._journals if d.startswith(prefix)]:
            self._journals.pop(rank_dir).close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        for journal in self._journals.values():
            journal.close()
        self._journals.clear()

    def write_run_info(self, exp_dir: str, make_info: Callable[[], dict]) -> None:
        """run.json once per experiment folder, its contents made only then (they walk the model).
        The writer thread writes it only once it holds the rank folder's lock, so a second process
        started on the same experiment by mistake never overwrites the run.json of the one that
        owns it."""
        if exp_dir in self._run_written:
            return
        self._run_written.add(exp_dir)
        self._run_pending[exp_dir] = make_info()

    def _write_run_file(self, exp_dir: str, info: dict) -> None:
        # atomic: ranks of one run write the same file concurrently and must never tear it
        path = os.path.join(exp_dir, fmt.RUN_FILE)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "w") as handle:
                json.dump(info, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # --- writer thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                if record.finish:
                    self._finish_now(record.exp_dir)
                elif not self.stopped_reason:
                    start = time.perf_counter()
                    self._write(record)
                    self.write_seconds += time.perf_counter() - start
            except WriterBusy as exc:
                self._stop(None, str(exc))  # the folder belongs to another process: mark nothing there
            except Exception as exc:  # noqa: BLE001 - a dump failure must not kill the engine
                said = (
                    str(exc) if isinstance(exc, _BudgetExceeded) else f"{type(exc).__name__}: {exc}"
                )  # ours say it all
                self._stop(record.exp_dir if record else None, said)
            finally:
                if record is not None:
                    with self._cond:
                        self._pending_bytes -= record.nbytes
                        self._cond.notify_all()
                self._queue.task_done()

    def _write(self, record: PassRecord) -> None:
        if record.ready is not None:
            record.ready.synchronize()
        rank_dir = os.path.join(record.exp_dir, fmt.rank_dir_name(record.rank))
        journal = self._journals.get(rank_dir)
        if journal is not None and record.cleanup:
            self._journals.pop(rank_dir).close()
            journal = None
        if journal is None:
            journal = self._journals[rank_dir] = _RankJournal(rank_dir, cleanup=record.cleanup)
            self._note_earlier_passes(rank_dir, journal.passes_found)
        pass_id = journal.next_pass
        meta = dict(record.meta, **{"pass": pass_id})
        meta_escaped = journal.meta_json.dumps_escaped(meta)
        tensors = record.prepare(record.tensors) if record.prepare is not None else record.tensors
        tensors = {name: t.cpu() if t.device.type != "cpu" else t for name, t in tensors.items()}
        # Before writing: the tensor bytes alone must fit the limit, and the file at its largest
        # (the header holds the metadata JSON escaped, plus one entry per tensor) the floor.
        self._check_limit(record.nbytes)
        self._check_floor(rank_dir, record.nbytes + len(meta_escaped) + 256 * (len(tensors) + 1))
        run_info = self._run_pending.pop(record.exp_dir, None)
        if run_info is not None:
            self._write_run_file(record.exp_dir, run_info)
        name = fmt.pass_file_name(pass_id)
        final = os.path.join(rank_dir, name)
        tmp = os.path.join(rank_dir, f".{name}.tmp")
        try:
            with open(tmp, "wb") as handle:
                stfile.write(handle, tensors, {fmt.PASS_META_KEY: meta_escaped})
                handle.flush()
                os.fsync(handle.fileno())
            size = os.path.getsize(tmp)
            self._check_limit(size)  # exact now: DUMPER_MAX_BYTES counts real file sizes, headers included
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        line = {
            "pass": pass_id,
            "file": name,
            "bytes": size,
            "tensors": len(tensors),
            "mode": meta.get("mode"),
            "rows": len(meta.get("tokens", {}).get("ids", [])),
            "step": meta.get("step"),
            "time": round(time.time(), 3),
            "session": self.session,
        }
        try:
            journal.commit((json.dumps(line) + "\n").encode())
        except BaseException:
            os.unlink(final)  # not in the manifest, so not in the dump: do not leave it lying there
            raise
        journal.next_pass += 1
        self.bytes_written += size
        self.passes_written += 1

    def _note_earlier_passes(self, rank_dir: str, passes_found: int) -> None:
        """Warn once per folder when it holds passes this writer did not commit: the new ones would
        join an earlier run's dump (two prefills of one prompt in one dump) without a word. A folder
        this writer wrote to and reopens (exp_name switched away and back) holds only its own."""
        if passes_found and rank_dir not in self._folders_seen:
            log.warning(
                "dumper: %s already holds %d pass%s from an earlier run; new passes are appended "
                "(DUMPER_CLEANUP_PREVIOUS=1 or a new exp_name starts afresh)",
                rank_dir,
                passes_found,
                "" if passes_found == 1 else "es",
            )
        self._folders_seen.add(rank_dir)

    def _check_limit(self, nbytes: int) -> None:
        if self.max_bytes and self.bytes_written + nbytes > self.max_bytes:
            raise _BudgetExceeded(
                f"DUMPER_MAX_BYTES={self.max_bytes} reached: {self.bytes_written} bytes written, "
                f"the next pass needs {nbytes}"
            )

    def _check_floor(self, rank_dir: str, coming: int) -> None:
        if not self.min_free_bytes:
            return  # no floor: write until the disk says no (ENOSPC stops dumping just as cleanly)
        free = shutil.disk_usage(rank_dir).free
        if free - coming < self.min_free_bytes:
            raise _BudgetExceeded(
                f"only {free} bytes free on the disk of {rank_dir}; the next pass (up to {coming} "
                f"bytes) would go below DUMPER_MIN_FREE_BYTES={self.min_free_bytes}"
            )

    def _stop(self, exp_dir: Optional[str], reason: str) -> None:
        self.stopped_reason = reason
        log.error("dumper: DUMPING STOPPED, dump is incomplete: %s (the model keeps running)", reason)
        if exp_dir:
            try:
                with open(os.path.join(exp_dir, fmt.INCOMPLETE_FILE), "a") as handle:
                    handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {reason}\n")
            except OSError:
                pass  # the disk may be the very thing that is full; the log line stands


class _BudgetExceeded(RuntimeError):
    pass


class WriterBusy(RuntimeError):
    """Another live process holds the lock of the rank folder this writer was pointed at."""
