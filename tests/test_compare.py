"""`dumpdiff compare` on two runs of one model's weights: HF float32 against HF bfloat16, a
planted error in one run, mapping files and what they refuse. The sglang runs are in
tests/test_compare_sglang.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dumpdiff import dumper
from helpers import (
    dump_padded_batch,
    dumpdiff,
    load_model,
    make_tiny_llama,
    make_tiny_qwen3_moe,
    prompt_ids,
    report_json,
)

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=LAYERS)


def dump_run(model_path, root, name, dtype, prompt, new_tokens=4, plant=None, plant_input=None, hook=None, **config):
    """Dump `generate` of the prompt with the model loaded in ``dtype``; ``plant``: (module path,
    factor) scales that module's output in every pass, as a wrong port would; ``plant_input``
    scales its input (code between modules, which no hook sees); ``hook``: (module path, forward
    hook) changes that module's output otherwise; ``config``: more DumperConfig settings (a filter)."""
    model = load_model(model_path, dtype)
    if hook:
        model.get_submodule(hook[0]).register_forward_hook(hook[1])
    if plant:
        model.get_submodule(plant[0]).register_forward_hook(lambda mod, args, out: out * plant[1])
    if plant_input:
        model.get_submodule(plant_input[0]).register_forward_pre_hook(
            lambda mod, args: (args[0] * plant_input[1],) + tuple(args[1:])
        )
    handle = dumper.install(
        model, dumper.DumperConfig(dir=str(root), enable=True, exp_name=name, cleanup_previous=True, **config)
    )
    try:
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    finally:
        handle.remove()
    return root / name


def compare_json(a, b, *extra):
    return report_json("compare", a, b, *extra)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    prompt = prompt_ids(20, seed=7)
    return {
        "f32": dump_run(model_dir, root, "f32", torch.float32, prompt),
        "bf16": dump_run(model_dir, root, "bf16", torch.bfloat16, prompt),
        "bf16-bug": dump_run(
            model_dir, root, "bf16-bug", torch.bfloat16, prompt, plant=("model.layers.2.mlp.down_proj", 1.25)
        ),
        "bf16-gap": dump_run(
            model_dir, root, "bf16-gap", torch.bfloat16, prompt, plant_input=("model.layers.1.mlp.down_proj", 1.25)
        ),
    }


def test_bfloat16_against_float32_stays_within_precision(runs):
    code, result = compare_json(runs["f32"], runs["bf16"])
    assert code == 0 and result["kind"] == "within-precision" and result["culprits"] == []
    proof = result["alignment"]["proof"]
    assert "token ids and positions equal" in proof[0]
    assert "equal after rounding float32 to bfloat16" in proof[1]  # what it checked instead of bit identity
    assert result["precision"] == {"reference": "float32", "test": "bfloat16"}
    ops = {op["call"]: op for op in result["ops"]}
    for layer in range(LAYERS):  # every op of every layer judged, under HF's names
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "input_layernorm"):
            assert f"model.layers.{layer}.{name}#0" in ops
    bf16_eps = 2.0**-7
    assert all(op["eps"] == bf16_eps for op in result["ops"])  # judged in the coarser type's epsilons
    most = result["adds_most"]
    assert most["jump"] == max(op["jump"] for op in result["ops"] if op["jump"] is not None)
    assert most["call"] in result["summary"]


def test_a_planted_error_in_the_bfloat16_run_is_named_at_its_op(runs):
    code, result = compare_json(runs["f32"], runs["bf16-bug"])
    assert code == 1 and result["kind"] == "beyond-precision"
    assert result["first"]["call"] == "model.layers.2.mlp.down_proj#0"
    assert result["adds_most"]["call"] in ("model.layers.2.mlp.down_proj#0", "model.layers.2.mlp#0")
    assert all(".layers.2." in call for call in result["culprits"])  # what follows carries it, adds nothing
    assert "model.layers.2.mlp.down_proj#0" in result["summary"]


def test_an_error_in_code_between_modules_is_placed_between_them(runs):
    """act_fn(gate) * up is code of LlamaMLP's forward, no module's: an error there shows first
    at down_proj's input, and is placed between the last op compared before it and down_proj."""
    code, result = compare_json(runs["f32"], runs["bf16-gap"])
    assert code == 1
    first = result["first"]
    assert first["kind"] == "gap" and first["call"] == "model.layers.1.mlp.down_proj#0"
    assert first["after"] == "model.layers.1.mlp.up_proj#0"
    assert (
        result["culprits"][0]
        == "code not compared between model.layers.1.mlp.up_proj#0 and model.layers.1.mlp.down_proj#0"
    )
    assert all(".layers.1." in place for place in result["culprits"])


@pytest.mark.parametrize("fmt, mark", [("text", "WITHIN PRECISION"), ("md", "## Ops"), ("html", "<table>")])
def test_every_format_tells_the_verdict(runs, fmt, mark):
    code, out, err = dumpdiff("compare", runs["f32"], runs["bf16"], "--format", fmt, "--no-progress")
    assert code == 0, err
    assert mark in out and "model.layers.3.mlp.down_proj#0" in out


def test_a_module_left_without_counterpart_is_named(runs, tmp_path):
    rules = tmp_path / "rename.json"
    rules.write_text(
        json.dumps({"rule": [{"match": r"(.*)\.up_proj#(\d+)\.(.*)", "to": r"\1.up#\2.\3", "side": "test"}]})
    )
    code, out, err = dumpdiff("compare", runs["f32"], runs["bf16"], "--map", rules, "--no-progress")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "model.layers.0.mlp.up_proj#0 [Linear] of TEST" in err and "--map" in err


def test_a_mapping_file_renames_a_layout_of_ones_own(runs, tmp_path):
    """A TOML mapping that renames the test run's o_proj to another name, and back: compared."""
    rules = tmp_path / "map.toml"
    rules.write_text(
        "[[rule]]\n"
        "side = 'reference'\n"
        "match = '(.*)\\.o_proj#(\\d+)\\.(.*)'\n"
        "to = '\\1.out_proj#\\2.\\3'\n"
        "[[rule]]\n"
        "side = 'test'\n"
        "match = '(.*)\\.o_proj#(\\d+)\\.(.*)'\n"
        "to = ['\\1.out_proj#\\2.\\3']\n"
    )
    code, result = compare_json(runs["f32"], runs["bf16"], "--map", rules)
    assert code == 0
    calls = {op["call"] for op in result["ops"]}
    assert "model.layers.1.self_attn.out_proj#0" in calls and "model.layers.1.self_attn.o_proj#0" not in calls
    assert any("map.toml rule 1" in r for r in result["mapping"]["rules"])


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "not valid JSON"),
        ("[[rule]]\nmatch = 'a'\nignore = true\n", "a TOML file's name ends in .toml"),
        ('{"rule": [{"to": "x"}]}', "'match'"),
        ('{"rule": [{"match": "(", "ignore": true}]}', "not a regular expression"),
        ('{"rule": [{"match": "a", "split": ["b", "c"], "sizes": [1]}]}', "'sizes'"),
        ('{"rule": [{"match": "a", "ignore": true, "colour": 1}]}', "unknown field 'colour'"),
        ('{"rule": [{"match": "(.*)#(\\\\d+)", "to": "\\\\3.x"}]}', "invalid group reference 3"),
        ('{"rule": [{"match": "(.*)", "to": "\\\\g<layer>"}]}', "unknown group name 'layer'"),
        ('{"rule": [{"match": "a", "ignore": true, "engine": 5}]}', "'engine' takes a string"),
        ('{"rule": [{"match": "a", "split": "b"}]}', "'split' takes a list of two or more names"),
        ('{"rule": [{"match": "a", "ignore": "yes"}]}', "'ignore' is true or false"),
        ('{"rule": [{"match": "a", "ignore": true, "when": "out1"}]}', "in.<slot> or out.<slot>"),
        ('{"rules": [{"match": "a", "ignore": true}]}', 'under "rule"'),
        ('{"rule": [], "rules": [{"match": "a", "ignore": true}]}', "unknown key 'rules'"),
    ],
)
def test_a_bad_mapping_file_is_one_line(runs, tmp_path, content, says):
    rules = tmp_path / "bad.json"
    rules.write_text(content)
    code, out, err = dumpdiff("compare", runs["f32"], runs["bf16"], "--map", rules, "--no-progress")
    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1, err
    assert "internal error" not in err and "bad.json" in err


def test_a_mapping_file_in_bad_toml_is_one_line(runs, tmp_path):
    rules = tmp_path / "bad.toml"
    rules.write_text("[[rule]\nmatch = 'a'\n")
    code, out, err = dumpdiff("compare", runs["f32"], runs["bf16"], "--map", rules, "--no-progress")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "mapping file bad.toml is not valid TOML" in err and "line 1" in err


def test_sizes_that_do_not_add_up_name_the_rule(runs, tmp_path):
    rules = tmp_path / "cut.json"
    rules.write_text(
        json.dumps(
            {
                "rule": [
                    {
                        "match": r"(.*)\.down_proj#(\d+)\.out\.0",
                        "split": [r"\1.half_a#\2.out.0", r"\1.half_b#\2.out.0"],
                        "sizes": [10, 10],
                    }
                ]
            }
        )
    )
    code, out, err = dumpdiff("compare", runs["f32"], runs["bf16"], "--map", rules, "--no-progress")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "(width 64 on one rank) into 2 parts of widths [10, 10]" in err and "'sizes' of cut.json rule 1" in err


def test_runs_of_other_weights_fail_the_proof(runs, tmp_path):
    other = make_tiny_llama(tmp_path / "other", seed=1, num_hidden_layers=LAYERS)
    dumped = dump_run(other, tmp_path / "dumps", "other", torch.bfloat16, prompt_ids(20, seed=7))
    code, out, err = dumpdiff("compare", runs["f32"], dumped, "--no-progress")
    assert code == 2 and "alignment proof failed" in err and "different weights" in err


def test_runs_of_other_decode_lengths_compare_the_rows_both_computed(runs, model_dir, tmp_path):
    """The same float32 model run for 8 new tokens against 4: the rows both computed are the same
    bits, no op adds an error (none is named as adding the most), and the rows only the longer
    run computed are said in a warning."""
    longer = dump_run(model_dir, tmp_path, "f32-long", torch.float32, prompt_ids(20, seed=7), new_tokens=8)
    code, result = compare_json(runs["f32"], longer)
    assert code == 0 and result["culprits"] == []
    assert result["alignment"]["paired"] == 20 + 4 - 1 and result["alignment"]["unaligned_b"] == 4
    assert all(op["out_eps"] == 0 for op in result["ops"])
    assert result["adds_most"] is None and "no op adds an error" in result["summary"]
    assert result["first_difference"] is None
    assert any(w.startswith("4 token rows of f32-long without partner in the reference") for w in result["warnings"])
    code, result = compare_json(longer, runs["f32"])  # the longer run as the reference: its rows left over
    assert code == 0 and result["alignment"]["unaligned_b"] == 0
    assert any(
        w.startswith("4 token rows of f32-long (the reference) without partner in f32") for w in result["warnings"]
    )


def test_a_run_dumped_with_a_filter_is_compared_on_what_both_dumped(runs, model_dir, tmp_path):
    """DUMPER_FILTER on one side only: the modules it left out are not 'without counterpart' (no
    mapping file can help); the modules both runs dumped are compared, and the report says so."""
    only = r"embed_tokens|layers\.1\."
    filtered = dump_run(model_dir, tmp_path, "bf16-l1", torch.bfloat16, prompt_ids(20, seed=7), filter=only)
    for ref, test, left_out in ((runs["f32"], filtered, "f32"), (filtered, runs["bf16"], "bf16")):
        code, result = compare_json(ref, test)
        assert code == 0 and result["culprits"] == [], result["summary"]
        layers = {op["call"].split(".")[2] for op in result["ops"] if op["call"].startswith("model.layers.")}
        assert layers == {"1"}
        warning = next(w for w in result["warnings"] if "DUMPER_FILTER" in w)
        # 10 leaves in each of layers 0, 2 and 3; the final norm, the rotary embedding, lm_head
        assert warning.startswith(f"{3 * 10 + 3} modules of {left_out} (")
        assert "only the modules both runs dumped are compared" in warning
    planted = dump_run(
        model_dir, tmp_path, "bf16-l1-bug", torch.bfloat16, prompt_ids(20, seed=7), filter=only,
        plant=("model.layers.1.mlp.down_proj", 1.25),
    )  # fmt: skip
    code, result = compare_json(runs["f32"], planted)
    assert code == 1 and result["first"]["call"] == "model.layers.1.mlp.down_proj#0"


def test_a_left_padded_batch_against_its_prompts_alone_across_dtypes(model_dir, tmp_path):
    """Three prompts of other lengths generated in one left-padded bfloat16 batch, against each
    prompt+output as a float32 prefill of its own: every row of the batch (no pad row) is paired
    and proved, and no op strays beyond bfloat16's precision."""
    _, ref_f32, _ = dump_padded_batch(load_model(model_dir), tmp_path / "f32", new_tokens=4)
    prompts, _, dec_bf16 = dump_padded_batch(load_model(model_dir, torch.bfloat16), tmp_path / "bf16", new_tokens=4)
    code, result = compare_json(ref_f32, dec_bf16)
    rows = sum(len(p) for p in prompts) + len(prompts) * (4 - 1)
    assert result["alignment"]["rows_b"] == result["alignment"]["paired"] == rows
    assert "equal after rounding float32 to bfloat16" in result["alignment"]["proof"][1]
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert all(op["rows"] == rows for op in result["ops"] if op["call"].startswith("model."))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3 (per-head q_norm and k_norm in its attention), 3 layers, float32 and bfloat16 runs,
    and a bfloat16 run whose layer 1 k_norm output is 25% off."""
    from tiny_models import make_tiny_qwen3

    root = tmp_path_factory.mktemp("qwen3")
    path = make_tiny_qwen3(root / "model", num_hidden_layers=3)
    prompt = prompt_ids(20, seed=5)
    return {
        "f32": dump_run(path, root, "f32", torch.float32, prompt),
        "bf16": dump_run(path, root, "bf16", torch.bfloat16, prompt),
        "bug": dump_run(path, root, "bug", torch.bfloat16, prompt, plant=("model.layers.1.self_attn.k_norm", 1.25)),
    }


def test_qwen3_q_norm_and_k_norm_are_judged_and_a_wrong_one_named(qwen3):
    code, result = compare_json(qwen3["f32"], qwen3["bf16"])
    assert code == 0 and result["culprits"] == [], result["summary"]
    ops = {op["call"]: op for op in result["ops"]}
    for layer in range(3):
        for norm in ("q_norm", "k_norm"):
            assert ops[f"model.layers.{layer}.self_attn.{norm}#0"]["cls"] == "Qwen3RMSNorm"
            assert ops[f"model.layers.{layer}.self_attn.{norm}#0"]["line_from"].startswith("2 peers")
    code, result = compare_json(qwen3["f32"], qwen3["bug"])
    assert code == 1 and result["first"]["call"] == "model.layers.1.self_attn.k_norm#0"
    assert all(".layers.1." in place or ".layers.1#" in place for place in result["culprits"])  # its containers


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Qwen3-MoE, 3 layers of 8 experts (top 2), on 200 prompt tokens: float32 and bfloat16 runs,
    whose routers choose other experts on a few rows (scores a rounding apart), and a bfloat16
    run whose layer 0 experts' output is 25% off."""
    root = tmp_path_factory.mktemp("moe")
    path = make_tiny_qwen3_moe(root / "model", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)
    prompt = prompt_ids(200, seed=4)
    return {
        "f32": dump_run(path, root, "f32", torch.float32, prompt, new_tokens=2),
        "bf16": dump_run(path, root, "bf16", torch.bfloat16, prompt, new_tokens=2),
        "bug": dump_run(
            path, root, "bug", torch.bfloat16, prompt, new_tokens=2, plant=("model.layers.0.mlp.experts", 1.25)
        ),
        "router-bug": dump_run(
            path, root, "router-bug", torch.bfloat16, prompt, new_tokens=2, hook=("model.layers.1.mlp.gate", _lowest)
        ),
    }


def _lowest(module, args, out):
    """A router that, on every tenth row, sends the token to the expert it scores lowest."""
    logits, scores, indices = out
    indices = indices.clone()
    indices[::10, 0] = logits[::10].argmin(dim=-1)
    return logits, scores, indices


def test_moe_routing_flips_are_told_apart_from_errors(moe):
    """A row whose router chose other experts differs by O(1) in its MoE block: a flip, not an op
    beyond precision. Those rows are not judged, and they no longer lift the line of the other
    layers' experts: a 25% error in layer 0's experts is named (judged against layers whose
    flipped rows jumped 100x, it passed)."""
    code, result = compare_json(moe["f32"], moe["bf16"])
    assert code == 0 and result["culprits"] == [], result["summary"]
    flips = result["routing_flips"]
    assert flips and all(f["rows_flipped"] >= 1 and f["k"] == 2 for f in flips)
    for flip in flips:
        assert flip["block"] == flip["router"].rsplit(".", 1)[0] == f"model.layers.{flip['block'].split('.')[2]}.mlp"
        assert all(e["experts_a"] != e["experts_b"] for e in flip["examples"])
    assert "chose other experts" in result["summary"]
    experts = [op for op in result["ops"] if op["call"].endswith(".mlp.experts#0")]
    assert len(experts) == 3 and all(op["jump"] < 10 for op in experts)  # no flipped row judged
    code, result = compare_json(moe["f32"], moe["bug"])
    assert code == 1 and result["first"]["call"] == "model.layers.0.mlp.experts#0", result["summary"]


def test_a_router_that_does_not_pick_its_top_k_is_no_flip(moe):
    """Rows where a run's experts are not the top k of its own router scores are no rounding
    flip: they are counted apart and judged, and the experts that ran on them are named."""
    code, result = compare_json(moe["f32"], moe["router-bug"])
    flips = {flip["router"]: flip for flip in result["routing_flips"]}
    assert flips["model.layers.1.mlp.gate#0"]["rows_not_top_k"] >= 10
    assert all(flip["rows_not_top_k"] == 0 for router, flip in flips.items() if ".layers.1." not in router)
    assert code == 1 and result["first"]["call"] == "model.layers.1.mlp.experts#0", result["summary"]
    code, out, _ = dumpdiff("compare", moe["f32"], moe["router-bug"], "--no-progress")
    assert "not the top 2 of its own scores" in out


def test_an_embedding_that_scales_its_lookup_is_proved_within_rounding(tmp_path):
    """Gemma-2 multiplies the looked-up row by sqrt(hidden_size) in the model's dtype: with a
    hidden size whose root is no power of two (96 here; 3584 in Gemma-2 9B) the bfloat16 run's
    embedding is not the float32 one rounded, yet both come from the same weights. The proof
    then checks each element within 2 bfloat16 units in the last place, and says so; runs of
    other weights still fail it."""
    from tiny_models import make_tiny_gemma2

    path = make_tiny_gemma2(tmp_path / "gemma2", hidden_size=96, num_hidden_layers=3)
    other = make_tiny_gemma2(tmp_path / "gemma2-other", seed=1, hidden_size=96, num_hidden_layers=3)
    prompt = prompt_ids(20, seed=7)
    f32 = dump_run(path, tmp_path, "f32", torch.float32, prompt)
    code, result = compare_json(f32, dump_run(path, tmp_path, "bf16", torch.bfloat16, prompt))
    assert code == 0 and result["culprits"] == [], result["summary"]
    assert "within 2 bfloat16 units in the last place on all 23 paired rows" in result["alignment"]["proof"][1]
    code, out, err = dumpdiff(
        "compare", f32, dump_run(other, tmp_path, "other", torch.bfloat16, prompt), "--no-progress"
    )
    assert code == 2 and "alignment proof failed" in err and "different weights" in err


def test_against_vllm_the_logits_are_left_out_not_unmapped(runs):
    """vLLM's model runner computes the logits after the model's forward, where no dump sees them:
    against a vLLM run, the HF run's lm_head and logits are left out of the comparison (else
    every vLLM comparison would stop on lm_head "without counterpart"); against sglang, whose
    forward returns the logits, they are compared."""
    from dumpdiff.analyzer.dump.load import open_dump
    from dumpdiff.analyzer.index.store import load_indexes
    from dumpdiff.analyzer.verdict.canon import map_rank
    from dumpdiff.analyzer.verdict.mapping import BUILTIN

    (index,) = load_indexes([open_dump(str(runs["f32"]))], progress=False)
    index = index.rank(0)
    against_vllm = map_rank(index, BUILTIN, "reference", "hf", "vllm")
    against_sglang = map_rank(index, BUILTIN, "reference", "hf", "sglang")
    assert "lm_head#0.out.0" in against_sglang.pieces and "lm_head#0.out.0" not in against_vllm.pieces
    assert {"lm_head#0", "<root>#0"} <= against_vllm.ignored
    assert any("vLLM computes the logits" in rule for rule in against_vllm.rules_used)  # the report says so
    assert set(against_sglang.pieces) - set(against_vllm.pieces) == {
        n for n in against_sglang.pieces if n.startswith(("lm_head#", "<root>#"))
    }


@pytest.mark.parametrize("setting", ["", r"layers\.1\.", "name=mlp", "layer_id=1|2", "layer_id=0", "embed|norm$"])
def test_the_filter_a_run_was_dumped_with_is_read_as_the_dumper_applies_it(setting):
    """compare tells a module another run's DUMPER_FILTER left out from one without counterpart
    by applying that filter to the module's path: as the dumper selected modules."""
    from dumpdiff.analyzer.verdict.canon import dumped_by
    from dumpdiff.dumper.config import compile_filter

    paths = ["model.embed_tokens", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "lm_head"]
    paths += ["model.layers.2.post_attention_layernorm", "model.layers.12.mlp", "model.norm"]
    hooked = dumped_by(setting)
    assert [hooked(p) for p in paths] == [compile_filter(setting)(p, "Linear") for p in paths]


def test_a_fingerprint_dump_is_refused_with_what_to_do(runs, model_dir, tmp_path):
    prints = dump_run(
        model_dir, tmp_path, "bf16-prints", torch.bfloat16, prompt_ids(20, seed=7), non_intrusive_mode="fingerprint"
    )
    for args in ((runs["f32"], prints), (prints, runs["f32"])):
        code, out, err = dumpdiff("compare", *args, "--no-progress")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "bf16-prints holds row fingerprints only" in err and "DUMPER_NON_INTRUSIVE_MODE=all" in err


def test_a_dump_compared_with_itself_says_so(runs):
    code, result = compare_json(runs["f32"], runs["f32"])
    assert code == 0 and result["adds_most"] is None
    assert "both arguments are the same dump (f32): it is compared with itself" in result["warnings"]


def test_a_tensor_parallel_dump_missing_a_rank_is_refused(runs, tmp_path):
    """A tp=2 run of which only rank0's folder was copied: its shards would pass for whole tensors
    and its partial sums for sums (an sglang o_proj then "strays" a millionfold); refused."""
    from dump_surgery import copy_dump

    half = copy_dump(runs["bf16"], tmp_path / "tp2")
    run_json = os.path.join(half, "run.json")
    with open(run_json) as handle:
        run = json.load(handle)
    with open(run_json, "w") as handle:
        json.dump({**run, "tp_size": 2}, handle)
    code, out, err = dumpdiff("compare", runs["f32"], half, "--no-progress")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "tp2 was dumped at tp_size 2 but holds 1 rank [0]" in err and "rank0 .. rank1" in err
    code, _, err = dumpdiff("compare", half, half, "--no-progress")  # the same ranks of one tp size: rank by rank
    assert code == 0, err


DAMAGES = [
    "missing_dir",
    "not_a_dump",
    "dumper_dir",
    "header_length_corrupt",
    "truncated",
    "truncated_manifest_edited",
    "manifest_names_missing_file",
    "future_format",
    "run_json_garbage",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_dump_is_one_line_and_exit_2(runs, tmp_path, damage):
    """The damage tests/test_bad_inputs.py does to a dump, to either argument of compare."""
    import test_bad_inputs

    from dump_surgery import copy_dump

    hurt, needles = next((d, n) for d, n in test_bad_inputs.ERRORS if d.__name__ == damage)
    target = hurt(copy_dump(runs["bf16"], tmp_path / "bf16"), str(tmp_path))
    for args in ((runs["f32"], target), (target, runs["f32"])):
        code, out, err = dumpdiff("compare", *args, "--no-progress")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert all(n.replace("(dec)", "(bf16)").replace("/dec", "/bf16") in err for n in needles), err
