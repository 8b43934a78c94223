"""The vLLM adapter's reading of a model runner's state, on runner states laid out as vLLM's V1
runner lays them (no vLLM needed: the adapter reads fields by name). The real server runs in
test_vllm_e2e.py; these pin the cases a short end-to-end run may not meet."""

from __future__ import annotations

import enum
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dumpdiff import dumper
from dumpdiff.dumper.engines.vllm import VllmAdapter, compile_problem, pass_mode
from dumpdiff.dumper.passinfo import UndescribedPass, WarmupPass


def runner_for(requests):
    """A runner state for requests given as (rid, prompt ids, output ids, computed, scheduled)."""
    starts = np.cumsum([0] + [r[4] for r in requests])
    batch = SimpleNamespace(
        num_reqs=len(requests),
        req_ids=[r[0] for r in requests],
        num_computed_tokens_cpu=np.array([r[3] for r in requests]),
        num_prompt_tokens=np.array([len(r[1]) for r in requests]),
    )
    states = {r[0]: SimpleNamespace(prompt_token_ids=r[1], output_token_ids=r[2]) for r in requests}
    return SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=starts), requests=states)


def forward_args(requests):
    ids, pos = [], []
    for _, prompt, output, computed, scheduled in requests:
        seq = prompt + output
        ids += seq[computed : computed + scheduled]
        pos += list(range(computed, computed + scheduled))
    return torch.tensor(ids), torch.tensor(pos)


@pytest.mark.parametrize(
    "computed,prompts,lengths,mode",
    [
        ([0, 0], [5, 7], [5, 7], "prefill"),
        ([32, 0], [40, 7], [8, 7], "extend"),  # a prefix-cache hit beside a fresh prompt
        ([5, 7], [5, 7], [1, 1], "decode"),
        ([6, 0], [5, 12], [1, 12], "mixed"),  # one decodes while another prefills
    ],
)
def test_pass_modes(computed, prompts, lengths, mode):
    assert pass_mode(computed, prompts, lengths) == mode


def test_a_cache_hit_in_a_mixed_batch_keeps_its_prefix_ids():
    hit = ("req-a", list(range(100, 140)), [], 32, 8)  # 32 tokens restored from the prefix cache
    decoding = ("req-b", [7, 8, 9], [50, 51], 4, 1)
    info = VllmAdapter(runner_for([hit, decoding])).pass_info(None, forward_args([hit, decoding]), {})
    assert info.mode == "mixed" and info.seq == ["req-a"] * 8 + ["req-b"]
    assert info.pos == list(range(32, 40)) + [4] and info.last_rows == [7, 8]
    assert info.history["req-a"]()[:32] == list(range(100, 132))
    assert info.extra["prefix_lens"] == [32, 4] and info.extra["extend_lens"] == [8, 1]


def test_warm_up_and_mismatched_state_are_not_described():
    with pytest.raises(WarmupPass):
        VllmAdapter(runner_for([])).pass_info(None, (torch.tensor([1, 2]), torch.tensor([0, 1])), {})
    request = ("r", [1, 2, 3], [], 0, 3)
    ids, pos = forward_args([request])
    with pytest.raises(UndescribedPass, match="does not match"):
        VllmAdapter(runner_for([request])).pass_info(None, (ids, pos + 5), {})


def test_an_undescribed_pass_runs_undumped_with_one_warning(tmp_path, caplog):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)

        def forward(self, input_ids, positions):
            return self.embed(input_ids)

    model = Model()
    request = ("r", [1, 2, 3], [], 0, 3)
    ids, pos = forward_args([request])
    handle = dumper.install(
        model,
        dumper.DumperConfig(enable=True, dir=str(tmp_path), exp_name="x"),
        adapter=VllmAdapter(runner_for([request])),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="dumper"):
            for _ in range(2):
                assert model(ids, pos + 5).shape == (3, 4)  # the model still runs
        assert sum("forward not dumped" in r.message for r in caplog.records) == 1
        assert handle.state()["passes_dumped"] == 0
    finally:
        handle.remove()


class Mode(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


class Graphs(enum.Enum):
    NONE = 0
    FULL_AND_PIECEWISE = 1


def test_compile_guard_names_the_flag():
    compiled = SimpleNamespace(compilation_config=SimpleNamespace(mode=Mode.VLLM_COMPILE, cudagraph_mode=Graphs.NONE))
    assert "restart vLLM with --enforce-eager" in compile_problem(compiled)
    graphs = SimpleNamespace(
        compilation_config=SimpleNamespace(mode=Mode.NONE, cudagraph_mode=Graphs.FULL_AND_PIECEWISE)
    )
    assert "CUDA graphs (FULL_AND_PIECEWISE)" in compile_problem(graphs)
    eager = SimpleNamespace(compilation_config=SimpleNamespace(mode=Mode.NONE, cudagraph_mode=Graphs.NONE))
    assert compile_problem(eager) is None and compile_problem(None) is None
