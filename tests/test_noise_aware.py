"""A state bug behind natural float32 batch-variance noise still gets named; noise alone never does."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_core_loop import plant_stale_kv

from dumpdiff import dumper
from helpers import dump_pair, dumpdiff, first_divergence_json, load_model, make_tiny_llama, prompt_ids


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=4)


def test_stale_kv_behind_layer0_noise(llama_dir, tmp_path):
    model = load_model(llama_dir, torch.float32)
    plant_stale_kv(model, layer=2, position=3)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=8)
    code, result = first_divergence_json(ref, dec)
    assert code == 1
    verdict = result["ranks"]["0"]
    assert result["culprit"]["module"].startswith("model.layers.0.")  # strict: where the first bit flips
    noise = verdict["noise"]
    assert [c["call"] for c in noise["culprits"]] == ["model.layers.2.self_attn#0"]
    planted = noise["culprits"][0]
    decode_rows = [r for r in verdict["per_row"] if r["kind"] == "decode"]
    assert planted["rows"] == len(decode_rows) == 7 and planted["kinds"] == {"decode": 7}  # every affected row
    assert planted["in_err"] < 1e-5 < planted["out_err"] and planted["amplification"] > 100
    assert "state or cache bug" in verdict["summary"] and "batch-invariant" in verdict["summary"]


def test_a_real_error_in_lm_head_alone_is_named_in_bfloat16(llama_dir, tmp_path):
    """The noise line is drawn from calls that carry an error into an error. A decode-only error
    in lm_head has no such call: only lm_head and the root that returns its logits differ, both
    with clean inputs. Had their own jumps set the line (1.7x above themselves), a 30%
    error on every decode row's logits would pass for float noise."""
    model = load_model(llama_dir, torch.bfloat16)

    def scale(module, args, out):  # on one token row: decode steps (and the logits generate asks of a prefill)
        return out * 1.3 if out.shape[-2] == 1 else None

    model.lm_head.register_forward_hook(scale)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert code == 1 and result["kind"] == "state-bug"
    assert [c["call"] for c in verdict["noise"]["culprits"]] == ["lm_head#0"]
    assert verdict["noise"]["culprits"][0]["kinds"]["decode"] == 5
    assert "state or cache bug" in verdict["summary"]
    # Where bfloat16 prefill and decode are otherwise bit-identical (processors with AVX-512), one
    # call is both the first flipped bit and the real error: not the start of batch-variance.
    # Where they are an ulp apart (AVX2 only), the first bit flips earlier, in batch-variance.
    first_flip_is_the_bug = result["culprit"]["call"] == "lm_head#0"
    assert ("batch-invariant" in verdict["summary"]) != first_flip_is_the_bug


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_float32_run_has_no_noise_aware_culprit(llama_dir, tmp_path, seed):
    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24, seed=seed), new_tokens=8)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert code == 1 and verdict["rows_differing"] > 0  # natural divergence exists...
    assert verdict["noise"]["culprits"] == []  # ...and is recognised as noise
    assert "not a state bug" in verdict["summary"]
    jumps = verdict["noise"]["top_jumps"]
    top = jumps[0]  # the summary says by how much the jump nearest its line stayed under it
    assert top["amplification"] < top["line"]
    assert all(j["amplification"] / j["line"] <= top["amplification"] / top["line"] for j in jumps)
    assert (
        f"the jump nearest its line, {top['amplification']:.3g}x at {top['call']}, is under its {top['line']:.3g}x line"
        in verdict["summary"]
    )


def test_tolerances_and_repeat_floor(llama_dir, tmp_path):
    model = load_model(llama_dir, torch.float32)
    plant_stale_kv(model, layer=1, position=2)
    ref, dec, output = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="ref2"))
    with torch.no_grad():
        model(output)  # a repeat of the reference run: its differences (none on CPU) are the floor
    handle.remove()
    code, result = first_divergence_json(ref, dec, "--atol", "1e-5", "--rtol", "1e-4")
    noise = result["ranks"]["0"]["noise"]
    assert noise["rule"]["atol"] == 1e-5 and [c["call"] for c in noise["culprits"]] == ["model.layers.1.self_attn#0"]
    summary = result["ranks"]["0"]["summary"]  # says the rule applied, not an amplification it did not use
    assert "inputs within atol=1e-05, rtol=0.0001, output not" in summary and "amplification" not in summary
    code, result = first_divergence_json(ref, dec, "--noise", tmp_path / "ref2")
    noise = result["ranks"]["0"]["noise"]
    assert noise["rule"]["floor_from_repeat"] and [c["call"] for c in noise["culprits"]] == [
        "model.layers.1.self_attn#0"
    ]
    code, out, err = dumpdiff("first-divergence", ref, dec, "--noise", tmp_path / "ref2", "--no-progress")
    assert "a float32 output > 100 epsilons (or repeat-run floors, if larger)" in out  # the line's unit with a floor
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    # the stale key is read in the attention's own forward, between its dumped children
    assert (
        "noise-aware verdict" in out
        and (
            "introduced in code not dumped inside model.layers.1.self_attn#0, between "
            "model.layers.1.self_attn.v_proj#0 and model.layers.1.self_attn.o_proj#0"
        )
        in out
    )
    # the decode run given as the repeat would make every difference its own floor: the bug would become noise
    code, out, err = dumpdiff("first-divergence", ref, dec, "--noise", dec, "--no-progress")
    assert code == 2 and err.count("\n") == 1 and "is TEST itself; give a second, independent dump" in err, err
    shutil.copytree(dec, tmp_path / "dec_copy")  # a decode run in another folder: told by its decode rows
    code, out, err = dumpdiff("first-divergence", ref, dec, "--noise", tmp_path / "dec_copy", "--no-progress")
    assert (
        code == 2
        and err.count("\n") == 1
        and "decode rows (the reference 0); give a second dump of the reference" in err
    ), err


def _scale_output(module, factor, when):
    """Multiply the module's output by ``factor`` on the passes ``when(output)`` picks."""

    def hook(mod, args, output):
        return output * factor if when(output) else None

    module.register_forward_hook(hook)


@pytest.mark.parametrize(
    "module, layer, factor, size, new_tokens",
    [
        ("mlp", 1, 1.2, {}, 5),
        ("self_attn", 0, 1.1, {"seed": 1, "hidden_size": 256, "intermediate_size": 512}, 16),
    ],
    ids=["mlp", "attention"],
)
def test_a_decode_only_error_from_identical_inputs_is_named_in_bfloat16(
    tmp_path, module, layer, factor, size, new_tokens
):
    """A 20% decode-only error in bfloat16 (26 epsilons) from bit-identical inputs passed for float
    noise: the line for carried noise, 30 epsilons, was applied to it. From identical inputs a
    kernel's other summation order moves a 16-bit output an ulp or two. So also for a call whose
    children moved by under an ulp: the layer-0 attention's o_proj did, and a 10% error at the
    attention's output (13 epsilons) was judged against it with the carried line, and missed."""
    model_dir = make_tiny_llama(tmp_path / "model", num_hidden_layers=4, **size)
    model = load_model(model_dir, torch.bfloat16)
    target = getattr(model.model.layers[layer], module)

    def scaled(mod, args, output):  # the attention returns (output, weights)
        first = output[0] if isinstance(output, tuple) else output
        if first.shape[1] != 1:
            return None
        return (first * factor, *output[1:]) if isinstance(output, tuple) else first * factor

    target.register_forward_hook(scaled)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=new_tokens)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert [c["call"] for c in verdict["noise"]["culprits"]] == [f"model.layers.{layer}.{module}#0"]
    named = verdict["noise"]["culprits"][0]
    assert named["kinds"] == {"decode": new_tokens - 1}
    # bit-identical inputs where bfloat16 prefill and decode agree up to here (AVX-512); an ulp
    # apart on processors with AVX2 only, where the same op in the other layers draws the line
    assert ("from bit-identical inputs" if named["in_err"] == 0 else "the same op in other layers jumps") in verdict[
        "summary"
    ], verdict["summary"]


def test_the_model_is_not_named_for_an_error_its_submodule_made_on_an_earlier_row(llama_dir, tmp_path):
    """A bug on one prompt row of generate's prefill reaches later rows through the cache. The
    model's own call outputs logits for the last prompt row only, so it had no earlier row to take
    that error from and was named as a second culprit, 'input error 0'."""
    model = load_model(llama_dir, torch.float32)
    planted = {"on": True}

    def one_row(module, args, output):
        if planted["on"] and output.shape[1] > 1:
            output = output.clone()
            output[:, 8] *= 1.1
            return output
        return None

    model.model.layers[1].mlp.register_forward_hook(one_row)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    with torch.no_grad():
        handle.configure(enable=True, exp_name="dec")
        out = model.generate(prompt_ids(20), max_new_tokens=4, do_sample=False)
        planted["on"] = False
        handle.configure(exp_name="ref")
        model(out)
    handle.remove()
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    assert [c["call"] for c in result["ranks"]["0"]["noise"]["culprits"]] == ["model.layers.1.mlp#0"]


def test_a_layer_from_bit_identical_inputs_is_judged_against_its_children(tmp_path):
    """A clean padded batch on a Llama with peaky attention (init std 0.4): layer 0 takes
    bit-identical inputs, and its output's error (its kernels' noise compounded, 47 float32
    epsilons) was named as "a real error ... look for a state or cache bug". A call whose
    children are dumped is judged against them; the noise through the attention core, inlined
    in its module's forward, stays under the line for code no hook saw."""
    from helpers import dump_padded_batch

    model_dir = make_tiny_llama(
        tmp_path / "model", seed=4, num_hidden_layers=4, hidden_size=256, intermediate_size=512, initializer_range=0.4
    )
    model = load_model(model_dir, torch.float32)
    _, ref, dec = dump_padded_batch(model, tmp_path / "d", lengths=(5, 9, 13, 3), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    noise = result["ranks"]["0"]["noise"]
    assert code == 1 and noise["culprits"] == [], noise["culprits"]
    assert "not a state bug" in result["ranks"]["0"]["summary"]


def test_an_error_made_in_code_no_hook_saw_is_named_between_the_dumped_calls(llama_dir, tmp_path):
    """DUMPER_FILTER leaves the MLPs out and a decode-only 0.1% error sits in one: the next dumped
    call's input jumps 1000x beyond anything before it. That was "no call introduces an error
    beyond float noise"; it is named as a gap between the two dumped calls around it."""
    model = load_model(llama_dir, torch.float32)
    _scale_output(model.model.layers[1].mlp, 1.001, lambda out: out.shape[1] == 1)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5, filter="embed|self_attn|norm")
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    gap = verdict["noise"]["culprits"]
    assert [(c["gap_after"], c["gap_before"]) for c in gap] == [
        ("model.layers.1.post_attention_layernorm#0", "model.layers.2.input_layernorm#0")
    ]
    assert gap[0]["kinds"] == {"decode": 4} and gap[0]["amplification"] > 100
    assert (
        "code not dumped, between model.layers.1.post_attention_layernorm#0 and model.layers.2.input_layernorm#0"
        in verdict["summary"]
        and "DUMPER_FILTER" in verdict["summary"]
    )
    # a ticket's title and verdict lead with the real error, not the first bit flip (batch-variance)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "md")
    assert (
        out.splitlines()[0]
        == "## dumpdiff first-divergence: DIVERGENCE (state bug before `model.layers.2.input_layernorm#0`)"
    )
    assert "**Verdict:** DIVERGENCE: a real error introduced in code not dumped, between " in out
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "html")
    assert "<title>dumpdiff: DIVERGENCE (state bug before model.layers.2.input_layernorm#0)</title>" in out


@pytest.fixture(scope="module")
def six_layer_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama6") / "model", num_hidden_layers=6)


def test_a_small_error_in_code_no_hook_saw_is_named_against_the_same_gap_in_other_layers(six_layer_llama, tmp_path):
    """A decode-only 0.01% error in an MLP the filter leaves out jumps about 57x in code no hook
    saw: under any fixed line for such code (float32 noise through an unhooked attention core
    reaches 30-40x on random weights), yet the same gap in the other layers jumps a few x at
    most. Judged against them, it is named; the report says which line named it."""
    model = load_model(six_layer_llama, torch.float32)
    _scale_output(model.model.layers[1].mlp, 1.0001, lambda out: out.shape[1] == 1)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5, filter="embed|self_attn|norm")
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    gap = verdict["noise"]["culprits"]
    assert [(c["gap_after"], c["gap_before"]) for c in gap] == [
        ("model.layers.1.post_attention_layernorm#0", "model.layers.2.input_layernorm#0")
    ]
    assert result["kind"] == "state-bug" and gap[0]["kinds"] == {"decode": 4}
    named = next(j for j in verdict["noise"]["top_jumps"] if j["call"] == "before model.layers.2.input_layernorm#0")
    assert named["amplification"] > named["line"] >= 5 * named["peers"] and named["line"] < 100
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    listed = next(line for line in out.splitlines() if "largest jumps against their lines" in line)
    assert f"before model.layers.2.input_layernorm#0 {named['amplification']:.3g}x/{named['line']:.3g}x" in listed, (
        listed
    )


def test_a_gap_judged_against_two_peers_only_is_a_suspect(llama_dir, tmp_path):
    """The same 0.01% error in a 4-layer model: the gap has two peers (layers 1 and 3), and the
    largest of two jumps of code no hook saw is too few to draw a line from (a clean Jamba's
    inlined convolution jumped 9x its two peers' largest on a GPU). It stays under the line
    for such code, and the report says it is a suspect and what would settle it."""
    model = load_model(llama_dir, torch.float32)
    _scale_output(model.model.layers[1].mlp, 1.0001, lambda out: out.shape[1] == 1)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5, filter="embed|self_attn|norm")
    code, result = first_divergence_json(ref, dec)
    noise = result["ranks"]["0"]["noise"]
    assert result["kind"] != "state-bug" and noise["culprits"] == []
    assert [s["call"] for s in noise["suspects"]] == ["before model.layers.2.input_layernorm#0"], noise["suspects"]


@pytest.fixture(scope="module")
def two_rank_dumps(llama_dir, tmp_path_factory):
    """(ref, dec) of two ranks: rank 0 a clean float32 run (batch-variance only), rank 1 the same
    run with a stale cached key at layer 2 (a state bug), each dumped as its rank."""
    root = tmp_path_factory.mktemp("ranks")
    ref, dec, _ = dump_pair(load_model(llama_dir, torch.float32), root / "rank0", prompt_ids(20), new_tokens=5)
    model = load_model(llama_dir, torch.float32)
    plant_stale_kv(model, layer=2, position=3)
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="1", WORLD_SIZE="2")
    try:
        ref1, dec1, _ = dump_pair(model, root / "rank1", prompt_ids(20), new_tokens=5)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    for one, both in ((ref1, ref), (dec1, dec)):
        shutil.move(os.path.join(one, "rank1"), os.path.join(both, "rank1"))
    return ref, dec


BUG = "state bug in model.layers.2.self_attn#0"  # the stale key, read in the attention's own forward


def test_the_kind_of_divergence_is_said_per_rank_and_worst_over_ranks(two_rank_dumps):
    """Whether rows differ by float noise only or a state bug is named was a sentence deep in the
    summary; it is the report's kind, in JSON ("kind") and every headline."""
    ref, dec = two_rank_dumps
    code, result = first_divergence_json(ref, dec)
    keys = list(result)
    assert code == 1 and result["kind"] == "state-bug" and keys.index("kind") == keys.index("divergence") + 1
    assert {rank: v["kind"] for rank, v in result["ranks"].items()} == {"0": "batch-variance", "1": "state-bug"}
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    lines = out.splitlines()
    assert lines[0] == f"dumpdiff first-divergence: DIVERGENCE ({BUG})", out
    assert "== rank 0: diverges (batch-variance)" in lines and f"== rank 1: diverges ({BUG})" in lines
    code, md, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "md")
    assert md.splitlines()[0] == "## dumpdiff first-divergence: DIVERGENCE (state bug in `model.layers.2.self_attn#0`)"
    assert "Ranks that diverge: 0 (batch-variance), 1 (state bug in `model.layers.2.self_attn#0`)" in md
    code, page, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "html")
    assert (
        "<h1>dumpdiff first-divergence: DIVERGENCE (state bug in <code>model.layers.2.self_attn#0</code>)</h1>" in page
    )
    assert f"<title>dumpdiff: DIVERGENCE ({BUG})</title>" in page
    code, result = first_divergence_json(ref, dec, "--rank", "0")
    assert code == 1 and result["kind"] == "batch-variance"
    code, out, err = dumpdiff("first-divergence", ref, dec, "--rank", "0", "--no-progress")
    assert out.splitlines()[0] == "dumpdiff first-divergence: DIVERGENCE (batch-variance)"
    code, result = first_divergence_json(ref, dec, "--strict-only")
    assert code == 1 and result["kind"] == "not-judged"
    assert {v["kind"] for v in result["ranks"].values()} == {"not-judged"}
    code, result = first_divergence_json(ref, ref)
    assert code == 0 and result["kind"] == "none" and not result["divergence"]


def test_fail_on_state_bug_passes_float_noise_and_fails_a_state_bug(two_rank_dumps):
    """A CI gate that exit 1 on any differing row would fail every run of an engine that is not
    batch-invariant; with --fail-on state-bug only a state bug fails it, and the report is still
    printed whole."""
    ref, dec = two_rank_dumps
    noise_only = dumpdiff("first-divergence", ref, dec, "--rank", "0", "--no-progress")
    gated = dumpdiff("first-divergence", ref, dec, "--rank", "0", "--no-progress", "--fail-on", "state-bug")
    assert noise_only[0] == 1 and gated == (0, noise_only[1], noise_only[2]), gated
    assert dumpdiff("report", ref, dec, "--rank", "0", "--no-progress", "--fail-on", "state-bug")[0] == 0
    for ranks in (("--rank", "1"), ()):
        code, out, err = dumpdiff("first-divergence", ref, dec, *ranks, "--no-progress", "--fail-on", "state-bug")
        assert code == 1 and out.startswith(f"dumpdiff first-divergence: DIVERGENCE ({BUG})"), (code, err)
    assert dumpdiff("first-divergence", ref, ref, "--no-progress", "--fail-on", "state-bug")[0] == 0
    code, out, err = dumpdiff("first-divergence", ref, dec, "--strict-only", "--fail-on", "state-bug", "--no-progress")
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith("dumpdiff: error: --fail-on state-bug needs the noise-aware verdict, which --strict-only")
    code, out, err = dumpdiff("first-divergence", "--help")
    words = " ".join(out.split())
    assert "--fail-on state-bug (a CI gate" in words and "0 no divergence, or float noise alone" in words, words


def test_integer_inputs_that_differ_by_design_do_not_hide_the_state_bug(llama_dir, tmp_path):
    """An engine hands its attention each token row's cache slot, an integer that differs from
    run to run by design (a paged cache vs the reference's fresh one). Counted as an input error,
    it made every attention's input "differ": a stale key was blamed on the layer around it, and
    on a clean run the slots alone were a 1.0 "error" out of nowhere. Integer inputs are metadata."""
    model = load_model(llama_dir, torch.float32)
    plant_stale_kv(model, layer=1, position=2)
    run = {"offset": 0}

    def hand_slots(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rows = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
        return args, {**kwargs, "slots": rows + run["offset"]}  # LlamaAttention takes **kwargs

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hand_slots, with_kwargs=True)

    def count_passes(module, args, kwargs):
        run["offset"] += 1000  # another slot for every pass: a paged cache's allocation

    model.register_forward_pre_hook(count_passes, with_kwargs=True)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5)
    code, result = first_divergence_json(ref, dec)
    culprits = result["ranks"]["0"]["noise"]["culprits"]
    assert [(c["call"], c.get("gap_after"), c.get("gap_before")) for c in culprits] == [
        ("model.layers.1.self_attn#0", "model.layers.1.self_attn.v_proj#0", "model.layers.1.self_attn.o_proj#0")
    ]
    assert culprits[0]["kinds"] == {"decode": 4}


@pytest.mark.parametrize("epsilons, named", [(50, False), (8000, True)])
def test_a_float32_call_from_identical_inputs_is_named_beyond_100_epsilons(llama_dir, tmp_path, epsilons, named):
    """Another reduction order moves a float32 output by tens of epsilons where the reduction
    cancels (a trained model's attention on the real sglang server: 17.7 from bit-identical
    q, k and v), so 50 epsilons from identical inputs is no state bug; a 0.1% error (8000) is."""
    model = load_model(llama_dir, torch.float32)
    factor = 1 + epsilons * torch.finfo(torch.float32).eps

    def decode_only(module, args, out):  # layer 0's first norm: its input, the embedding, is bit-identical
        return out * factor if out.shape[-2] == 1 else None

    model.model.layers[0].input_layernorm.register_forward_hook(decode_only)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=8)
    code, result = first_divergence_json(ref, dec)
    noise = result["ranks"]["0"]["noise"]
    assert noise["rule"]["clean_input_float32"] == 100
    calls = [c["call"] for c in noise["culprits"]]
    assert calls == (["model.layers.0.input_layernorm#0"] if named else []), result["ranks"]["0"]["summary"]


def test_a_state_bug_on_one_prompt_row_of_600_is_judged_whatever_the_sample(llama_dir, tmp_path):
    """The noise-aware pass reads at most 512 rows, an even sample per row kind. A decode run
    whose prefill got one row wrong (row 1 of 600: an error in the engine's extend path) fell
    outside that sample: the strict verdict named the call on that row, yet the run was called
    float noise and --fail-on state-bug passed it. The sample now holds rows of every call the
    strict verdict names first on some row."""
    model = load_model(llama_dir, torch.float32)

    def one_row_wrong(module, args, output):
        if output.shape[-2] != 600:  # the decode run's prefill only
            return None
        output = output.clone()
        output[..., 1, :] += 1e-2
        return output

    model.model.layers[1].mlp.down_proj.register_forward_hook(one_row_wrong)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(600), new_tokens=4)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert verdict["noise"]["rows_examined"] < verdict["noise"]["rows_total"]  # a sample, not every row
    assert any(r["pos"] == 1 and r["culprit"] == "model.layers.1.mlp.down_proj#0" for r in verdict["per_row"])
    assert result["kind"] == "state-bug", verdict["summary"]
    assert [c["call"] for c in verdict["noise"]["culprits"]] == ["model.layers.1.mlp.down_proj#0"]
    assert dumpdiff("first-divergence", ref, dec, "--no-progress", "--fail-on", "state-bug")[0] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_corrupted_kv_page_is_named_at_its_layer(tmp_path, dtype):
    """A decode-only corrupted KV page (16 cached slots of one layer holding another page's
    contents) in a left-padded batch, float32 and bfloat16: named at that layer's attention,
    whether the rest of the run is bit-identical or an ulp apart on this processor."""
    from helpers import dump_padded_batch
    from plants import plant

    model_dir = make_tiny_llama(tmp_path / "model", seed=3, num_hidden_layers=5, hidden_size=128, intermediate_size=256)
    model = load_model(model_dir, dtype)
    plant(model, "kv-page", 3)
    _, ref, dec = dump_padded_batch(model, tmp_path / "d", lengths=(40, 57, 64), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    named = result["ranks"]["0"]["noise"]["culprits"]
    assert result["kind"] == "state-bug" and named[0]["module"].startswith("model.layers.3.self_attn"), named
    assert named[0]["kinds"] == {"decode": named[0]["rows"]}


def test_an_error_under_the_float32_floor_is_a_suspect_not_a_state_bug(llama_dir, tmp_path):
    """A decode-only error of 0.001% at one MLP output: far above what the same MLP shows in
    the other layers, but under the 100 float32 epsilons a kernel's own reordering can make.
    It is not named (--fail-on state-bug passes it) and not called clean noise either: the
    summary names it as a suspect and says what would settle it."""
    model = load_model(llama_dir, torch.float32)
    _scale_output(model.model.layers[2].mlp, 1 + 1e-5, lambda out: out.shape[1] == 1)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=5)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert result["kind"] == "batch-variance" and verdict["noise"]["culprits"] == []
    suspect = verdict["noise"]["suspects"][0]
    assert suspect["call"] == "model.layers.2.mlp#0" and suspect["amplification"] > 2.5 * suspect["peers"]
    assert "not named: model.layers.2.mlp#0 " in verdict["summary"] and "(--noise)" in verdict["summary"]
    top = verdict["noise"]["top_jumps"][0]  # over its line, and the summary says so
    assert top["call"] == "model.layers.2.mlp#0" and top["amplification"] > top["line"]
    assert (
        f"{top['amplification']:.3g}x at model.layers.2.mlp#0, is over its {top['line']:.3g}x line"
        in verdict["summary"]
    )
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--fail-on", "state-bug")
    assert code == 0, out + err
