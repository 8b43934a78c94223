"""`dumpdiff compare` on the real vLLM server on CPU against HF transformers loaded from the
same weights: vLLM's fused and parallel layouts mapped onto HF's modules, a clean port within
precision, a planted bug named at its layer."""

from __future__ import annotations

import pytest
import test_compare_sglang as on_sglang
import torch
from test_compare import compare_json, dump_run
from test_vllm_e2e import make_model

from helpers import prompt_ids
from vllm_server import vllm_fixture

pytestmark = pytest.mark.vllm
vllm = vllm_fixture(scope="module")
LAYERS, NEW_TOKENS = on_sglang.LAYERS, on_sglang.NEW_TOKENS
prompt, hf_run = on_sglang.prompt, on_sglang.hf_run  # the same prompt, HF dumped from this module's model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama") / "model", layers=LAYERS)


def vllm_run(vllm, model_dir, prompt, root, name, tp=1, extra_args=(), **env):
    """Dump the server's completion of the prompt (prefill + decode steps), as HF's generate did."""
    server = vllm(
        model_dir,
        tp=tp,
        extra_args=extra_args,
        env={"DUMPER_ENABLE": "0", "DUMPER_SERVER_PORT": "auto", "DUMPER_DIR": str(root), **env},
        startup_timeout=400,
    )
    try:
        on_sglang.dump_request(server, name, lambda: server.complete([prompt[0].tolist()], max_tokens=NEW_TOKENS))
    finally:
        server.stop()
    return root / name


@pytest.fixture(scope="module")
def vllm_clean(vllm, model_dir, prompt, tmp_path_factory):
    return vllm_run(vllm, model_dir, prompt, tmp_path_factory.mktemp("vllm"), "vllm")


def test_vllm_computes_what_hf_computes(hf_run, vllm_clean):
    code, result = compare_json(hf_run, vllm_clean)
    ops = on_sglang.assert_port_within_precision(code, result)
    assert result["b"]["engine"] == "vllm" and ops["model.norm#0"]["cls_b"] == "RMSNorm"
    # vLLM's logits are computed after the model's forward, where no hook sees them
    assert not any(call.startswith(("lm_head#", "<root>#")) for call in ops)
    assert any("logits not compared" in rule for rule in result["mapping"]["rules"])


def test_a_bug_in_vllm_is_named_at_its_layer(vllm, model_dir, prompt, hf_run, tmp_path):
    planted = vllm_run(vllm, model_dir, prompt, tmp_path, "planted", DUMPDIFF_PLANT="decode_mlp:1")
    code, result = compare_json(hf_run, planted)
    assert code == 1 and result["kind"] == "beyond-precision", result["summary"]
    assert result["first"]["call"] == "model.layers.1.mlp.down_proj#0", result["first"]
    assert all("model.layers.1." in place for place in result["culprits"])
    assert result["adds_most"]["call"].startswith("model.layers.1.mlp")
    # the plant scales only passes where every request decodes: the prompt's rows stay within precision
    first = result["first"]
    assert first["row"]["kind"] == "decode" and first["rows_over"] == NEW_TOKENS - 1, first


def test_tensor_parallel_two_ranks_against_hf(vllm, model_dir, prompt, hf_run, tmp_path):
    """vLLM's row-parallel layers all-reduce inside their forward: every rank's o_proj and
    down_proj output is the whole sum; q/k/v, gate/up and the row-parallel inputs are shards."""
    tp2 = vllm_run(vllm, model_dir, prompt, tmp_path, "tp2", tp=2)
    code, result = compare_json(hf_run, tp2)
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert "2 ranks" in result["mapping"]["shards"][0]
    joined = result["mapping"]["joined"]["test"]
    for layer in range(LAYERS):
        assert joined[f"model.layers.{layer}.self_attn.q_proj#0.out.0"] == "shards"
        assert joined[f"model.layers.{layer}.mlp.down_proj#0.in.0"] == "shards"
        assert f"model.layers.{layer}.self_attn.o_proj#0.out.0" not in joined  # reduced before the hook
    ops = {op["call"] for op in result["ops"]}
    assert {f"model.layers.{layer}.self_attn.{n}#0" for layer in range(LAYERS) for n in ("k_proj", "o_proj")} <= ops


def test_bfloat16_vllm_against_float32_hf(vllm, model_dir, prompt, hf_run, tmp_path):
    """vLLM served in bfloat16, as on a GPU, against HF in float32: the embedding proved by
    rounding, every op judged in bfloat16 epsilons, none beyond precision."""
    bf16 = vllm_run(vllm, model_dir, prompt, tmp_path, "bf16", extra_args=["--dtype", "bfloat16"])
    code, result = compare_json(hf_run, bf16)
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert result["precision"] == {"reference": "float32", "test": "bfloat16"}
    assert "equal after rounding float32 to bfloat16" in result["alignment"]["proof"][1]
    ops = {op["call"] for op in result["ops"]}
    assert {f"model.layers.{layer}.mlp.down_proj#0" for layer in range(LAYERS)} <= ops


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2"])
def test_other_layouts_against_hf(vllm, arch, tmp_path):
    """Qwen3 (per-head q_norm and k_norm), Phi-3 (HF fuses qkv_proj and gate_up_proj too) and
    Gemma-2 (four norms a layer, two of them plain, a scaled embedding): every HF op has its vLLM
    counterpart and none strays beyond precision."""
    import tiny_models

    shapes = dict(num_hidden_layers=LAYERS, hidden_size=128, intermediate_size=256)
    if arch != "phi3":
        shapes["head_dim"] = 32  # vLLM's CPU attention runs head sizes from 32
    model_dir = getattr(tiny_models, f"make_tiny_{arch}")(tmp_path / arch, **shapes)
    prompt = prompt_ids(16, seed=5)
    hf = dump_run(model_dir, tmp_path / "hf", "hf", torch.float32, prompt, new_tokens=NEW_TOKENS)
    port = vllm_run(vllm, model_dir, prompt, tmp_path / "vllm", "vllm")
    code, result = compare_json(hf, port)
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert result["alignment"]["unaligned_b"] == 0
    ops = {op["call"]: op for op in result["ops"]}
    for layer in range(LAYERS):
        assert {f"model.layers.{layer}.self_attn.{n}#0" for n in ("q_proj", "k_proj", "v_proj", "o_proj")} <= set(ops)
        assert {f"model.layers.{layer}.mlp.{n}#0" for n in ("gate_proj", "up_proj", "down_proj")} <= set(ops)
    if arch == "qwen3":
        assert ops["model.layers.1.self_attn.k_norm#0"]["cls_b"] == "RMSNorm"
    if arch == "gemma2":
        # HF scales the looked-up rows inside its embedding module, vLLM after it: the proof says
        # so, and the scaled rows are compared where both hold them, as the first layer's input
        assert "times sqrt(hidden_size)" in result["alignment"]["proof"][1]
        assert "model.embed_tokens#0" not in ops and ops["model.layers.0.input_layernorm#0"]["in_eps"] is not None
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        assert {f"model.layers.{layer}.{norm}#0" for layer in range(LAYERS) for norm in norms} <= set(ops)
