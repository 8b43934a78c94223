"""The CPU sglang rig itself: the real sglang server on a tiny random Llama gives the same
greedy tokens (and logprobs) as HF transformers `generate`, and leaves no process behind."""

import os
import sys

import pytest
import torch

from sglang_server import SglangServer, _group_alive, sglang_fixture, sglang_installed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tiny_models import make_tiny_llama  # noqa: E402

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")

NEW_TOKENS = 8
# Two prompts of different lengths in one batch: sglang packs them unpadded, HF runs each alone.
PROMPTS = [[1, 17, 300, 42, 999, 5, 600], [1, 640, 77, 8]]


def hf_greedy(model, prompt):
    """Token ids and their logprobs (log_softmax of the raw logits) from HF generate."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids)]
    return ids, logprobs


def test_sglang_greedy_matches_hf(sglang, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_llama(tmp_path / "tiny-llama")
    server = sglang(model_dir)
    results = server.generate(PROMPTS, max_new_tokens=NEW_TOKENS, return_logprob=True)
    assert server.server_info()["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # sglang runs with ignore_eos: never stop early
    for prompt, result in zip(PROMPTS, results):
        hf_ids, hf_logprobs = hf_greedy(model, prompt)
        sg_logprobs = result["meta_info"]["output_token_logprobs"]  # [[logprob, id, None], ...]
        assert result["output_ids"] == hf_ids, f"prompt {prompt}: sglang {result['output_ids']} vs HF {hf_ids}"
        assert [tok for _, tok, _ in sg_logprobs] == hf_ids
        # float32 on both sides: the same ops in another order, a few ulps apart at most.
        torch.testing.assert_close(
            torch.tensor([lp for lp, _, _ in sg_logprobs]), torch.tensor(hf_logprobs), rtol=0, atol=1e-4
        )

    # Teardown kills the whole process group (scheduler and detokenizer included).
    pgid = server.proc.pid
    server.stop()
    assert not _group_alive(pgid), "sglang processes left behind"
    assert "fired up and ready" in server.log_text()
    # no DUMPER_* variable: our plugin loaded and installed nothing
    assert "dumpdiff: dumper installed" not in server.log_text()


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path):
    """A picked port can be taken before sglang binds it (its own workers pick ports too); the
    server then stays up without HTTP. The rig sees the bind failure in the log, stops that
    server and starts again on another port, instead of waiting out its start-up timeout."""
    import socket

    if not sglang_installed():
        pytest.skip("sglang not installed: run scripts/install-sglang-cpu.sh (make test does)")
    server = SglangServer(
        make_tiny_llama(tmp_path / "tiny-llama"), log_path=tmp_path / "server.log", startup_timeout=120
    )
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.port != taken and server._status("/health") == 200
            assert server.log_text().count(SglangServer.BIND_FAILED) == 1
        finally:
            server.stop()
