"""`dumpdiff kl` and `dumpdiff localize` against the real vLLM server on CPU.

Two servers of one tiny float32 Llama:

  clean          the engine as it is: every helper within the threshold -> pass.
  prefix_kv:1    a cache-restore bug: a key of layer 1 in the first restored block is
                 corrupted whenever a prompt starts on blocks from the prefix cache. Both
                 cache-hit helpers are dirty while match (no cache) is clean -> state bug;
                 localize (dumper control on its own port) names the planted attention.

vLLM caches whole blocks only (32 tokens here), so prompts are 40-120 tokens (every one restores
at least a block) and 48 new tokens (turn 1 of decode_cache_hit fills a block past its prompt).
"""

from __future__ import annotations

import json

import pytest
from test_kl_sglang import kl_json
from test_vllm_e2e import make_model

from helpers import dumpdiff
from vllm_server import vllm_fixture

pytestmark = pytest.mark.vllm
vllm = vllm_fixture(scope="module")

SIZES = ("--max-samples", "4", "--max-new-tokens", "48", "--prompt-len", "80", "--threshold", "1e-9")
PLANTED_ATTN = "model.layers.1.self_attn.attn#0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kl-llama") / "model", layers=2)


def test_clean_engine_passes_with_real_cache_hits(vllm, model_dir):
    server = vllm(model_dir)
    try:
        code, result = kl_json(server.url, *SIZES)
        assert result["target"]["engine"] == "vllm" and result["target"]["page_size"] == 32  # detected, not told
        assert code == 0 and result["verdict"]["kind"] == "pass", result["verdict"]
        for name, h in result["helpers"].items():
            assert h["status"] == "clean" and h["tokens"] == 4 * 48, name
        prefill_hit, decode_hit = result["helpers"]["prefill_cache_hit"], result["helpers"]["decode_cache_hit"]
        assert prefill_hit["cache_hit_rate"] == 1.0 and decode_hit["cache_hit_rate"] == 1.0
        for row in prefill_hit["per_prompt"]:  # whole blocks, the last prompt token always recomputed
            assert row["cached_tokens"] == (row["prompt_len"] - 1) // 32 * 32 and row["ref_cached_tokens"] == 0
        assert all(r["cached_tokens"] == 0 for r in result["helpers"]["match"]["per_prompt"])
    finally:
        server.stop()


def test_planted_prefix_bug_is_a_state_bug_and_localized(vllm, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = vllm(
        model_dir,
        env={
            "DUMPDIFF_PLANT": "prefix_kv:1",
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "auto",
            "DUMPER_DIR": str(dumps),
        },
    )
    try:
        code, result = kl_json(server.url, *SIZES)
        assert code == 1 and result["verdict"]["kind"] == "state_bug", result["verdict"]
        assert sorted(result["verdict"]["dirty"]) == ["decode_cache_hit", "prefill_cache_hit"]
        assert result["helpers"]["match"]["status"] == "clean"

        saved = tmp_path / "kl.json"
        saved.write_text(json.dumps(result))
        code, out, err = dumpdiff(
            "localize", "--url", server.url, "--kl-result", saved, "--exp-prefix", "loc", "--format", "json", "-q"
        )
        assert code == 2 and "--dumper-url" in err and "Traceback" not in err  # vLLM has no /dumper route
        code, out, err = dumpdiff(
            "localize",
            "--url",
            server.url,
            "--dumper-url",
            server.dumper_url,
            "--kl-result",
            saved,
            "--exp-prefix",
            "loc",
            "--format",
            "json",
            "-q",
        )
        assert code == 1, err
        located = json.loads(out)
        assert located["replay"]["hit"] and located["dumps"]["dec"] == str(dumps / "loc-dec")
        assert [c["call"] for c in located["noise_culprits"]][:1] == [PLANTED_ATTN], located["summary"]
    finally:
        server.stop()


def test_no_dev_mode_says_how_to_enable_the_cache_reset(vllm, model_dir):
    server = vllm(model_dir, env={"VLLM_SERVER_DEV_MODE": "0"})
    try:
        code, out, err = dumpdiff("kl", "--url", server.url, *SIZES, "-q")
        assert code == 2 and "VLLM_SERVER_DEV_MODE=1" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    finally:
        server.stop()
