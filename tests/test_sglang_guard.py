"""The CUDA-graph guard, on sglang's own parsed ServerArgs (no GPU needed to parse)."""

from __future__ import annotations

import os
import sys

import pytest

from dumpdiff.dumper.engines.sglang import cuda_graph_problem
from helpers import make_tiny_llama
from sglang_server import RIG, sglang_installed

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def parse(tmp_path_factory):
    if not sglang_installed():
        pytest.skip("sglang not installed: run scripts/install-sglang-cpu.sh (make test does)")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, str(RIG))  # the sgl_kernel stand-in, as the server gets it
    from sglang.srt.server_args import prepare_server_args

    model = make_tiny_llama(tmp_path_factory.mktemp("m") / "model")
    return lambda *flags: prepare_server_args(["--model-path", str(model), "--device", "cpu", *flags])


def test_cuda_with_default_graphs_refuses_with_the_flags_to_add(parse):
    problem = cuda_graph_problem(parse(), "cuda:0")
    assert "CUDA graphs are on for decode, prefill" in problem
    assert "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled" in problem


@pytest.mark.parametrize(
    "flags,still_on",
    [
        (["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"], None),
        (["--disable-cuda-graph"], None),
        (["--cuda-graph-backend-decode", "disabled"], "prefill"),
        (["--disable-prefill-cuda-graph"], "decode"),
    ],
)
def test_guard_follows_the_flags(parse, flags, still_on):
    problem = cuda_graph_problem(parse(*flags), "cuda")
    assert (problem is None) if still_on is None else (f"on for {still_on} " in problem)


def test_cpu_needs_no_guard(parse):
    assert cuda_graph_problem(parse(), "cpu") is None
