"""`dumpdiff compare` on the real sglang server on CPU against HF transformers loaded from the
same weights, and sglang at tp=2 against tp=1: the engine's fused and parallel layouts mapped
onto HF's modules, a clean port within precision, a planted porting bug named at its layer."""

from __future__ import annotations

import json

import pytest
import torch
from test_compare import compare_json, dump_run

from helpers import check_schema, dumpdiff, make_tiny_llama, prompt_ids
from sglang_server import sglang_fixture

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")

LAYERS = 3
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def prompt():
    return prompt_ids(16, seed=11)


@pytest.fixture(scope="module")
def hf_run(model_dir, prompt, tmp_path_factory):
    return dump_run(model_dir, tmp_path_factory.mktemp("hf"), "hf", torch.float32, prompt, new_tokens=NEW_TOKENS)


def sglang_run(sglang, model_dir, prompt, root, name, tp=1, **env):
    """Dump the server's generate of the prompt (prefill + decode steps), as HF's run did."""
    server = sglang(
        model_dir,
        tp=tp,
        env={"DUMPER_ENABLE": "0", "DUMPER_SERVER_PORT": "reuse", "DUMPER_DIR": str(root), **env},
        startup_timeout=400,
    )
    dump_request(server, name, lambda: server.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS))
    server.stop()
    return root / name


def dump_request(server, name, request):
    """Enable the server's dumper as experiment ``name``, make the request, disable it."""
    for settings in (["enable=true", f"exp_name={name}"], None, ["enable=false"]):
        if settings is None:
            request()
            continue
        code, _, err = dumpdiff("ctl", "configure", *settings, f"--url={server.control_url}")
        assert code == 0, err


@pytest.fixture(scope="module")
def sglang_tp1(sglang, model_dir, prompt, tmp_path_factory):
    return sglang_run(sglang, model_dir, prompt, tmp_path_factory.mktemp("sglang"), "tp1")


def test_sglang_computes_what_hf_computes(hf_run, sglang_tp1):
    code, result = compare_json(hf_run, sglang_tp1)
    ops = assert_port_within_precision(code, result)
    assert result["adds_most"]["call"] in ops


def assert_port_within_precision(code, result) -> dict:
    """A clean engine against HF: every row compared, none beyond precision, and the engine's
    fused and parallel modules judged under HF's names. Returns the ops by call."""
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert result["alignment"]["unaligned_b"] == 0  # both generated the same tokens: every row compared
    assert "bit-identical" in result["alignment"]["proof"][1]
    ops = {op["call"]: op for op in result["ops"]}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj"):
            assert ops[f"{prefix}.self_attn.{name}#0"]["cls_b"] == "QKVParallelLinear"
        for name in ("gate_proj", "up_proj"):
            assert ops[f"{prefix}.mlp.{name}#0"]["cls_b"] == "MergedColumnParallelLinear"
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert ops[f"{prefix}.{name}#0"]["cls_b"] == "RowParallelLinear"
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert ops[f"{prefix}.{name}#0"]["cls_b"] == "RMSNorm"
    # the engine's norm returns (out, residual): from layer 1 on, its residual is HF's norm input
    assert ops["model.layers.1.input_layernorm#0"]["in_eps"] is not None
    assert any("residual" in rule for rule in result["mapping"]["rules"])
    return ops


def test_a_porting_bug_in_sglang_is_named_at_its_layer(sglang, model_dir, prompt, hf_run, tmp_path):
    planted = sglang_run(sglang, model_dir, prompt, tmp_path, "planted", DUMPDIFF_PLANT="gate_up_swap:1")
    code, result = compare_json(hf_run, planted)
    assert code == 1 and result["kind"] == "beyond-precision"
    first = result["first"]  # the engine's activation is compared nowhere: the code before down_proj's input
    assert first["kind"] == "gap" and first["call"] == "model.layers.1.mlp.down_proj#0"
    assert first["after"] == "model.layers.1.mlp.up_proj#0"
    assert all("model.layers.1." in place for place in result["culprits"])
    assert result["adds_most"]["call"].startswith("model.layers.1.mlp")


def test_tensor_parallel_two_ranks_against_one(sglang, model_dir, prompt, hf_run, sglang_tp1, tmp_path):
    tp2 = sglang_run(sglang, model_dir, prompt, tmp_path, "tp2", tp=2)
    run = json.loads((tp2 / "run.json").read_text())
    check_schema(run, "run")
    heads, kv_heads, head_dim = 4, 2, 16  # tiny_models' Llama: each rank holds half of them
    assert run["tp_size"] == 2
    assert run["parts"]["model.layers.0.self_attn.qkv_proj"] == [heads * head_dim // 2, kv_heads * head_dim // 2] + [
        kv_heads * head_dim // 2
    ]
    code, result = compare_json(sglang_tp1, tp2)
    assert code == 0 and result["culprits"] == [], result["summary"]
    # docs/compare.md: the kernels first differ where the row-parallel sum is split across ranks
    assert result["first_difference"]["call"] == "model.layers.0.self_attn.o_proj#0", result["first_difference"]
    assert "2 ranks" in result["mapping"]["shards"][0]
    joined = result["mapping"]["joined"]["test"]
    for layer in range(LAYERS):  # column-parallel outputs side by side, row-parallel ones reduced after the hook
        assert joined[f"model.layers.{layer}.self_attn.q_proj#0.out.0"] == "shards"
        assert joined[f"model.layers.{layer}.mlp.down_proj#0.in.0"] == "shards"
        assert joined[f"model.layers.{layer}.self_attn.o_proj#0.out.0"] == "sum"
    assert result["mapping"]["joined"]["reference"] == {}
    ops = {op["call"] for op in result["ops"]}
    assert {f"model.layers.{layer}.self_attn.k_proj#0" for layer in range(LAYERS)} <= ops
    code, result = compare_json(hf_run, tp2)  # and against HF, through both the fused and the sharded layout
    assert code == 0 and result["culprits"] == [], result["summary"]


def test_a_model_hf_fuses_too_is_mapped_part_by_part(sglang, tmp_path):
    """Phi-3: HF fuses qkv_proj and gate_up_proj as the engine does, and names its activation
    activation_fn and its dropouts apart. Both runs' fused outputs are cut into q/k/v and
    gate/up by the widths the engine records, and what only HF has is left out."""
    from tiny_models import make_tiny_phi3

    model_dir = make_tiny_phi3(tmp_path / "phi3", num_hidden_layers=LAYERS)
    prompt = prompt_ids(16, seed=3)
    hf = dump_run(model_dir, tmp_path / "hf", "hf", torch.float32, prompt, new_tokens=NEW_TOKENS)
    port = sglang_run(sglang, model_dir, prompt, tmp_path / "sglang", "sglang")
    code, result = compare_json(hf, port)
    assert code == 0 and result["culprits"] == [], result["summary"]
    ops = {op["call"]: op for op in result["ops"]}
    for layer in range(LAYERS):
        for name, cls_b in (("self_attn.q_proj", "QKVParallelLinear"), ("mlp.up_proj", "MergedColumnParallelLinear")):
            op = ops[f"model.layers.{layer}.{name}#0"]
            assert (op["cls"], op["cls_b"]) == ("Linear", cls_b)  # a part of HF's fused Linear, of the engine's
    assert any("dropouts" in rule for rule in result["mapping"]["rules"])
