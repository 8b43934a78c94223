"""MoE routing flips on a tiny Qwen3-MoE: a planted router perturbation in decode passes flips
the top-2 of some rows; the report names the layer, the router call and exactly those rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dumpdiff.analyzer.report.html import to_html
from dumpdiff.analyzer.report.markdown import to_markdown
from dumpdiff.analyzer.verdict import moe
from dumpdiff.analyzer.verdict.diverge import first_divergence
from helpers import dump_pair, dumpdiff, first_divergence_json, load_model, make_tiny_qwen3_moe, prompt_ids

PROMPT, NEW = 16, 8
DELTA = torch.tensor([0.06, -0.06, 0.06, -0.06])  # router logits are ~0.1: enough to swap close experts


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "model")


def plant_router_perturbation(model, layer: int):
    """In decode passes (one token row) add DELTA to layer's router logits and route by the
    perturbed logits, as the router itself would. Returns {position: (experts before, after)}
    for the rows whose top-k changed."""
    gate = model.model.layers[layer].mlp.gate
    flips, step = {}, [0]

    def perturb(module, args, output):
        logits, _, chosen = output
        if logits.shape[0] != 1:
            return output
        logits = logits + DELTA
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, picked = torch.topk(probs, module.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        before, after = sorted(chosen[0].tolist()), sorted(picked[0].tolist())
        if before != after:
            flips[PROMPT + step[0]] = (before, after)
        step[0] += 1
        return logits, top.to(logits.dtype), picked

    gate.register_forward_hook(perturb)
    return flips


@pytest.fixture(scope="module")
def perturbed(moe_dir, tmp_path_factory):
    model = load_model(moe_dir, torch.float32)
    flips = plant_router_perturbation(model, layer=1)
    ref, dec, _ = dump_pair(model, tmp_path_factory.mktemp("dumps"), prompt_ids(PROMPT), new_tokens=NEW)
    return ref, dec, flips


def test_planted_router_perturbation_flips_are_named(perturbed):
    ref, dec, planted = perturbed
    assert planted and len(planted) < NEW - 1, planted  # some decode rows flip, not all
    code, result = first_divergence_json(ref, dec)
    assert code == 1
    flips = {f["call"]: f for f in result["ranks"]["0"]["routing_flips"]}
    layer1 = flips["model.layers.1.mlp.gate#0"]
    assert layer1["layer"] == 1 and layer1["k"] == 2 and layer1["k_from"] == "router output"
    assert layer1["rows_flipped"] == len(planted) and layer1["kinds"] == {"decode": len(planted)}
    assert layer1["rows_compared"] == PROMPT + NEW - 1
    assert {e["pos"]: (e["experts_b"]) for e in layer1["examples"]} == {p: after for p, (_, after) in planted.items()}
    # the reference routes by the unperturbed logits (float noise apart): what decode picked before the perturbation
    assert {e["pos"]: e["experts_a"] for e in layer1["examples"]} == {p: before for p, (before, _) in planted.items()}
    assert all(f["rows_flipped"] == 0 for call, f in flips.items() if call != "model.layers.1.mlp.gate#0")

    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert "routing flips (MoE): The selected experts changed" in out and "first at layer 1" in out
    line = next(text for text in out.splitlines() if text.startswith("  layer 1 model.layers.1.mlp.gate#0"))
    for pos, (before, after) in planted.items():
        assert f"g1.0@{pos} (decode: {before} -> {after})" in line
    md, page = to_markdown(result), to_html(result)
    assert "### Routing flips (MoE)" in md and "| 1 | `model.layers.1.mlp.gate#0` |" in md
    assert "<h2>Routing flips (MoE)</h2>" in page and "<td><code>model.layers.1.mlp.gate#0</code></td>" in page
    for pos in planted:
        assert f"`g1.0@{pos}` decode" in md and f"<code>g1.0@{pos}</code> decode" in page


def test_routers_that_give_only_logits_are_read_through_the_ids_the_experts_took(perturbed, monkeypatch):
    """Routers that return logits only (older HF Linear gates): the expert ids the experts module
    takes as its [tokens, k] input are what the engine picked (a top k recomputed from bfloat16
    logits misses a flip at an exact tie). Without such an input, the top k of the logits, k
    from the model's config.json."""
    ref, dec, planted = perturbed
    found = moe.find_routers
    monkeypatch.setattr(moe, "find_routers", lambda index: [dict(r, indices=None, k=None) for r in found(index)])
    result = first_divergence(ref, dec, progress=False)
    layer1 = next(f for f in result["ranks"]["0"]["routing_flips"] if f["layer"] == 1)
    assert layer1["k_from"] == "experts input" and layer1["k"] == 2 and layer1["rows_flipped"] == len(planted)
    assert sorted(e["pos"] for e in layer1["examples"]) == sorted(planted)
    monkeypatch.setattr(moe, "_experts_ids", lambda index, router: None)  # experts that take no ids
    result = first_divergence(ref, dec, progress=False)
    layer1 = next(f for f in result["ranks"]["0"]["routing_flips"] if f["layer"] == 1)
    assert layer1["k_from"] == "model config" and layer1["rows_flipped"] == len(planted)
    assert sorted(e["pos"] for e in layer1["examples"]) == sorted(planted)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float_noise_alone_flips_no_expert_here(moe_dir, tmp_path, seed):
    """Natural float32 prefill/decode differences reach the routers (1e-7), but on this model no
    row sits that close to a tie: routers are listed with zero flips, and the text says so."""
    model = load_model(moe_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(PROMPT, seed=seed), new_tokens=NEW)
    code, result = first_divergence_json(ref, dec)
    flips = result["ranks"]["0"].get("routing_flips", [])
    assert all(f["rows_flipped"] == 0 for f in flips), flips
    if flips:
        assert all(f["rows_differing"] > 0 and f["k"] == 2 for f in flips)
        assert "but no row's selected experts changed" in to_markdown(result)


def test_a_flip_that_input_noise_causes_is_not_an_introduced_error(moe_dir, tmp_path):
    """A router near a tie: which experts it picks turns on the last bit of its input. Float32
    prefill/decode noise reaches it, some decode rows go to other experts, and the block's output
    differs by O(1). That is noise amplified by a discrete choice, not a bug: the noise-aware
    verdict named the router (an integer error of 1 over a float epsilon) and its MoE block."""
    model = load_model(moe_dir, torch.float32)

    def near_tie(module, args, output):
        logits, weights, _ = output
        hidden = args[0].reshape(-1, args[0].shape[-1])
        lean = 1e-6 * torch.sin(hidden.double().sum(-1) * 1e9).to(logits.dtype)  # one ulp of the input decides
        logits = torch.full_like(logits, -1.0)
        logits[:, 0], logits[:, 1], logits[:, 2] = 2.0, 0.5 + lean, 0.5 - lean  # experts 1 and 2 tie for second
        picked = torch.topk(logits, 2, dim=-1).indices  # routed by its own logits, as a router is
        return logits, torch.full_like(weights, 0.5), picked

    model.model.layers[1].mlp.gate.register_forward_hook(near_tie)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(PROMPT), new_tokens=NEW)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    flipped = sum(f["rows_flipped"] or 0 for f in verdict["routing_flips"])
    assert code == 1 and flipped > 0  # the near tie did flip rows
    assert verdict["noise"]["culprits"] == [], verdict["noise"]["culprits"]
    assert verdict["noise"]["rule"]["rows_flipped_by_noise"] == flipped
    assert "experts flipped because input noise reached the router" in verdict["summary"]


def test_a_router_that_flips_by_itself_is_still_named(moe_dir, tmp_path):
    """Noise reaches every decode row's router input, so "input error > 0" cannot be what calls a
    flip noise: a router that picks the 2nd and 3rd best experts in decode (its logits untouched)
    was counted as noise on every row. Only a near tie among the logits explains a flip."""
    model = load_model(moe_dir, torch.float32)

    def wrong_pick(module, args, output):
        logits, weights, picked = output
        if logits.shape[0] != 1:
            return output
        return logits, weights, torch.topk(logits, 3, dim=-1).indices[:, 1:]

    model.model.layers[1].mlp.gate.register_forward_hook(wrong_pick)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(PROMPT), new_tokens=NEW)
    code, result = first_divergence_json(ref, dec)
    noise = result["ranks"]["0"]["noise"]
    assert [c["call"] for c in noise["culprits"]][:1] == ["model.layers.1.mlp.gate#0"], noise["culprits"]
    assert "rows_flipped_by_noise" not in noise["rule"]


def test_top_k_ids_in_another_order_are_the_same_choice():
    """Float noise that swaps two selected experts' ranks at a near tie changes the router's
    top-k ids in order only (and its weights by about the tie's width): the same experts, the
    same output. The id tensor differing was a whole-value "error" from clean inputs, and the
    router was named on clean bfloat16 Mixtral, OLMoE and Qwen3-MoE runs (72-128x)."""
    from dumpdiff.analyzer.dump.dtypes import BY_NAME
    from dumpdiff.analyzer.verdict.noise import _compare_rows

    int64 = BY_NAME["int64"]
    ref = np.array([[3, 1], [0, 2], [5, 4]], dtype=np.int64).view(np.uint64)
    test = np.array([[1, 3], [0, 2], [5, 6]], dtype=np.int64).view(np.uint64)  # swapped / same / another expert
    rel, _, _, _ = _compare_rows(ref, test, int64, None, None)
    assert rel.tolist() == [0.0, 0.0, 1.0]
    # a one-hot row (SwitchTransformers' expert_index) repeats values: its order is the choice
    one_hot = np.array([[1, 0, 0, 0]], dtype=np.int64).view(np.uint64)
    other = np.array([[0, 1, 0, 0]], dtype=np.int64).view(np.uint64)
    assert _compare_rows(one_hot, other, int64, None, None)[0].tolist() == [1.0]
