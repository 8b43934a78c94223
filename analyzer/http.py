"""Small JSON-over-HTTP client for a running server (sglang's API, the dumper control route).

Plain urllib: the analyzer talks to engines over their public HTTP API and imports none.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .errors import DumpError

# sglang's default address: where `dumpdiff kl`, `localize` and `ctl` look unless told.
DEFAULT_URL = "http://127.0.0.1:30000"


def post_json(url: str, body: object = None, timeout: float = 600.0) -> Any:
    _check_address(url)
    data = json.dumps(body if body is not None else {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    return _send(request, url, timeout)


def get_json(url: str, timeout: float = 60.0) -> Any:
    _check_address(url)
    return _send(urllib.request.Request(url, method="GET"), url, timeout)


def _check_address(url: str) -> None:
    """One line for an address urllib would turn into a traceback ("unknown url type")."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise DumpError(f"{url}: not a server address ({exc}); give http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DumpError(f"{url}: not a server address; give http://HOST:PORT (e.g. {DEFAULT_URL})")


def _send(request, url: str, timeout: float):
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace").strip()
        hint = (
            " (is the server started with DUMPER_SERVER_PORT=reuse?)" if exc.code == 404 and "/dumper/" in url else ""
        )
        raise DumpError(f"{url}: HTTP {exc.code} {detail}{hint}") from None
    except ValueError as exc:  # a port that is not a number, a malformed address
        raise DumpError(f"{url}: not a server address ({exc}); give http://HOST:PORT") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DumpError(f"{url}: cannot connect ({reason}); is the server running at that address?") from None
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return raw.decode("utf-8", "replace")
