"""Worker processes for work that holds the GIL (per-row hashing in the index build), started so
that they never import the caller's main module.

multiprocessing's spawn runs the parent's main script again in each worker (as ``__mp_main__``):
an unguarded script, a user's own that calls dumpdiff as a library, would be run once per worker,
with whatever it does. So multiprocessing was only safe from dumpdiff's own entry point, and a
library caller indexed on threads alone. Here each worker is a fresh interpreter that imports
only this package and serves jobs over two pipes: (module, function, arguments) in, (ok, result
or exception) out, through multiprocessing's connections, as its pools do (between this process
and workers it started: never a user's file). Workers run in a session of their own: Ctrl-C at a
terminal reaches this process, which stops them, not a worker still importing (it would print a
traceback of its own). A worker whose parent dies reads the end of its jobs and exits.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import List, Optional, Tuple

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package's own root goes first on the worker's path: the caller's working directory (a
# folder named like one of our packages next to the user's script) cannot shadow it.
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from analyzer.workers import serve; "
         "serve(int(sys.argv[2]), int(sys.argv[3]))")


class WorkerDied(concurrent.futures.BrokenExecutor):
    """A worker process ended before it answered (killed by the out-of-memory killer, say)."""


class WorkerPool:
    """``workers`` worker processes taking jobs in order of submission; the part of
    concurrent.futures.ProcessPoolExecutor the index build uses (submit, shutdown). Once a worker
    dies, every job not yet answered fails with WorkerDied. Raises OSError when processes cannot
    be started here."""

    def __init__(self, workers: int):
        if not sys.executable:  # embedded Python: nothing to start workers with
            raise OSError("no Python executable to start worker processes with")
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: Optional[str] = None
        self._shut = False
        self.processes: List[subprocess.Popen] = []
        self._pipes: List[Tuple[Connection, Connection]] = []  # (jobs, answers) of each worker
        try:
            for _ in range(workers):
                self._start_one()
        except BaseException:
            self._stop_processes(kill=True)
            raise
        self._feeders = [threading.Thread(target=self._feed, args=(proc, *pipes), name="dumpdiff-worker-feed",
                                          daemon=True) for proc, pipes in zip(self.processes, self._pipes)]
        for feeder in self._feeders:
            feeder.start()

    def _start_one(self) -> None:
        jobs_read, jobs_write = os.pipe()
        answers_read, answers_write = os.pipe()
        try:
            self.processes.append(subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PACKAGE_ROOT, str(jobs_read), str(answers_write)],
                pass_fds=(jobs_read, answers_write), stdin=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            os.close(jobs_write)
            os.close(answers_read)
            raise
        finally:
            os.close(jobs_read)  # the worker's ends: this process keeps none, so a dead worker is an EOF
            os.close(answers_write)
        self._pipes.append((Connection(jobs_write, readable=False), Connection(answers_read, writable=False)))

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                raise WorkerDied(self._broken)
            if self._shut:
                raise RuntimeError("submit after shutdown")
            self._jobs.put((future, fn.__module__, fn.__qualname__, args))
        return future

    def _feed(self, proc: subprocess.Popen, jobs: Connection, answers: Connection) -> None:
        """One worker's jobs, one at a time, on a thread of this process (waiting on a pipe lets
        go of the GIL)."""
        while True:
            job = self._jobs.get()
            if job is None:
                break
            future, module, name, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                jobs.send((module, name, args))
                ok, value = answers.recv()
            except (OSError, EOFError):
                future.set_exception(self._break(proc))
                break
            except Exception as exc:  # an answer this process cannot unpickle (an exotic exception)
                ok, value = False, RuntimeError(f"a worker process's answer could not be read: {exc!r}")
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        jobs.close()  # the worker reads the end of its jobs and exits
        answers.close()

    def _break(self, proc: subprocess.Popen) -> WorkerDied:
        """Mark the pool broken: a worker ended. Jobs still queued fail with it."""
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its pipes closed but it lives on: stop it
            proc.kill()
            code = proc.wait()
        why = f"process {proc.pid}, {_how_ended(code)}"
        with self._lock:
            if self._broken is None:
                self._broken = why
        self._drain(lambda future: future.set_running_or_notify_cancel() and future.set_exception(WorkerDied(why)))
        return WorkerDied(why)

    def _drain(self, each) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                each(job[0])
            else:
                self._jobs.put(None)  # a feeder's stop: left for it
                return

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking jobs; with ``cancel_futures`` drop the queued ones and stop the workers at
        once (a job running is not needed then: the build is ending on an error), else let the
        queued jobs finish first."""
        with self._lock:
            already, self._shut = self._shut, True
        if cancel_futures:
            self._drain(lambda future: future.cancel())
        if not already:
            for _ in self._feeders:
                self._jobs.put(None)
        if cancel_futures:
            self._stop_processes(kill=True)
        if wait:
            for feeder in self._feeders:
                feeder.join()
            self._stop_processes(kill=False)

    def _stop_processes(self, kill: bool) -> None:
        for proc in self.processes:
            if kill and proc.poll() is None:
                proc.kill()
            elif not kill:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if kill:
            for proc in self.processes:
                proc.wait()


def _how_ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def serve(jobs_fd: int, answers_fd: int) -> None:
    """A worker's loop: run each job it is sent and send back its result or exception, until its
    jobs end."""
    jobs, answers = Connection(jobs_fd, writable=False), Connection(answers_fd, readable=False)
    while True:
        try:
            module, name, args = jobs.recv()
        except EOFError:
            return
        try:
            reply = (True, getattr(importlib.import_module(module), name)(*args))
        except Exception as exc:  # raised again in the caller's process
            reply = (False, exc)
        try:
            answers.send(reply)
        except BrokenPipeError:  # the parent went away
            return
        except Exception as exc:  # a result or exception that cannot be sent back (nothing was written)
            answers.send((False, RuntimeError(f"{module}.{name} gave an answer that cannot be sent back: {exc!r}")))
