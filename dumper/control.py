"""Run-time control of a Dumper: configure / reset / get_state, as sglang's /dumper/{method}.

``handle`` is the one place that validates a request: unknown methods and unknown keys are
rejected, and an exp_name must be a plain folder name (it can never lead out of DUMPER_DIR).
``start_endpoint`` serves it over HTTP on 127.0.0.1 for a numeric DUMPER_SERVER_PORT; with
several ranks on one host, rank r listens on port + r and rank 0 forwards to the others.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .config import ConfigError, DumperConfig

log = logging.getLogger("dumper")

METHODS = ("configure", "reset", "get_state")
PORT_TAKEN = "dumper: cannot listen for control requests on port"
# Not over HTTP, fixed at launch: where the dumps go (with DUMPER_SERVER_PORT=reuse the route is
# on the engine's own port, which may listen beyond this host: a request must never make the
# server write, or clean up, files outside DUMPER_DIR) and the resources it may take (host
# memory, bytes written, the disk space left free).
AT_LAUNCH = ("server_port", "queue_bytes", "dir", "max_bytes", "min_free_bytes", "graph_buffer_bytes")
SETTABLE = tuple(f for f in DumperConfig.__dataclass_fields__ if f not in AT_LAUNCH)


def handle(dumper, method: str, body) -> dict:
    """Apply one control request to a local Dumper; raises ConfigError on a bad request."""
    if method not in METHODS:
        raise ConfigError(f"unknown dumper control method {method!r}; use one of {', '.join(METHODS)}")
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    if method == "configure":
        unknown = sorted(set(body) - set(SETTABLE))
        fixed = sorted(set(body) & set(AT_LAUNCH))
        if fixed:
            raise ConfigError(
                f"{', '.join(fixed)} cannot be set at run time: set "
                f"{', '.join('DUMPER_' + f.upper() for f in fixed)} before launching the server"
            )
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown}; settable: {', '.join(SETTABLE)}")
        return dumper.configure(**body)
    if body:
        raise ConfigError(f"{method} takes no arguments")
    return dumper.reset() if method == "reset" else dumper.state()


def start_endpoint(dumper, port: int, rank: int, world_size: int) -> ThreadingHTTPServer:
    """Serve /dumper/{method} on 127.0.0.1:(port + rank); rank 0 also forwards to the others."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            if not self.path.startswith("/dumper/"):
                return self._reply(404, {"error": f"no route {self.path}; use /dumper/{{{'|'.join(METHODS)}}}"})
            method = self.path[len("/dumper/") :]
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                results = [handle(dumper, method, body)]
                if rank == 0 and not self.headers.get("X-Dumpdiff-Forwarded"):
                    results += [_forward(port + r, method, body) for r in range(1, world_size)]
            except (ConfigError, ValueError) as exc:
                return self._reply(400, {"error": str(exc)})
            self._reply(200, results)

        def _reply(self, code, payload) -> None:
            data = json.dumps(payload, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # keep the server's stderr for real problems
            pass

    try:
        server = ThreadingHTTPServer(("127.0.0.1", port + rank), Handler)
    except OSError as exc:  # taken: say which setting and port, not a socket traceback alone
        raise RuntimeError(
            f"{PORT_TAKEN} {port + rank} (DUMPER_SERVER_PORT={port}, rank {rank}): {exc.strerror or exc}; "
            "set DUMPER_SERVER_PORT to a free port, or to 'reuse' for the engine's own port"
        ) from exc
    threading.Thread(target=server.serve_forever, name="dumper-control", daemon=True).start()
    log.info("dumper: control endpoint on http://127.0.0.1:%d/dumper/{configure,reset,get_state}", port + rank)
    return server


def _forward(port: int, method: str, body: dict):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/dumper/{method}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Dumpdiff-Forwarded": "1"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())[0]
