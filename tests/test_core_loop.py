"""End to end on real tiny HF models (random weights) on CPU: dump, align, prove, name the culprit.

On this CPU float32 prefill and decode differ naturally (GEMM over 1 row vs many), while
bfloat16 happens to be bit-identical; the planted-bug tests use bfloat16 so that the planted
op is the only source of difference, and assert that first.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from dumpdiff import dumper
from helpers import (
    ROOT,
    dump_padded_batch,
    dump_pair,
    dumpdiff,
    first_divergence_json,
    load_model,
    make_tiny_llama,
    make_tiny_qwen3_moe,
    prompt_ids,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=4)


def test_natural_float32_divergence_is_localized(llama_dir, tmp_path):
    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=8)
    code, result = first_divergence_json(ref, dec)
    assert code == 1
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["proof"][1].startswith("embedding output (model.embed_tokens) bit-identical on all 31")
    assert verdict["alignment"]["unaligned_b"] == 0
    culprit = result["culprit"]
    assert culprit["module"].startswith("model.layers.0.")
    assert culprit["max_abs"] > 0 and culprit["max_ulp"] >= 1 and culprit["victims"] > 0
    decode_rows = [r for r in verdict["per_row"] if r["kind"] == "decode"]
    assert len(decode_rows) == 7  # every decode step is paired with a reference prefill row
    # the decode pass computes one token row, the reference prefill all 32
    assert culprit["shapes"]["b"]["M"] in (1, 24) and culprit["shapes"]["a"]["M"] == 32


def test_text_report_names_culprit_shapes_and_errors(llama_dir, tmp_path):
    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=4)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert code == 1, err
    assert "alignment proof: OK" in out and "culprit: model.layers.0." in out
    assert "M=28" in out and "max ulp" in out and "victims:" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_selected_dumps_give_the_full_dumps_verdict(llama_dir, tmp_path, dtype):
    """DUMPER_POSITIONS=T: keeps no row of the decode run's prefill (a pass of zero stored rows)
    and only the last k rows of the reference: the verdict on those rows is the full dumps'."""
    model = load_model(llama_dir, dtype)
    if dtype == torch.bfloat16:
        plant_batch_variant(model, layer=2)  # bf16 is bit-identical here: plant the difference
    prompt = prompt_ids(24)
    ref, dec, _ = dump_pair(model, tmp_path / "full", prompt, new_tokens=6)
    sel_ref, sel_dec, _ = dump_pair(model, tmp_path / "selected", prompt, new_tokens=6, positions="24:")
    _, full = first_divergence_json(ref, dec)
    code, selected = first_divergence_json(sel_ref, sel_dec)
    assert code == 1
    verdict = selected["ranks"]["0"]
    assert verdict["rows_compared"] == 5 and verdict["rows_unstored"] == 24  # decode rows 24..28 of 29 paired
    assert selected["culprit"]["call"] == full["culprit"]["call"]
    assert selected["culprit"]["max_abs"] == full["culprit"]["max_abs"]
    assert {r["pos"] for r in verdict["per_row"]} == {r["pos"] for r in full["ranks"]["0"]["per_row"] if r["pos"] >= 24}
    code, out, err = dumpdiff("first-divergence", sel_ref, sel_dec, "--no-progress")
    assert code == 1 and "24 paired rows have no dumped tensor row on both sides" in out, err


def test_differing_rows_no_culprit_accounts_for_are_said(llama_dir, tmp_path):
    """DUMPER_FILTER keeps the last MLP only. The first decode step's error is made there (its
    culprit); the next steps' errors are made in layer 0, not hooked, and reach every later row
    through the cache. The report named the one culprit row and dropped the others without a
    word. Two dumps made with different filters are said too."""
    model = load_model(llama_dir, torch.bfloat16)  # bit-identical here but for the planted errors
    steps = []

    def perturb(layer):
        def hook(module, args, output):
            if output.shape[1] != 1:
                return None
            if layer == 0:
                steps.append(1)
            wanted = 3 if len(steps) == 1 else 0  # the first decode step in layer 3, later ones in layer 0
            return output * 1.05 if layer == wanted else None

        return hook

    for layer in (0, 3):
        model.model.layers[layer].mlp.register_forward_hook(perturb(layer))
    ref, dec, _ = dump_pair(model, tmp_path / "d", prompt_ids(16), new_tokens=5, filter=r"embed|layers\.3\.mlp$")
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert code == 1 and [g["call"] for g in verdict["groups"]] == ["model.layers.3.mlp#0"]
    attributed = verdict["groups"][0]["rows"]
    said = [w for w in result["warnings"] if "meet no culprit" in w]
    assert said and said[0].startswith(
        f"{verdict['rows_differing'] - attributed} of the {verdict['rows_differing']} differing rows"
    ), result["warnings"]
    assert "widen DUMPER_FILTER" in said[0]
    steps.clear()
    _, everything, _ = dump_pair(model, tmp_path / "e", prompt_ids(16), new_tokens=5)
    code, out, err = dumpdiff("first-divergence", ref, everything, "--no-progress")
    assert "different DUMPER_FILTERs" in err, err


@pytest.mark.parametrize("trust", [False, True], ids=["proved", "trusted"])
def test_row_selection_that_keeps_no_paired_row_is_an_error_not_a_clean_run(llama_dir, tmp_path, trust):
    """DUMPER_LAST_ROWS=1 keeps the reference's last row, which the decode run never computes
    (it never feeds back its last generated token): no row is dumped on both sides. That is
    trouble, exit 2, with what to keep; it was "NO DIVERGENCE, 0 of 0 rows" (exit 0) under
    --trust-alignment, over a planted bug."""
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=6, last_rows=1)
    result = dumpdiff("first-divergence", ref, dec, "--no-progress", *(["--trust-alignment"] if trust else []))
    one_line_error(
        result,
        "DUMPER_LAST_ROWS=1",
        "DUMPER_LAST_ROWS >= new tokens",
        "nothing was compared" if trust else "no token rows in common",
    )


def _shift_decode_positions(model, from_step: int):
    """An engine bug: position+1 fed to generate's decode steps from the from_step-th on."""
    prepare, decode_steps = model.prepare_inputs_for_generation, []

    def shifted(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        if inputs["input_ids"].shape[-1] == 1 and inputs.get("position_ids") is not None:
            decode_steps.append(1)
            if len(decode_steps) >= from_step:
                inputs["position_ids"] = inputs["position_ids"] + 1
        return inputs

    model.prepare_inputs_for_generation = shifted


@pytest.mark.parametrize(
    "from_step, said",
    [
        (1, ("none of the 5 decode/extend rows", "has no row at position 24 but has rows at 25")),
        (
            3,
            (
                "3 token rows of dec cannot be paired",
                "has no row at position 26 but has rows at 27",
                "no verdict is given over the other rows",
            ),
        ),
    ],
    ids=["every-step", "after-two-paired"],
)
def test_a_decode_run_whose_positions_jump_is_named_as_such(llama_dir, tmp_path, from_step, said):
    """An engine that feeds position+1 to its decode steps: those rows have no known prefix, so
    none has a partner. The error says the decode run's positions jump, not that the reference
    lacks the generated tokens (which it holds). From the third step on, the first decode rows
    pair: the verdict over them alone ("float noise", exit 1) passed the jump off as clean."""
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.float32)
    _shift_decode_positions(model, from_step)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=6)
    one_line_error(
        dumpdiff("first-divergence", ref, dec, "--no-progress"),
        *said,
        "between consecutive engine steps",
        "positions jump",
    )


def test_a_decode_step_not_dumped_is_not_blamed_on_the_engine(llama_dir, tmp_path):
    """Dumping paused for one decode step leaves the same hole in positions as an engine that
    skips one; the engine steps tell them apart (they are counted while dumping is off)."""
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.float32)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    forwards = [0]

    def pause_first_decode_step(module, args, out):
        forwards[0] += 1
        handle.configure(enable=forwards[0] != 1)  # off after the prefill, on again after the first decode step

    hook = model.lm_head.register_forward_hook(pause_first_decode_step)
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            out = model.generate(prompt_ids(24), max_new_tokens=6, do_sample=False)
            hook.remove()
            handle.configure(enable=True, exp_name="ref")
            model(out)
    finally:
        handle.remove()
    one_line_error(
        dumpdiff("first-divergence", tmp_path / "ref", tmp_path / "dec", "--no-progress"),
        "has no row at position 24 but has rows at 25",
        "were not dumped (dumping paused?)",
    )


def test_a_run_from_inputs_embeds_says_its_token_ids_are_unknown(llama_dir, tmp_path):
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.float32)
    prompt = prompt_ids(16)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="dec"))
    try:
        with torch.no_grad():
            out = model.generate(inputs_embeds=model.model.embed_tokens(prompt), max_new_tokens=4, do_sample=False)
            handle.configure(exp_name="ref")
            model(torch.cat([prompt, out], 1))
    finally:
        handle.remove()
    one_line_error(
        dumpdiff("first-divergence", tmp_path / "ref", tmp_path / "dec", "--no-progress"),
        "16 token rows hold no token id",
        "inputs_embeds",
    )


def test_a_decode_only_embedding_bug_is_told_apart_from_misalignment(llama_dir, tmp_path):
    """Same ids and positions, every prefill row's embedding identical, only decode rows differ:
    the embedding module is wrong in decode. The proof still refuses (it checks the pairing with
    the embedding), but says so and points at --trust-alignment, which names it."""
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.bfloat16)
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: out * 1.01 if out.shape[-2] == 1 else None)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=6)
    one_line_error(
        dumpdiff("first-divergence", ref, dec, "--no-progress"),
        "every one of them a decode/extend row",
        "all 24 paired prefill rows are bit-identical",
        "--trust-alignment",
    )
    code, result = first_divergence_json(ref, dec, "--trust-alignment")
    assert code == 1 and result["culprit"]["call"] == "model.embed_tokens#0"


def test_swapped_arguments_are_warned_about(llama_dir, tmp_path):
    """The decode run given as the reference: the verdict still runs, and both stderr and the
    report say the arguments look swapped."""
    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=6)
    code, out, err = dumpdiff("first-divergence", dec, ref, "--no-progress", "--format", "json")
    assert code == 1 and "are the arguments swapped?" in err
    assert any("are the arguments swapped?" in w for w in json.loads(out)["warnings"])
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    assert code == 1 and "arguments swapped" not in err + out


def test_a_reference_made_on_a_warm_cache_says_to_flush_it(llama_dir, tmp_path):
    """A reference prefill whose prompt came from the cache (dumped without a flush) holds rows
    for the new tokens only, none from position 0: nothing pairs, and the error says why."""
    from transformers import DynamicCache

    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.float32)
    prompt = prompt_ids(24)
    ref, dec, out = dump_pair(model, tmp_path / "pair", prompt, new_tokens=6)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    try:
        with torch.no_grad():
            cache = DynamicCache()
            model(out[:, :24], past_key_values=cache, use_cache=True)  # the warm cache, not dumped
            handle.configure(enable=True, exp_name="warm_ref")
            model(out[:, 24:], past_key_values=cache, use_cache=True)
    finally:
        handle.remove()
    one_line_error(
        dumpdiff("first-divergence", tmp_path / "warm_ref", dec, "--no-progress"),
        "rows computed on a cache",
        "flush the engine's cache before dumping the reference",
    )


def test_a_chunked_reference_is_not_taken_for_swapped_arguments(llama_dir, tmp_path):
    """A reference prefilled in two chunks (its second chunk an extend pass, as sglang's chunked
    prefill or a cache hit makes) against one plain prefill: no decode rows, no warning."""
    from transformers import DynamicCache

    model = load_model(llama_dir, torch.float32)
    ids = prompt_ids(32)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="chunked")
            cache = DynamicCache()
            model(ids[:, :16], past_key_values=cache, use_cache=True)
            model(ids[:, 16:], past_key_values=cache, use_cache=True)
            handle.configure(exp_name="whole")
            model(ids)
    finally:
        handle.remove()
    code, out, err = dumpdiff("first-divergence", tmp_path / "chunked", tmp_path / "whole", "--no-progress")
    assert code in (0, 1) and "alignment proof: OK" in out, err
    assert "swapped" not in err
    # but a cache bug would run in such a reference too: said (sglang chunks long prefills by default)
    assert "16 paired rows of chunked were computed on a cache (a chunked prefill" in err, err


class _FlatNormMLP(torch.nn.Module):
    """An MLP whose hooked child sees its input flattened to [tokens x 2, hidden / 2] (as a
    gated-deltanet norm sees [tokens x heads, head_dim]): no dim matches the token layout."""

    def __init__(self, mlp, hidden):
        super().__init__()
        self.mlp, self.norm = mlp, torch.nn.LayerNorm(hidden // 2, elementwise_affine=False)

    def forward(self, x):
        return self.mlp(self.norm(x.reshape(-1, x.shape[-1] // 2)).reshape(x.shape))


def test_a_child_that_cannot_be_compared_is_not_ruled_out(llama_dir, tmp_path):
    """The bug is in a hooked child whose tensors cannot be compared row by row: the note said
    the difference arises in the parent's own code, ruling the child out."""
    model = load_model(llama_dir, torch.bfloat16)  # bit-identical here but for the planted bug
    layer = model.model.layers[1]
    layer.mlp = _FlatNormMLP(layer.mlp, model.config.hidden_size)
    layer.mlp.norm.register_forward_hook(lambda m, a, out: out * 1.1 if out.shape[0] == 2 else None)  # decode only
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(16), new_tokens=4, filter=r"embed|layers\.1\.mlp")
    code, result = first_divergence_json(ref, dec)
    culprit = result["culprit"]
    assert culprit["call"] == "model.layers.1.mlp#0", culprit["call"]
    assert "or in a child that could not be compared (model.layers.1.mlp.norm#0" in culprit["note"], culprit["note"]


def test_a_run_on_a_cache_filled_while_dumping_was_off_says_so(llama_dir, tmp_path):
    """Turn 2 dumped on turn 1's cache, which was filled with dumping off: the ids before its rows
    are unknown. It was asked "were both dumps made from the same prompt?"."""
    from transformers import DynamicCache

    model = load_model(llama_dir, torch.float32)
    ids = prompt_ids(24)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    with torch.no_grad():
        cache = DynamicCache()
        model(ids[:, :16], past_key_values=cache, use_cache=True)  # not dumped
        handle.configure(enable=True, exp_name="turn2")
        model(ids[:, 16:], past_key_values=cache, use_cache=True)
        handle.configure(exp_name="ref")
        model(ids)
    handle.remove()
    code, out, err = dumpdiff("first-divergence", tmp_path / "ref", tmp_path / "turn2", "--no-progress")
    assert code == 2 and "starts at position 16 with the token ids before it unknown" in err, err
    assert "same prompt" not in err


def test_a_reference_cut_off_is_refused(llama_dir, tmp_path):
    """A reference whose writer died before its last chunk lacks rows: a verdict over the rest
    would pass a partial comparison off as whole (exit 2)."""
    from transformers import DynamicCache

    model = load_model(llama_dir, torch.float32)
    ref, dec, out = dump_pair(model, tmp_path / "d", prompt_ids(16), new_tokens=4)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    with torch.no_grad():
        handle.configure(enable=True, exp_name="cut")
        cache = DynamicCache()
        model(out[:, :17], past_key_values=cache, use_cache=True)  # the prompt and the first generated token
        model(out[:, 17:], past_key_values=cache, use_cache=True)  # the rest: never committed below
    handle.remove()
    manifest = tmp_path / "cut" / "rank0" / "manifest.jsonl"
    manifest.write_text(manifest.read_text().splitlines(keepends=True)[0])
    (tmp_path / "cut" / "rank0" / ".lock").write_text("writing pid=1")
    code, out, err = dumpdiff("first-divergence", tmp_path / "cut", dec, "--no-progress")
    assert code == 2 and "cut (the reference) was cut off" in err and "dump the reference again" in err, err


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "stale-kv"])
def test_speculative_decoding_aligns_and_finds_the_planted_bug(llama_dir, tmp_path, planted):
    """HF assisted generation: each step verifies a draft model's tokens in one pass, and a
    rejected draft's position is computed again by the next pass with another token. Rows of
    rejected drafts pair with nothing; every other position pairs with the reference. (It was
    "cannot align: two token ids at position 24".) A stale cached key is still named."""
    model = load_model(make_tiny_llama(tmp_path / "main", num_hidden_layers=3), torch.float32)
    draft = load_model(make_tiny_llama(tmp_path / "draft", seed=1), torch.float32)
    if planted:
        plant_stale_kv(model, layer=1, position=3)
    prompt = prompt_ids(24)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            out = model.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=draft)
            handle.configure(exp_name="ref")
            model(out)
    finally:
        handle.remove()
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] > 0  # rejected drafts: the draft model's weights are other
    assert verdict["rows_compared"] == out.shape[1] - 1  # every position but the last token, never fed back
    noise = [c["call"] for c in verdict["noise"]["culprits"]] if "noise" in verdict else []
    assert noise == (["model.layers.1.self_attn#0"] if planted else [])


@pytest.mark.parametrize("planted", [False, True])
def test_beam_search_rows_follow_their_beams(llama_dir, tmp_path, planted):
    """Beam search reorders the cache after every step: batch row i goes on with the beam row
    beam_idx[i] held. Keyed by batch row, a decode row carried another beam's history; it paired
    with nothing, or with a reference row of a context it never computed. Each decode row that
    computed a prefix of a returned sequence must pair, and no other; a left-padded batch of two
    prompts, three beams each. A stale cached key is still named."""
    model = load_model(llama_dir, torch.float32)  # float noise too: the verdict must tell the bug from it
    if planted:
        plant_stale_kv(model, layer=1, position=3)
    prompts = [prompt_ids(n, seed=n)[0].tolist() for n in (6, 9)]
    ids = torch.tensor([[0] * (9 - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=6,
                do_sample=False,
                num_beams=3,
                num_return_sequences=3,
                length_penalty=0.0,
                early_stopping=False,
                pad_token_id=0,
            )
            handle.configure(exp_name="ref")
            finished = [prompts[i // 3] + row[9:].tolist() for i, row in enumerate(out)]
            for sequence in finished:
                model(torch.tensor([sequence]))
    finally:
        handle.remove()
    assert "_reorder_cache" not in model.__dict__  # remove() takes the stand-in away
    decode_keys = {
        tuple(seq[: at + 1]) for i, seq in enumerate(finished) for at in range(len(prompts[i // 3]), len(seq) - 1)
    }
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    assert verdict["rows_compared"] == 3 * (6 + 9) + len(decode_keys)  # every beam's prompt rows, each prefix once
    assert verdict["alignment"]["unaligned_b"] > 0  # beams dropped on the way pair with nothing
    noise = [c["call"] for c in verdict["noise"]["culprits"]] if "noise" in verdict else []
    assert noise == (["model.layers.1.self_attn#0"] if planted else [])


class SplitKLinear(torch.nn.Linear):
    """A batch-variant GEMM, as real kernels are: over one token row it sums K in two halves."""

    def forward(self, x):
        if x.shape[:-1].numel() != 1:
            return super().forward(x)
        half = x.shape[-1] // 2
        return F.linear(x[..., :half], self.weight[:, :half]) + F.linear(x[..., half:], self.weight[:, half:])


def plant_batch_variant(model, layer: int):
    old = model.model.layers[layer].mlp.down_proj
    new = SplitKLinear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    new.weight = old.weight
    model.model.layers[layer].mlp.down_proj = new


def plant_stale_kv(model, layer: int, position: int = 3):
    """Once decoding starts, corrupt one cached key of one layer (a stale/corrupt cache entry)."""
    attn = model.model.layers[layer].self_attn

    def corrupt(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # renamed in transformers 5.2x
        keys = getattr(cache.layers[layer], "keys", None) if cache is not None else None
        if keys is not None and keys.shape[2] > position and not getattr(cache, "_corrupted", False):
            keys[:, :, position, :] += 0.5
            cache._corrupted = True

    attn.register_forward_pre_hook(corrupt, with_kwargs=True)


@pytest.fixture(scope="module")
def bf16_clean(llama_dir, tmp_path_factory):
    """(exit code, report) of a clean bfloat16 run of the tiny Llama: 0 where prefill and decode
    are bit-identical on this processor (AVX-512), 1 where its kernels put them an ulp apart
    (AVX2 only). The tests whose planted op must be the first bit flip check it here."""
    model = load_model(llama_dir, torch.bfloat16)
    ref, dec, _ = dump_pair(model, tmp_path_factory.mktemp("bf16-clean"), prompt_ids(20), new_tokens=6)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    return code, out + err


def needs_bit_identical_bf16(bf16_clean):
    if bf16_clean[0] != 0:
        pytest.skip(
            "bfloat16 prefill and decode differ on this processor before any planted op (AVX2 kernels): "
            "the planted op cannot be the first bit flip"
        )


def test_a_clean_bfloat16_run_is_identical_or_batch_variance(bf16_clean):
    """The baseline the planted-bug tests stand on: no divergence where this processor's kernels
    keep bfloat16 prefill and decode bit-identical, float noise called batch-variance where not."""
    code, report = bf16_clean
    assert "alignment proof: OK" in report
    assert ("NO DIVERGENCE" in report) if code == 0 else (code == 1 and "DIVERGENCE (batch-variance)" in report), report


def test_planted_batch_variant_op_is_the_culprit(llama_dir, tmp_path, bf16_clean):
    needs_bit_identical_bf16(bf16_clean)
    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    assert code == 1
    culprit = result["culprit"]
    assert culprit["call"] == "model.layers.2.mlp.down_proj#0" and culprit["cls"] == "SplitKLinear"
    assert {r["kind"] for r in culprit["rows"]} == {"decode"} and culprit["n_rows"] == 5
    assert culprit["shapes"]["a"]["M"] == 26 and culprit["shapes"]["b"]["M"] == 1
    assert culprit["victims"] > 0


def test_planted_stale_kv_names_that_layers_attention(llama_dir, tmp_path):
    model = load_model(llama_dir, torch.bfloat16)
    plant_stale_kv(model, layer=1)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    assert code == 1
    culprit = result["culprit"]
    assert culprit["call"] == "model.layers.1.self_attn#0"
    assert culprit["note"] and "own code" in culprit["note"]  # q/k/v projections ran clean
    groups = result["ranks"]["0"]["groups"]
    assert [g["call"] for g in groups] == ["model.layers.1.self_attn#0"]


def plant_absorbed_input_change(module: torch.nn.Linear):
    """In decode steps, one element of a Linear's input moves by one ulp (as if the code that made
    it computed it another way) and the Linear rounds it away: its output is what it would have been."""
    kept = {}

    def nudge(_, args):
        x = args[0]
        if x.shape[:-1].numel() != 1:
            return None
        kept["x"], moved = x, x.clone()
        moved.view(-1)[0] = torch.nextafter(moved.view(-1)[0], torch.tensor(float("inf"), dtype=x.dtype))
        return (moved,)

    def absorb(linear, args, output):
        return F.linear(kept.pop("x"), linear.weight) if "x" in kept else None

    module.register_forward_pre_hook(nudge)
    module.register_forward_hook(absorb)


@pytest.mark.parametrize(
    "case, planted, note_has",
    [
        (
            "absorbed in an attention",
            "o_proj",
            [
                "the first difference is model.layers.1.self_attn.o_proj#0's input (5 rows)",
                "made in model.layers.1.self_attn's own code (not a hooked submodule)",
                "no compared hooked output differs",
            ],
        ),
        # generate's prefill step computes the logits of its last row alone: one more one-row input
        (
            "absorbed in the root's own code",
            "lm_head",
            [
                "the first difference is lm_head#0's input (6 rows)",
                "made in the root module's own forward (<root>)",
                "no compared hooked output differs",
            ],
        ),
        (
            "stale key, attention unhooked",
            "embed_tokens|mlp$",
            [
                "the first difference is model.layers.1.mlp#0's input (5 rows)",
                "made in code outside every hooked module (DUMPER_FILTER='embed_tokens|mlp$')",
            ],
        ),
        (
            "stale key, MLPs and their children hooked",
            "embed_tokens|mlp",
            [
                "the first difference is model.layers.1.mlp#0's input (5 rows)",  # not gate_proj's, which ends first
                "made in code outside every hooked module (DUMPER_FILTER='embed_tokens|mlp')",
            ],
        ),
    ],
)
def test_a_difference_no_call_makes_is_explained(llama_dir, tmp_path, bf16_clean, case, planted, note_has):
    """No call has clean inputs and a differing output: the note says which call's input holds the
    first difference, whose code made it, and whether any compared output changed; it sends the
    user to DUMPER_FILTER only when a filter left modules unhooked."""
    if planted in ("o_proj", "lm_head"):  # a change rounded away: only seen where nothing else differs
        needs_bit_identical_bf16(bf16_clean)
    model = load_model(llama_dir, torch.bfloat16)
    config = {}
    if planted == "o_proj":
        plant_absorbed_input_change(model.model.layers[1].self_attn.o_proj)
    elif planted == "lm_head":
        plant_absorbed_input_change(model.lm_head)
    else:
        plant_stale_kv(model, layer=1)
        config["filter"] = planted
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=6, **config)
    code, result = first_divergence_json(ref, dec, "--strict-only")
    verdict = result["ranks"]["0"]
    assert code == 1 and result["culprit"] is None, case
    assert f"input ({verdict['rows_differing']} rows)" in note_has[0], (case, verdict["rows_differing"])
    note = verdict["note"]
    for text in note_has:
        assert text in note, (case, note)
    assert ("absorbed" in note) == case.startswith("absorbed"), (case, note)
    assert ("widen DUMPER_FILTER" in note) == ("filter" in config), (case, note)


def test_identical_runs_exit_zero(llama_dir, tmp_path):
    from dumpdiff import dumper

    model = load_model(llama_dir, torch.float32)
    tokens = prompt_ids(16)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="one"))
    with torch.no_grad():
        model(tokens)
        handle.configure(exp_name="two")
        model(tokens)
    handle.remove()
    code, out, err = dumpdiff("first-divergence", tmp_path / "one", tmp_path / "two", "--no-progress")
    assert code == 0 and "NO DIVERGENCE" in out and "16 token rows" in out


@pytest.mark.parametrize("arch,cache", [("llama", "dynamic"), ("llama", "static"), ("qwen3", "static")])
def test_batch_of_three_lengths_aligns_per_sequence(llama_dir, tmp_path, arch, cache):
    """A static cache gets a 4D attention mask from generate, not the 2D one (a dict of them, one
    per attention type, for a config with layer_types such as Qwen3's): its padding rows were
    taken for tokens at position 0, every padded sequence went unpaired, and a bug in one passed
    as NO DIVERGENCE (exit 0)."""
    if arch == "llama":
        model = load_model(llama_dir, torch.float32)  # float noise too: the noise-aware verdict names the bug
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(
                arch,
                vocab_size=1024,
                hidden_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=128,
                max_position_embeddings=512,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            )
        ).eval()
        model.generation_config.eos_token_id = None

    def second_row(module, args, out):  # decode-only, in the second (padded) sequence only
        if out.shape[1] == 1:
            out = out.clone()
            out[1] *= 1.05
            return out
        return None

    model.model.layers[1].mlp.register_forward_hook(second_row)
    prompts, ref, dec = dump_padded_batch(model, tmp_path, cache_implementation=cache)
    code, result = first_divergence_json(ref, dec)
    align = result["ranks"]["0"]["alignment"]
    assert align["unaligned_b"] == 0 and align["unkeyed_b"] == 0
    assert align["rows_b"] == sum(len(p) for p in prompts) + 3 * 4  # padding rows are not token rows
    assert "bit-identical" in align["proof"][1]
    found = result["ranks"]["0"]["noise"]["culprits"]
    assert [c["call"] for c in found] == ["model.layers.1.mlp#0"] and found[0]["kinds"] == {"decode": 4}
    assert {r["seq"] for r in found[0]["sample_rows"]} == {"g1.1"}


def test_no_divergence_over_part_of_the_decode_rows_says_so(llama_dir, tmp_path):
    """A reference that holds only the first generated tokens: the later decode rows have no
    partner. NO DIVERGENCE over the rest is true, and the warning says what it does not cover."""
    model = load_model(llama_dir, torch.bfloat16)  # bit-identical here on so short a run
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    with torch.no_grad():
        handle.configure(enable=True, exp_name="dec")
        out = model.generate(prompt_ids(8), max_new_tokens=6, do_sample=False)
        handle.configure(exp_name="ref")
        model(out[:, :10])  # the prompt and two generated tokens
    handle.remove()
    code, out_text, err = dumpdiff("first-divergence", tmp_path / "ref", tmp_path / "dec", "--no-progress")
    assert code == 0 and "NO DIVERGENCE" in out_text, err
    assert "3 decode or extend rows of dec were not compared" in err, err  # positions 10-12


def test_a_copied_prompt_cache_goes_on_from_its_history(llama_dir, tmp_path):
    """HF's prompt reuse: prefill a system prompt once, generate from copy.deepcopy(prompt_cache)
    per request. The copy was a cache never seen: its rows started at an unknown prefix and the
    dumps could not be compared at all."""
    import copy

    from transformers import DynamicCache

    model = load_model(llama_dir, torch.bfloat16)  # bit-identical here on so short a run, but for the bug
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * 1.5 if out.shape[1] == 1 else None)
    system = prompt_ids(5)[0].tolist()
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), cleanup_previous=True))
    finished = []
    with torch.no_grad():
        handle.configure(enable=True, exp_name="dec")
        prompt_cache = model(torch.tensor([system]), past_key_values=DynamicCache(), use_cache=True).past_key_values
        for seed in (1, 2):
            ids = torch.tensor([system + prompt_ids(3, seed=seed)[0].tolist()])
            finished.append(
                model.generate(ids, past_key_values=copy.deepcopy(prompt_cache), max_new_tokens=4, do_sample=False)[0]
            )
        handle.configure(exp_name="ref")
        for sequence in finished:
            model(sequence[None])
    handle.remove()
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["alignment"]["unkeyed_b"] == 0
    assert verdict["rows_compared"] == 5 + 2 * (3 + 3)  # the system prompt, each request's own tokens and decode steps
    assert code == 1 and result["culprit"]["call"] == "model.layers.1.mlp#0"


def test_different_prompts_are_refused(llama_dir, tmp_path):
    from dumpdiff import dumper

    model = load_model(llama_dir, torch.float32)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="a"))
    with torch.no_grad():
        model(prompt_ids(12, seed=1))
        handle.configure(exp_name="b")
        model(prompt_ids(12, seed=2))
    handle.remove()
    code, out, err = dumpdiff("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no token row of b matches a row of a" in err


def test_a_reference_without_the_decode_steps_is_refused(llama_dir, tmp_path):
    """A reference prefill of the prompt alone pairs the decode run's prefill rows but none of
    its decode rows: "no divergence" there would be a partial answer passed off as whole."""
    from dumpdiff import dumper

    model = load_model(llama_dir, torch.float32)
    prompt = prompt_ids(12)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="dec"))
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False)
        handle.configure(exp_name="ref")
        model(prompt)
    handle.remove()
    code, out, err = dumpdiff("first-divergence", tmp_path / "ref", tmp_path / "dec", "--no-progress")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "none of the 3 decode/extend rows of dec has a partner in ref" in err


def test_tiny_qwen3_moe_end_to_end(tmp_path):
    model = load_model(make_tiny_qwen3_moe(tmp_path / "moe"), torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(16), new_tokens=5)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and "bit-identical" in verdict["alignment"]["proof"][1]
    assert code == (1 if verdict["rows_differing"] else 0)
    # expert buffers hold a data-dependent subset of tokens: not comparable, with the reason
    assert any("experts" in n["call"] for n in verdict["not_comparable"])
    if code == 1:
        assert result["culprit"]["call"]


def test_verdict_is_the_same_whatever_the_join_and_its_threads(llama_dir, tmp_path, monkeypatch):
    """The row table (both indexes joined on token row and tensor) is built through dense grids
    split over threads, or through a general sorted join; its (pair, call) summary is made from
    dense matrices or, where they would be too large, by walking the list of cells; every way
    gives the same verdict, to the last number. A batch of three lengths (left padding) dumped in
    float32 diverges naturally in many rows, so the spans of entries and of pairs split sequences
    and rows at odd places."""
    from dumpdiff.analyzer.verdict import compare, diverge

    model = load_model(llama_dir, torch.float32)
    plant_stale_kv(model, layer=1)
    _, ref, dec = dump_padded_batch(model, tmp_path)
    verdicts = {}
    dense_posts = compare.posts_of_b
    for threads, dense, listed in (
        (1, 0, False),
        (1, compare.DENSE_CELLS, False),
        (3, compare.DENSE_CELLS, False),
        (7, compare.DENSE_CELLS, False),
        (7, 0, False),
        (3, compare.DENSE_CELLS, True),
    ):
        monkeypatch.setattr(compare, "JOIN_THREADS", threads)
        monkeypatch.setattr(compare, "DENSE_CELLS", dense)
        monkeypatch.setattr(compare, "posts_of_b", (lambda *args: None) if listed else dense_posts)
        result = diverge.first_divergence(ref, dec, progress=False)
        verdicts[(threads, dense, listed)] = json.dumps(result, sort_keys=True, default=str)
    assert len(set(verdicts.values())) == 1, "the join paths disagree"
    result = json.loads(next(iter(verdicts.values())))
    verdict = result["ranks"]["0"]
    assert result["culprit"] and verdict["rows_differing"] > 3 and verdict["rows_compared"] > 3 * 4


def test_dumps_without_tensor_rows_are_not_called_clean_when_alignment_is_trusted(llama_dir, tmp_path):
    """non_intrusive_mode=core stores pass metadata only (token ids, positions, sequences), no
    tensor. Without rows the alignment cannot be proved (exit 2); trusted, nothing is compared,
    which is not "no divergence" (exit 0 would pass a CI gate that compared nothing): exit 2,
    saying to dump =all."""
    from dump_surgery import one_line_error

    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(12), new_tokens=4, non_intrusive_mode="core")
    result = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json", "--trust-alignment")
    one_line_error(result, "nothing was compared", "DUMPER_NON_INTRUSIVE_MODE=core holds pass metadata only")
    one_line_error(
        dumpdiff("first-divergence", ref, dec, "--no-progress"),  # said "widen DUMPER_FILTER" before
        "holds no module tensors",
        "dump with DUMPER_NON_INTRUSIVE_MODE=all",
    )


def test_a_dump_compared_with_itself_does_not_diverge(llama_dir, tmp_path):
    """Both sides then share one saved index, read by both sides' threads at once."""
    model = load_model(llama_dir, torch.float32)
    _, dec, _ = dump_pair(model, tmp_path, prompt_ids(16), new_tokens=6)
    assert dumpdiff("index", dec, "--no-progress")[0] == 0
    for _ in range(3):
        code, out, err = dumpdiff("first-divergence", dec, dec, "--no-progress", "--strict-only")
        assert code == 0 and "NO DIVERGENCE" in out, out + err
        assert "both arguments are the same dump" in err  # said, in case it was a slip


def test_index_progress_shows_on_a_terminal_only(llama_dir, tmp_path):
    """The index build draws a progress bar on stderr when it is a terminal (a pseudo-terminal
    here), and writes none to a pipe or file, nor with --no-progress."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from helpers import ROOT

    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(24), new_tokens=4)

    def stderr_of(*extra, terminal: bool) -> str:
        args = [sys.executable, "-m", "dumpdiff.analyzer.cli", "index", ref, dec, "--rebuild", *extra]
        if not terminal:
            return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300).stderr
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, cwd=ROOT)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the command ended
                break
            if not chunk:
                break
            seen += chunk
        os.close(leader)
        assert proc.wait(timeout=300) == 0
        return seen.decode(errors="replace")

    assert "indexing" in stderr_of(terminal=True)
    assert "indexing" not in stderr_of(terminal=False)
    assert "indexing" not in stderr_of("--no-progress", terminal=True)


def test_cli_help_names_every_environment_variable_the_analyzer_reads():
    """A user tuning a build (processes, threads) or filing a bug (debug) finds the knob in --help."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "analyzer", "**", "*.py"), recursive=True):
        with open(path) as handle:
            names |= set(re.findall(r"DUMPDIFF_[A-Z_]+", handle.read()))
    code, out, _ = dumpdiff("--help")
    assert code == 0 and "Environment:" in out and names >= {"DUMPDIFF_INDEX_PROCESSES", "DUMPDIFF_DEBUG"}
    assert [n for n in sorted(names) if n not in out] == []


def test_malloc_is_tuned_in_the_dumpdiff_program_only(tmp_path):
    """The verdict lets glibc keep freed memory for its transient arrays, but only in the dumpdiff
    program's own process: a library caller's process, or a user's own MALLOC_* settings, are
    left alone."""
    import subprocess
    import sys

    probe = (
        "from dumpdiff.analyzer.index import memtune; "
        "print(memtune.keep_freed_memory(), end=' '); memtune.allow(); print(memtune.keep_freed_memory())"
    )

    def run(env):
        return subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
        ).stdout.split()

    clean = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}
    library, program = run(clean)
    assert library == "False"  # never in someone else's process
    if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):
        assert program == "True"
    assert run({**clean, "MALLOC_ARENA_MAX": "2"}) == ["False", "False"]  # the user's own malloc settings win
