"""The standard dumper workflow against the real vLLM server on CPU.

    DUMPER_ENABLE=0 DUMPER_SERVER_PORT=40000 DUMPER_NON_INTRUSIVE_MODE=all DUMPER_DIR=... \\
        VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server ... --enforce-eager
    dumpdiff ctl configure enable=true exp_name=dec --url http://127.0.0.1:40000
    <completions>                                   # prefill (or cache-hit prefill) + decode
    dumpdiff ctl configure exp_name=ref --url ... ; POST /reset_prefix_cache ; <prefill of prompt+output>
    dumpdiff first-divergence DIR/ref DIR/dec
"""

from __future__ import annotations

import json
import os

import pytest
from test_sglang_e2e import ctl
from test_sglang_e2e import workflow_env as sglang_workflow_env

from helpers import assert_every_row_aligned, first_divergence_json, prompt_ids
from tiny_models import make_tiny_llama
from vllm_server import vllm_fixture

pytestmark = pytest.mark.vllm
vllm = vllm_fixture(scope="module")


def make_model(path, layers=3):
    """A tiny random Llama that vLLM's CPU attention runs (head_dim 32: its smallest)."""
    return make_tiny_llama(path, num_hidden_layers=layers, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama") / "model")


def workflow_env(dump_dir, **extra):
    return sglang_workflow_env(dump_dir, port="auto", **extra)  # a free port for the dumper's own endpoint


def dump_decode_and_reference(server, prompts, new_tokens=6, warm=False, names=("dec", "ref")):
    """dec: completions (after a warm-up of the prompts when warm=True); ref: reset the prefix
    cache, one prefill of each prompt+output."""
    server.reset_prefix_cache()
    if warm:
        server.complete(prompts, max_tokens=1)  # fills the prefix cache; not dumped
    ctl(server, "enable=true", f"exp_name={names[0]}")
    results = server.complete(prompts, max_tokens=new_tokens)
    ctl(server, f"exp_name={names[1]}")
    server.reset_prefix_cache()
    for prompt, result in zip(prompts, results):  # one at a time: a cache-free prefill each
        server.complete([prompt + result["output_ids"]], max_tokens=1, prompt_logprobs=True)
    ctl(server, "enable=false")
    return results


def rows_of_mode(dump, mode):
    entries = [json.loads(line) for line in (dump / "rank0" / "manifest.jsonl").read_text().splitlines()]
    return sum(e["rows"] for e in entries if e["mode"] == mode)


def test_workflow_clean_engine_batched_and_chunked(vllm, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = vllm(model_dir, env=workflow_env(dumps), extra_args=["--max-num-batched-tokens", "32"])
    assert not dumps.exists() or not os.listdir(dumps)  # start-up is never dumped
    assert "dumpdiff: dumper installed on LlamaForCausalLM (rank 0), idle until" in server.log_text()
    prompts = [prompt_ids(n, seed=n)[0].tolist() for n in (7, 12, 40)]  # 40 > 32: chunked prefill
    dump_decode_and_reference(server, prompts)
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    verdict = result["ranks"]["0"]
    assert_every_row_aligned(verdict, rows_b=sum(map(len, prompts)) + 3 * 5)
    assert result["b"]["engine"] == "vllm" and result["b"]["dtype"] == "float32"
    assert code == (1 if verdict["rows_differing"] else 0)
    assert verdict.get("noise", {}).get("culprits", []) == []  # natural float32 noise is not a state bug
    assert rows_of_mode(dumps / "dec", "prefill") and rows_of_mode(dumps / "dec", "decode")
    assert rows_of_mode(dumps / "dec", "extend") + rows_of_mode(
        dumps / "dec", "mixed"
    )  # the 40-token prompt's 2nd chunk
    state = ctl(server, method="get_state")
    assert state[0]["config"]["enable"] is False and state[0]["passes_written"] > 0 and state[0]["engine"] == "vllm"

    # a prefix-cache hit on the clean engine: its rows align (the prefix ids are recorded) and
    # nothing is called a state bug
    results = dump_decode_and_reference(server, [prompts[2]], warm=True, names=("hit-dec", "hit-ref"))
    assert results[0]["cached_tokens"] == 32
    code, result = first_divergence_json(dumps / "hit-ref", dumps / "hit-dec")
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["alignment"]["rows_b"] == 8 + 5
    assert rows_of_mode(dumps / "hit-dec", "extend") == 8  # computed on the restored block
    assert verdict.get("noise", {}).get("culprits", []) == []


def test_planted_decode_only_bug_is_named(vllm, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = vllm(model_dir, env=workflow_env(dumps, DUMPDIFF_PLANT="decode_mlp:1"))
    try:
        dump_decode_and_reference(server, [prompt_ids(n, seed=n)[0].tolist() for n in (7, 12)])
    finally:
        server.stop()
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    verdict = result["ranks"]["0"]
    assert code == 1 and verdict["alignment"]["unaligned_b"] == 0
    culprits = verdict["noise"]["culprits"]
    assert [c["call"] for c in culprits] == ["model.layers.1.mlp.down_proj#0"], verdict["summary"]
    # every row of a decode pass; a request's first decode step may share a mixed pass with the
    # other's prefill (requests arrive a step apart), where the planted bug does not fire
    assert culprits[0]["kinds"] == {"decode": rows_of_mode(dumps / "dec", "decode")}
    assert 2 * 4 <= rows_of_mode(dumps / "dec", "decode") <= 2 * 5  # 6 new tokens, the last never fed back


def test_planted_prefix_cache_bug_is_named(vllm, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = vllm(model_dir, env=workflow_env(dumps, DUMPDIFF_PLANT="prefix_kv:1"))
    try:
        prompt = prompt_ids(40, seed=3)[0].tolist()
        results = dump_decode_and_reference(server, [prompt], warm=True)
    finally:
        server.stop()
    assert results[0]["cached_tokens"] == 32  # the first block came back from the prefix cache
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    assert code == 1
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["alignment"]["unkeyed_b"] == 0
    culprits = verdict["noise"]["culprits"]
    assert [c["call"] for c in culprits] == ["model.layers.1.self_attn.attn#0"], verdict["summary"]
    assert culprits[0]["kinds"].get("extend") == 8  # the rows computed on the restored block
    assert culprits[0]["rows"] == verdict["rows_compared"] == 8 + 5  # then every decode row


def test_tensor_parallel_two_ranks(vllm, model_dir, tmp_path):
    """Each rank's worker installs its own dumper and control endpoint (port + rank); rank 0
    forwards control requests to the others; each rank's dump aligns with its reference."""
    dumps = tmp_path / "dumps"
    server = vllm(model_dir, tp=2, env=workflow_env(dumps), startup_timeout=400)
    try:
        assert "(rank 1), idle until http://127.0.0.1:" in server.log_text()
        dump_decode_and_reference(server, [prompt_ids(10, seed=5)[0].tolist()], new_tokens=4)
    finally:
        server.stop()
    assert sorted(os.listdir(dumps / "dec")) >= ["rank0", "rank1", "run.json"]
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    assert set(result["ranks"]) == {"0", "1"} and result["b"]["tp_size"] == 2
    for verdict in result["ranks"].values():
        assert verdict["alignment"]["unaligned_b"] == 0 and "bit-identical" in verdict["alignment"]["proof"][1]
