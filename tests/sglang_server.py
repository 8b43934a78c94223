"""Run the real sglang server on CPU as a subprocess, for tests.

    with SglangServer(model_dir, env={"DUMPER_DIR": ...}) as server:
        out = server.generate([[1, 5, 6], [1, 7]], max_new_tokens=8, return_logprob=True)

or, in a test module, a fixture that stops every server it started:

    from sglang_server import sglang_fixture
    sglang = sglang_fixture(scope="module")

    def test_x(sglang, model_dir):
        server = sglang(model_dir, extra_args=["--disable-radix-cache"])

Needs sglang installed by scripts/install-sglang-cpu.sh; the CUDA-only sgl_kernel is replaced
by the stand-in in tests/sglang_rig/ (put on the server's PYTHONPATH here, nowhere else).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from dumpdiff.dumper.control import PORT_TAKEN

RIG = Path(__file__).resolve().parent / "sglang_rig"

# CPU-only flags (shared/notes/sglang-on-cpu.md).  A small static memory fraction and token
# cap: the default fraction allocates ~15 GB of KV cache and takes ~50 s to start.
CPU_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--dtype",
    "float32",
    "--mem-fraction-static",
    "0.05",
    "--max-total-tokens",
    "4096",
    "--random-seed",
    "0",
    "--skip-tokenizer-init",  # requests carry input_ids; outputs are ids, never text
    "--sleep-on-idle",  # an idle scheduler otherwise spins a whole core of this 2-core machine
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_binding(tp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for tp ranks: the usable cores split in tp groups
    ('0|1' for tp=2 on 2 cores).  Without it sglang refuses tp > number of NUMA nodes."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    groups = [cores[(r * per) % len(cores) :][:per] for r in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


class SglangServer:
    """`python -m sglang.launch_server` on CPU, in its own process group.

    env: extra environment for the server (e.g. DUMPER_*); DUMPER_* inherited from the test
    process are dropped first so a stray variable cannot switch dumping on.
    extra_args: appended to the command line (later flags override CPU_ARGS).
    """

    def __init__(
        self,
        model_path,
        *,
        env: dict | None = None,
        extra_args=(),
        tp: int = 1,
        log_path=None,
        startup_timeout: float = 300.0,
        python: str = sys.executable,
    ):
        self.model_path = str(model_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tp = tp
        self.startup_timeout = startup_timeout
        self.startup_seconds: float | None = None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.cmd = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            *CPU_ARGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if tp > 1:
            self.cmd += ["--tp-size", str(tp)]
        self.cmd += [str(a) for a in extra_args]

        base = {k: v for k, v in os.environ.items() if not k.startswith("DUMPER_")}
        base["SGLANG_USE_CPU_ENGINE"] = "1"  # else --device cpu goes into a vllm import
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RIG), base.get("PYTHONPATH")]))
        if tp > 1:
            base["SGLANG_CPU_OMP_THREADS_BIND"] = _cpu_binding(tp)
        self.env = {**base, **{k: str(v) for k, v in (env or {}).items()}}
        self.proc: subprocess.Popen | None = None

    # -- lifecycle -------------------------------------------------------------------------

    # The port is free when picked, but another process (sglang's own workers pick ports for their
    # sockets) can take it before the server binds it; the server then stays up without HTTP. The
    # dumper's own control port (DUMPER_SERVER_PORT) can be lost the same way; its start fails.
    BIND_FAILED = "error while attempting to bind on address"
    BIND_MARKERS = (BIND_FAILED, PORT_TAKEN)
    PORT_ATTEMPTS = 3

    def start(self) -> "SglangServer":
        for attempt in range(self.PORT_ATTEMPTS):
            if attempt:  # lost the port race: again on other ports
                self._new_ports()
            if self._start_once():
                return self
        raise RuntimeError(f"sglang server could not bind a port {self.PORT_ATTEMPTS} times\n{self.log_tail()}")

    def _new_ports(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)

    def _start_once(self) -> bool:
        """Start the server and wait for it; False when its port was taken (it is stopped)."""
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            # New session: the scheduler/detokenizer children share our process group, so
            # one killpg in stop() takes them all down.
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        t0 = time.monotonic()
        try:
            while True:
                if self._port_lost(logged):
                    self.stop()
                    return False
                if self.proc.poll() is not None:
                    if self._port_lost(logged):  # it said so just before it exited
                        return False
                    raise RuntimeError(
                        f"sglang server exited with {self.proc.returncode} during start-up\n{self.log_tail()}"
                    )
                if time.monotonic() - t0 > self.startup_timeout:
                    raise TimeoutError(
                        f"sglang server not healthy after {self.startup_timeout:.0f} s\n{self.log_tail()}"
                    )
                # /health answers 503 until the warm-up request has gone through.
                if self._status("/health") == 200:
                    break
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return True

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace` s, and also
        any descendant that left the group.  Safe to call twice."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        descendants = _descendants(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in descendants:
            try:
                child.kill()
            except Exception:  # already gone
                pass
        proc.wait(timeout=grace)

    def __enter__(self) -> "SglangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP ------------------------------------------------------------------------------

    @property
    def control_url(self) -> str:
        """Where the dumper's /dumper/* routes are: the server's own port (DUMPER_SERVER_PORT=reuse)."""
        return self.url

    def _status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:  # not listening yet
            return None

    def request(self, path: str, payload=None, timeout: float = 120.0):
        """GET (payload None) or POST JSON; returns the decoded JSON, or the text body."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode()[:2000]}") from None
        try:
            return json.loads(body)
        except ValueError:
            return body

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 8,
        *,
        temperature: float = 0.0,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        ignore_eos: bool = True,
        sampling_params: dict | None = None,
        **fields,
    ):
        """POST /generate with token ids (one prompt: a list of ints; several: a list of
        lists, answered by a list of results).  Greedy and ignoring EOS by default, so the
        output length is exactly max_new_tokens."""
        if hasattr(input_ids, "tolist"):
            input_ids = input_ids.tolist()
        payload = {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": ignore_eos,
                **(sampling_params or {}),
            },
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "return_text_in_logprobs": False,
            **fields,
        }
        return self.request("/generate", payload)

    def flush_cache(self) -> str:
        return self.request("/flush_cache", {})

    def server_info(self) -> dict:
        return self.request("/server_info")

    # -- logs ------------------------------------------------------------------------------

    def _port_lost(self, logged: int) -> bool:
        """Whether the log since ``logged`` says a port was taken before the server bound it."""
        text = self._log_bytes(logged)
        return any(marker.encode() in text for marker in self.BIND_MARKERS)

    def _log_bytes(self, start: int) -> bytes:
        with open(self.log_path, "rb") as handle:
            handle.seek(start)
            return handle.read()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the test process dies without teardown (a
    killed CI job); sglang's launcher then takes its own children down."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _descendants(pid: int):
    try:
        import psutil  # installed with sglang

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group?  killpg(pgid, 0) alone would also count
    zombies, which linger here when nothing reaps orphans."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _ppid, pgrp = f.read().rpartition(")")[2].split()[:3]
        except OSError:
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def sglang_fixture(scope: str = "function"):
    """Make a pytest fixture (any scope) that yields `start(model_path, **SglangServer
    kwargs) -> SglangServer` and stops every server it started when the scope ends.  Logs go
    to the pytest temp dir.  Skips when sglang is not installed in this interpreter."""
    return server_fixture(
        SglangServer,
        sglang_installed,
        "sglang not installed: run scripts/install-sglang-cpu.sh (make test does)",
        scope,
    )


def server_fixture(server_class, installed, missing: str, scope: str = "function"):
    """A fixture yielding `start(model_path, **kwargs)` for any server class of this shape;
    skips with `missing` when `installed()` is false."""
    import pytest

    @pytest.fixture(scope=scope)
    def _fixture(tmp_path_factory):
        if not installed():
            pytest.skip(missing)
        servers = []

        def start(model_path, **kwargs):
            kwargs.setdefault("log_path", tmp_path_factory.mktemp(server_class.__name__.lower()) / "server.log")
            server = server_class(model_path, **kwargs)
            servers.append(server)
            return server.start()

        yield start
        for server in servers:
            server.stop()

    return _fixture
