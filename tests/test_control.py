"""Run-time control over HTTP (numeric DUMPER_SERVER_PORT) and `dumpdiff ctl`, on a real HF model."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from helpers import dumpdiff, load_model, make_tiny_llama, prompt_ids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ctl_enables_dumping_and_rejects_bad_requests(tmp_path):
    model = load_model(make_tiny_llama(tmp_path / "model"))
    port = free_port()
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path / "dumps"), server_port=str(port)))
    url = f"--url=http://127.0.0.1:{port}"
    try:
        assert handle._endpoint.server_address[0] == "127.0.0.1"  # never on all interfaces
        with torch.no_grad():
            model(prompt_ids(8))  # idle: not dumped
        code, out, err = dumpdiff("ctl", "configure", "enable=true", "exp_name=dec", url)
        assert code == 0, err
        assert json.loads(out)[0]["config"]["exp_name"] == "dec"
        with torch.no_grad():
            model(prompt_ids(8))
        handle.flush()
        state = json.loads(dumpdiff("ctl", "get_state", url)[1])[0]
        assert state["passes_written"] == 1 and state["config"]["enable"] is True
        for bad, needle in (
            (["exp_name=../../etc"], "exp_name='../../etc' is not valid"),
            (["colour=red"], "unknown setting(s) ['colour']"),
            ([f"dir={tmp_path / 'elsewhere'}"], "dir cannot be set at run time"),
            (["min_free_bytes=0"], "min_free_bytes cannot be set at run time: set DUMPER_MIN_FREE_BYTES"),
            (["enable=maybe"], "DUMPER_ENABLE='maybe' is not valid"),
            (["filter=layer=3"], "DUMPER_FILTER='layer=3' is not valid"),
        ):  # was a regex matching nothing
            code, out, err = dumpdiff("ctl", "configure", *bad, url)
            assert code == 2 and needle in err and err.count("\n") == 1, err
        code, out, err = dumpdiff("ctl", "reset", url)
        assert code == 0 and json.loads(out)[0]["config"]["enable"] is False
    finally:
        handle.remove()
    lines = open(tmp_path / "dumps" / "dec" / "rank0" / fmt.MANIFEST_FILE).read().splitlines()
    assert len(lines) == 1
    assert not (tmp_path / "elsewhere").exists()  # a request never leads the dumps out of DUMPER_DIR


def test_a_taken_control_port_is_named_and_the_model_left_as_it_was(tmp_path):
    model = load_model(make_tiny_llama(tmp_path / "model"))
    forward = model.forward
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        config = dumper.DumperConfig(dir=str(tmp_path / "dumps"), server_port=str(port))
        with pytest.raises(RuntimeError, match=f"control requests on port {port} .*DUMPER_SERVER_PORT={port}"):
            dumper.install(model, config)
    assert model.forward == forward and getattr(model, "_dumpdiff_dumper", None) is None
    dumper.install(model, dumper.DumperConfig(dir=str(tmp_path / "dumps"))).remove()  # installs again
