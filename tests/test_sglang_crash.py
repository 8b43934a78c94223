"""kill -9 of a real sglang server in the middle of a dump: what the manifest committed survives."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from helpers import dumpdiff, make_tiny_llama, prompt_ids
from sglang_server import sglang_fixture

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")


def test_server_killed_mid_dump_leaves_whole_passes(sglang, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(
        make_tiny_llama(tmp_path / "model"),
        env={"DUMPER_ENABLE": "0", "DUMPER_SERVER_PORT": "reuse", "DUMPER_DIR": str(dumps)},
    )
    dumpdiff("ctl", "configure", "enable=true", "exp_name=dec", f"--url={server.url}")
    request = threading.Thread(target=lambda: _ignore(server.generate, prompt_ids(16)[0].tolist(), 400), daemon=True)
    request.start()
    manifest = dumps / "dec" / "rank0" / "manifest.jsonl"
    deadline = time.monotonic() + 120
    while not (manifest.exists() and len(manifest.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.02)
    os.killpg(server.proc.pid, signal.SIGKILL)  # the whole server, scheduler included, mid-generate
    server.proc.wait(timeout=30)

    committed = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(committed) >= 5 and [e["pass"] for e in committed] == list(range(len(committed)))
    code, out, err = dumpdiff("index", dumps / "dec", "--no-progress")
    assert code == 0, err  # every committed pass loads
    assert "never closed" in err  # and the analyzer says the dump may end early
    rows = int(out.split(":")[1].split()[0])
    assert rows == 16 + len(committed) - 1  # the prefill's 16 rows + one per committed decode pass


def _ignore(call, *args):
    try:
        call(*args)
    except Exception:  # the server dies under the request: expected
        pass
