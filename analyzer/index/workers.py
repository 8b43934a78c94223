"""Worker processes for work that holds the GIL (per-row hashing in the index build), started so
that they never import the caller's main module.

multiprocessing's spawn runs the parent's main script again in each worker (as ``__mp_main__``):
an unguarded script, a user's own that calls dumpdiff as a library, would be run once per worker,
with whatever it does. So multiprocessing was only safe from dumpdiff's own entry point, and a
library caller indexed on threads alone. Here each worker is a fresh interpreter with the
caller's import path and interpreter flags (as spawn gives it) that imports only the module its
jobs come from, and serves jobs over two pipes: (module, function, arguments) in, (ok, result or
exception) out, through multiprocessing's connections, as its pools do (between this process and
workers it started: never a user's file). A pool is ready only when every worker has imported
that module, so a worker that cannot start (an odd install) means threads do the work. Workers
run in a session of their own: Ctrl-C at a terminal reaches this process, which stops them, not a
worker still importing (it would print a traceback of its own). A worker whose parent dies reads
the end of its jobs and exits.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import List, Optional, Tuple

# The folder that holds the top-level package (site-packages for an installed one): as many levels
# above this file as the module's name has parts.
_PACKAGE_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * (__name__.count(".") or 1)))
# `-c` puts the working directory first on the path: it goes before anything is imported (a
# user's json.py there must not be run), and the caller's path replaces it.
_BOOT = (
    "import sys\n"
    "if sys.path[:1] == ['']: del sys.path[0]\n"
    "import json\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from dumpdiff.analyzer.index.workers import serve\n"
    "serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))"
)
START_SECONDS = 60.0  # a worker not ready by then (importing numpy on a loaded machine?) is not waited for


class WorkerDied(concurrent.futures.BrokenExecutor):
    """A worker process ended before it answered (killed by the out-of-memory killer, say)."""


def _worker_path() -> List[str]:
    """This process's import path, relative entries made absolute (the worker starts in the same
    directory, but the path must not depend on it), and this package's root last, should the
    package have come from an entry since removed."""
    path = [
        os.path.abspath(entry) if entry == "" or os.path.exists(entry) else entry  # not a folder: an
        for entry in sys.path
        if isinstance(entry, str)
    ]  # import hook's key
    return path + ([_PACKAGE_ROOT] if _PACKAGE_ROOT not in path else [])


def _interpreter_flags() -> List[str]:
    """The flags this interpreter was started with (-I, -s, -X ..., -W ...), as multiprocessing
    passes them on; none where this Python does not say."""
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    try:
        return list(flags()) if flags is not None else []
    except Exception:  # a private helper: its absence or change only loses the flags
        return []


class WorkerPool:
    """``workers`` worker processes, each having imported ``module``, taking jobs in order of
    submission; the part of concurrent.futures.ProcessPoolExecutor the index build uses (submit,
    shutdown). Once a worker dies, every job not yet answered fails with WorkerDied. Raises OSError
    when the processes cannot be started here or do not get ready."""

    def __init__(self, workers: int, module: str) -> None:
        if not sys.executable or getattr(sys, "frozen", False):  # embedded, or a frozen app: no Python to start
            raise OSError("no Python executable to start worker processes with")
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: Optional[str] = None
        self._shut = False
        self.processes: List[subprocess.Popen] = []
        self._pipes: List[Tuple[Connection, Connection]] = []  # (jobs, answers) of each worker
        try:
            command = [sys.executable, *_interpreter_flags(), "-c", _BOOT, json.dumps(_worker_path()), module]
            for _ in range(workers):
                self._start_one(command)
            self._wait_ready()
        except BaseException:
            self._stop_processes(kill=True)
            raise
        self._feeders = [
            threading.Thread(target=self._feed, args=(proc, *pipes), name="dumpdiff-worker-feed", daemon=True)
            for proc, pipes in zip(self.processes, self._pipes)
        ]
        for feeder in self._feeders:
            feeder.start()

    def _start_one(self, command: List[str]) -> None:
        jobs_read, jobs_write = os.pipe()
        answers_read, answers_write = os.pipe()
        try:
            self.processes.append(
                subprocess.Popen(
                    [*command, str(jobs_read), str(answers_write)],
                    pass_fds=(jobs_read, answers_write),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        except BaseException:
            os.close(jobs_write)
            os.close(answers_read)
            raise
        finally:
            os.close(jobs_read)  # the worker's ends: this process keeps none, so a dead worker is an EOF
            os.close(answers_write)
        self._pipes.append((Connection(jobs_write, readable=False), Connection(answers_read, writable=False)))

    def _wait_ready(self) -> None:
        """Each worker says it has imported its module, or why not."""
        deadline = time.monotonic() + START_SECONDS
        for proc, (_, answers) in zip(self.processes, self._pipes):
            try:
                if not answers.poll(max(deadline - time.monotonic(), 0)):
                    raise OSError(f"worker process {proc.pid} not ready after {START_SECONDS:.0f} s")
                ready, why = answers.recv()
            except EOFError:
                raise OSError(f"worker process {proc.pid} ended at its start ({_how_ended(proc.wait())})") from None
            if not ready:
                raise OSError(f"worker process {proc.pid} could not start: {why}")

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
            except OSError:
                future.set_exception(self._break(proc))
                break
            except Exception as exc:  # arguments pickle cannot carry (nothing was written)
                future.set_exception(RuntimeError(f"a job could not be sent to a worker process: {exc!r}"))
                continue
            try:
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
        """Wait for the workers to end (they do once their jobs end), killing them first with
        ``kill``, or when one takes over 10 s."""
        if kill:
            for proc in self.processes:
                proc.kill()  # Popen leaves a process that has ended alone
        for proc in self.processes:
            try:
                proc.wait(timeout=None if kill else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _how_ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def serve(module: str, jobs_fd: int, answers_fd: int) -> None:
    """A worker's loop: import ``module`` and say so (or why not), then run each job it is sent
    and send back its result or exception, until its jobs end."""
    jobs, answers = Connection(jobs_fd, writable=False), Connection(answers_fd, readable=False)
    try:
        importlib.import_module(module)
    except Exception as exc:
        answers.send((False, f"importing {module}: {exc!r}"))
        return
    answers.send((True, None))
    while True:
        try:
            module, name, args = jobs.recv()
        except (EOFError, OSError):  # the jobs ended, or their pipe is broken: nothing more can come
            return
        except Exception as exc:  # a job whose arguments do not unpickle here (read whole: the next is intact)
            reply = (False, RuntimeError(f"a worker process could not read its job: {exc!r}"))
        else:
            try:
                reply = (True, getattr(importlib.import_module(module), name)(*args))
            except Exception as exc:  # raised again in the caller's process
                reply = (False, exc)
        try:
            answers.send(reply)
        except BrokenPipeError:  # the parent went away
            return
        except Exception as exc:  # a result or exception that cannot be sent back (nothing was written)
            answers.send((False, RuntimeError(f"a job's answer cannot be sent back from its worker process: {exc!r}")))
