"""Background writer: one atomic safetensors file per forward pass, a fsynced manifest journal.

The forward pass only hands over tensors already copied off the live buffers; this thread
moves them to the host, writes ``.tmp`` files, renames them into place and only then appends
the manifest line. A reader trusts the manifest alone, so a crash at any instant leaves either
a whole pass or no pass. Memory is bounded: ``submit`` blocks (back-pressure) while more than
``queue_bytes`` wait. Disk trouble (limit reached, free-space floor, ENOSPC) stops dumping with
one loud log line and an INCOMPLETE marker; the model process keeps running.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import queue
import shutil
import threading
import time
from typing import Dict, Optional

import torch
from safetensors.torch import save_file

from . import format as fmt

log = logging.getLogger("dumper")


@dataclasses.dataclass
class PassRecord:
    exp_dir: str
    rank: int
    meta: dict
    tensors: Dict[str, torch.Tensor]
    ready: Optional[object] = None  # a CUDA event to wait on before reading host copies
    nbytes: int = 0


class _RankJournal:
    """The open manifest of one (experiment, rank) folder, held under an exclusive lock."""

    def __init__(self, rank_dir: str):
        os.makedirs(rank_dir, exist_ok=True)
        self.rank_dir = rank_dir
        self.lock_file = open(os.path.join(rank_dir, ".lock"), "a")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.close()
            raise RuntimeError(f"another process is writing {rank_dir}; give this run its own DUMPER_EXP_NAME") from None
        self.manifest_path = os.path.join(rank_dir, fmt.MANIFEST_FILE)
        self.next_pass = _next_pass_id(self.manifest_path)
        self.manifest = open(self.manifest_path, "a")

    def close(self):
        self.manifest.close()
        self.lock_file.close()


def _next_pass_id(manifest_path: str) -> int:
    """Continue after passes an earlier process committed to the same folder."""
    if not os.path.exists(manifest_path):
        return 0
    last = -1
    with open(manifest_path, "rb") as handle:
        for line in handle:
            try:
                last = max(last, int(json.loads(line)["pass"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash; readers skip it too
    return last + 1


class PassWriter:
    def __init__(self, queue_bytes: int, max_bytes: int = 0, min_free_bytes: int = 0):
        self.queue_bytes = max(queue_bytes, 1)
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.bytes_written = 0
        self.passes_written = 0
        self.stopped_reason: Optional[str] = None
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._queue: "queue.Queue[Optional[PassRecord]]" = queue.Queue()
        self._journals: Dict[str, _RankJournal] = {}
        self._run_written: set = set()
        self._thread = threading.Thread(target=self._loop, name="dumper-writer", daemon=True)
        self._thread.start()

    # --- producer side (forward pass thread) ---------------------------------------------
    def submit(self, record: PassRecord) -> bool:
        if self.stopped_reason:
            return False
        record.nbytes = sum(t.numel() * t.element_size() for t in record.tensors.values())
        with self._cond:
            # Back-pressure: never hold more than queue_bytes, but always admit one pass.
            while self._pending_bytes and self._pending_bytes + record.nbytes > self.queue_bytes:
                self._cond.wait()
            self._pending_bytes += record.nbytes
        self._queue.put(record)
        return True

    def flush(self):
        """Block until every submitted pass is committed (or dropped after a stop)."""
        self._queue.join()

    def close(self):
        self.flush()
        self._queue.put(None)
        self._thread.join()
        for journal in self._journals.values():
            journal.close()
        self._journals.clear()

    def write_run_info(self, exp_dir: str, info: dict):
        """run.json once per experiment folder; atomic so concurrent ranks never tear it."""
        if exp_dir in self._run_written:
            return
        self._run_written.add(exp_dir)
        os.makedirs(exp_dir, exist_ok=True)
        path = os.path.join(exp_dir, fmt.RUN_FILE)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w") as handle:
            json.dump(info, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    # --- writer thread --------------------------------------------------------------------
    def _loop(self):
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                if not self.stopped_reason:
                    self._write(record)
            except Exception as exc:  # noqa: BLE001 - a dump failure must not kill the engine
                self._stop(record.exp_dir if record else None, f"{type(exc).__name__}: {exc}")
            finally:
                if record is not None:
                    with self._cond:
                        self._pending_bytes -= record.nbytes
                        self._cond.notify_all()
                self._queue.task_done()

    def _write(self, record: PassRecord):
        if record.ready is not None:
            record.ready.synchronize()
        rank_dir = os.path.join(record.exp_dir, fmt.rank_dir_name(record.rank))
        journal = self._journals.get(rank_dir)
        if journal is None:
            journal = self._journals[rank_dir] = _RankJournal(rank_dir)
        self._check_budget(record, rank_dir)
        pass_id = journal.next_pass
        meta = dict(record.meta, **{"pass": pass_id})
        tensors = {name: t.cpu() if t.device.type != "cpu" else t for name, t in record.tensors.items()}
        name = fmt.pass_file_name(pass_id)
        final = os.path.join(rank_dir, name)
        tmp = os.path.join(rank_dir, f".{name}.tmp")
        try:
            save_file(tensors, tmp, metadata={fmt.PASS_META_KEY: json.dumps(meta, separators=(",", ":"))})
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        size = os.path.getsize(final)
        line = {"pass": pass_id, "file": name, "bytes": size, "tensors": len(tensors),
                "mode": meta.get("mode"), "rows": len(meta.get("tokens", {}).get("ids", [])),
                "step": meta.get("step"), "time": round(time.time(), 3)}
        journal.manifest.write(json.dumps(line) + "\n")
        journal.manifest.flush()
        os.fsync(journal.manifest.fileno())
        journal.next_pass += 1
        self.bytes_written += size
        self.passes_written += 1

    def _check_budget(self, record: PassRecord, rank_dir: str):
        if self.max_bytes and self.bytes_written + record.nbytes > self.max_bytes:
            raise _BudgetExceeded(f"DUMPER_MAX_BYTES={self.max_bytes} reached after {self.bytes_written} bytes")
        free = shutil.disk_usage(rank_dir).free
        if free - record.nbytes < self.min_free_bytes:
            raise _BudgetExceeded(
                f"only {free} bytes free on the disk of {rank_dir}; DUMPER_MIN_FREE_BYTES={self.min_free_bytes} keeps them for the system"
            )

    def _stop(self, exp_dir: Optional[str], reason: str):
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
