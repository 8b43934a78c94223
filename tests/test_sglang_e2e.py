"""The standard sglang dumper workflow, verbatim, against the real sglang server on CPU.

    DUMPER_ENABLE=0 DUMPER_SERVER_PORT=reuse DUMPER_NON_INTRUSIVE_MODE=all DUMPER_DIR=... \\
        python -m sglang.launch_server ... (CUDA graphs disabled)
    dumpdiff ctl configure enable=true exp_name=dec     # = curl -X POST .../dumper/configure
    <generate>                                            # prefill (or cache-hit extend) + decode
    dumpdiff ctl configure exp_name=ref ; POST /flush_cache ; <prefill of prompt+output>
    dumpdiff first-divergence DIR/ref DIR/dec
"""

from __future__ import annotations

import json
import os

import pytest
from test_dumper_units import read_pass

from helpers import assert_every_row_aligned, dumpdiff, first_divergence_json, make_tiny_llama, prompt_ids
from sglang_server import sglang_fixture
from tiny_models import make_tiny_qwen3

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=3)


def workflow_env(dump_dir, port="reuse", **extra):
    return {
        "DUMPER_ENABLE": "0",
        "DUMPER_SERVER_PORT": port,
        "DUMPER_NON_INTRUSIVE_MODE": "all",
        "DUMPER_DIR": str(dump_dir),
        **extra,
    }


def ctl(server, *settings, method="configure"):
    code, out, err = dumpdiff("ctl", method, *settings, f"--url={server.control_url}")
    assert code == 0, err
    return json.loads(out)


def dump_decode_and_reference(server, prompts, new_tokens=6, warm=False, logprobs=False):
    """dec: generate (after a warm-up of the prompts when warm=True); ref: flush, one prefill each.
    ``logprobs``: both ask for every prompt token's logprob, as examples/sglang/workflow.sh does."""
    asked = {"return_logprob": True, "logprob_start_len": 0} if logprobs else {}
    server.flush_cache()
    if warm:
        server.generate(prompts, max_new_tokens=1)  # fills the radix cache; not dumped
    ctl(server, "enable=true", "exp_name=dec")
    results = server.generate(prompts, max_new_tokens=new_tokens, **asked)
    ctl(server, "exp_name=ref")
    server.flush_cache()
    full = [p + r["output_ids"] for p, r in zip(prompts, results)]
    server.generate(full, max_new_tokens=0, **{"logprob_start_len": 0, **asked})
    ctl(server, "enable=false")
    return results


def test_workflow_clean_engine_batched_and_chunked(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(model_dir, env=workflow_env(dumps), extra_args=["--chunked-prefill-size", "16"])
    assert not dumps.exists() or not os.listdir(dumps)  # warm-up at boot is never dumped
    assert "dumpdiff: dumper installed" in server.log_text()
    prompts = [prompt_ids(n, seed=n)[0].tolist() for n in (7, 12, 30)]  # 30 > 16: chunked prefill
    dump_decode_and_reference(server, prompts, logprobs=True)
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    verdict = result["ranks"]["0"]
    assert_every_row_aligned(verdict, rows_b=sum(map(len, prompts)) + 3 * 5)
    assert result["b"]["engine"] == "sglang" and result["b"]["dtype"] == "float32"
    kinds = {r["kind"] for r in verdict["per_row"]} | {"prefill"}
    assert code == (1 if verdict["rows_differing"] else 0)
    if code == 1:
        assert result["culprit"]["call"] and kinds <= {"prefill", "extend", "decode", "mixed"}
        assert verdict["noise"]["culprits"] == []  # natural float32 noise is not a state bug
    # the prompt tokens' logprobs score token i+1 at row i: kept, never compared row by row
    metas = [read_pass(str(path))[0] for path in sorted((dumps / "dec" / "rank0").glob("pass-*.safetensors"))]
    scores = [
        t
        for meta in metas
        for c in meta["calls"]
        if c["cls"] == "LogitsProcessor"
        for n, t in c["tensors"].items()
        if ".out.input_token_logprobs" in n
    ]
    assert scores and all(t["token_dims"] is None and "token i+1" in t["why"] for t in scores)
    state = ctl(server, method="get_state")
    assert state[0]["config"]["enable"] is False and state[0]["passes_written"] > 0

    # core mode from the same control route: metadata only, and the log says so
    ctl(server, "enable=true", "exp_name=core", "non_intrusive_mode=core")
    server.generate([prompts[0]], max_new_tokens=2)
    ctl(server, "enable=false")
    code, out, err = dumpdiff("index", dumps / "core", "--no-progress")
    assert code == 0 and " 0 tensor rows" in out
    assert "metadata only" in server.log_text()


def test_planted_prefix_cache_bug_is_named(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(model_dir, env=workflow_env(dumps, DUMPDIFF_PLANT="prefix_kv:1"))
    prompt = prompt_ids(20, seed=3)[0].tolist()
    results = dump_decode_and_reference(server, [prompt], warm=True)
    assert results[0]["meta_info"]["cached_tokens"] >= len(prompt) - 1  # the cache hit happened
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    assert code == 1
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["alignment"]["unkeyed_b"] == 0
    noise = verdict["noise"]
    assert [c["call"] for c in noise["culprits"]] == ["model.layers.1.self_attn.attn#0"]
    planted = noise["culprits"][0]
    assert planted["cls"] == "RadixAttention" and planted["kinds"].get("extend") == 1  # the cache-hit extend row
    assert planted["rows"] == verdict["rows_compared"] == 6  # every row computed after the hit: 1 extend + 5 decode
    strict_calls = {r["culprit"] for r in verdict["per_row"]}
    assert strict_calls <= {"model.layers.1.self_attn.attn#0"} | {c for c in strict_calls if ".layers.0." in c}


def test_tensor_parallel_two_ranks(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(model_dir, tp=2, env=workflow_env(dumps), startup_timeout=400)
    prompt = prompt_ids(10, seed=5)[0].tolist()
    dump_decode_and_reference(server, [prompt], new_tokens=4)
    assert sorted(os.listdir(dumps / "dec")) >= ["rank0", "rank1", "run.json"]
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    assert set(result["ranks"]) == {"0", "1"}
    for verdict in result["ranks"].values():
        assert verdict["alignment"]["unaligned_b"] == 0 and "bit-identical" in verdict["alignment"]["proof"][1]
    assert result["diverged_ranks"] == sorted(int(r) for r, v in result["ranks"].items() if v["rows_differing"])


def test_a_per_head_norm_bug_in_qwen3_is_named_at_the_norm(sglang, tmp_path):
    """sglang's Qwen3 applies q_norm and k_norm to [T*heads, head_dim]. They are compared token
    by token (held as [T, heads, head_dim]), so a decode-only error in layer 1's q_norm is named
    there, not blamed on the attention around it, and nothing else is named."""
    model = make_tiny_qwen3(tmp_path / "qwen3", num_hidden_layers=2)
    dumps = tmp_path / "dumps"
    server = sglang(model, env=workflow_env(dumps, DUMPDIFF_PLANT="q_norm:1"))
    try:
        dump_decode_and_reference(server, [prompt_ids(n, seed=n)[0].tolist() for n in (7, 12)])
    finally:
        server.stop()  # one server less held until the module's end
    code, result = first_divergence_json(dumps / "ref", dumps / "dec")
    verdict = result["ranks"]["0"]
    assert code == 1 and verdict["alignment"]["unaligned_b"] == 0
    assert not any("_norm" in n["call"] for n in verdict["not_comparable"]), verdict["not_comparable"]
    culprits = verdict["noise"]["culprits"]
    assert [c["call"] for c in culprits] == ["model.layers.1.self_attn.q_norm#0"], verdict["summary"]
    assert culprits[0]["kinds"] == {"decode": 2 * 5}  # every decode row: 6 new tokens, the last never fed back
