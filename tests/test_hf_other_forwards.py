"""HF forwards that are not a decoder-only model's: an encoder-decoder's generate, multimodal
RoPE positions, a patched forward, and an adapter that cannot describe a call. The dumper never
makes the model call fail, and where it can follow the rows the analysis pairs them all."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers

from dumpdiff import dumper
from helpers import first_divergence_json

PLANTED = 1.01  # a decode-only (one-row pass) error on one MLP: far beyond float32 noise


def _one_row_error(module):
    module.register_forward_hook(lambda mod, args, out: out * PLANTED if out.shape[-2] == 1 else None)


def _tiny_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _generate_then_prefill(model, root, prompt, new_tokens, reference):
    """Dump 'dec' (generate) and 'ref' (``reference(generated)``, one prefill); the generated ids."""
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="dec"))
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
            handle.configure(exp_name="ref")
            reference(out)
    finally:
        handle.remove()
    return out


def _dump_encoder_decoder(model, root):
    source = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    # generate runs the encoder itself; the reference is one prefill of the whole decoder sequence
    out = _generate_then_prefill(model, root, source, 6, lambda out: model(input_ids=source, decoder_input_ids=out))
    return root / "ref", root / "dec", out


@pytest.mark.parametrize("planted", [False, True])
def test_encoder_decoder_generate_is_dumped_on_the_whole_model(tmp_path, planted):
    """generate calls forward with decoder_input_ids and encoder_outputs, no input_ids: that was
    a ValueError out of generate. The decoder's tokens are the pass's rows."""
    model = _tiny_t5()
    if planted:
        _one_row_error(model.decoder.block[1].layer[2].DenseReluDense)
    ref, dec, out = _dump_encoder_decoder(model, tmp_path)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert code == 1 and verdict["alignment"]["unaligned_b"] == 0
    assert verdict["alignment"]["rows_b"] == out.shape[1] - 1  # every decoder row generate ran
    named = [c["call"] for c in verdict["noise"]["culprits"]]
    assert named == (["decoder.block.1.layer.2.DenseReluDense#0"] if planted else [])


def test_multimodal_rope_positions_are_read(tmp_path):
    """Qwen2-VL's generate passes position_ids of shape [3 or 4, batch, seq] (text, height,
    width): reshaping them as [batch, seq] raised out of generate. The text position leads."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=64,
        num_heads=2,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        mlp_ratio=2,
    )
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
    )
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    _one_row_error(model.model.language_model.layers[1].mlp)
    prompt = torch.randint(3, 499, (1, 10), generator=torch.Generator().manual_seed(2))
    _generate_then_prefill(model, tmp_path, prompt, 5, model)
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    assert code == 1 and verdict["alignment"]["unaligned_b"] == 0 and verdict["alignment"]["rows_b"] == 14
    assert [c["call"] for c in verdict["noise"]["culprits"]] == ["model.language_model.layers.1.mlp#0"]
    assert verdict["noise"]["culprits"][0]["kinds"] == {"decode": 4}


def test_a_patched_forward_with_any_catch_all_name(tmp_path):
    """A forward patched by the user with def f(*args, **kw): names passed through **kw are read
    whatever the catch-all is called (only **kwargs was)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    original = model.forward

    @functools.wraps(original)
    def patched(*args, **kw):
        return original(*args, **kw)

    patched.__signature__ = None  # inspect then reads the wrapper itself: (*args, **kw)
    del patched.__wrapped__
    model.forward = patched
    prompt = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    _generate_then_prefill(model, tmp_path, prompt, 4, lambda out: model(input_ids=out))
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    assert code in (0, 1) and result["ranks"]["0"]["alignment"]["unaligned_b"] == 0
    assert result["ranks"]["0"]["alignment"]["rows_b"] == 10


class _Broken:
    """An adapter with a bug of its own."""

    engine = "broken"

    def attach(self, model):
        pass

    def pass_info(self, model, args, kwargs):
        raise RuntimeError("shape '[-1, 7]' is invalid")


def test_an_adapter_failure_never_fails_the_model_call(tmp_path, caplog):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 256, (1, 5))
    with torch.no_grad():
        expected = model(ids).logits
        handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True), adapter=_Broken())
        try:
            with caplog.at_level(logging.WARNING):
                got = model(ids).logits
        finally:
            handle.remove()
    assert torch.equal(got, expected)
    assert "forward not dumped" in caplog.text and "RuntimeError: shape '[-1, 7]' is invalid" in caplog.text


def test_sequences_told_apart_only_by_their_encoder_input_are_not_paired_by_guess(tmp_path):
    """Two source sentences in one batch: both decoders start with the same token, so each first
    decoder row has a twin in the reference with the same token id and another encoder output.
    Pairing either with the last one would compare the other sequence's row with it: "a real
    error at the cross-attention, 5e6x", with no bug. Rows whose partner cannot be told are not
    compared, and the report says why."""
    model = _tiny_t5()
    sources = torch.randint(2, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    # the reference: one prefill per source, as for any batch (rows of one pass are not compared
    # with each other: in a left-padded batch, batch-variance makes a shared prefix differ)
    out = _generate_then_prefill(
        model,
        tmp_path,
        sources,
        5,
        lambda out: [
            model(input_ids=sources[i : i + 1], decoder_input_ids=out[i : i + 1]) for i in range(len(sources))
        ],
    )
    assert out[0, 1] != out[1, 1]  # the sequences part after the start token
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    said = [w for w in result["warnings"] if "inputs besides the token ids" in w]
    assert said and said[0].startswith("2 token rows of dec are not compared"), result["warnings"]
    assert verdict["alignment"]["rows_b"] - verdict["rows_compared"] == 2
    assert verdict["noise"]["culprits"] == []


def test_a_shared_prefix_in_one_padded_reference_batch_is_not_ambiguous(tmp_path):
    """Two prompts sharing a 12-token prefix, left-padded and prefilled as one reference batch:
    the prefix sits at other offsets, so its rows differ in the last bits (batch-variance), not
    in context. They were taken for "inputs besides the token ids" and 22 of 42 rows went
    uncompared. Rows of one pass are not compared with each other."""
    from helpers import left_padded, load_model, make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path / "model"))
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 1000, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 7)]
    ids, mask = left_padded(prompts)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="dec"))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
            handle.configure(exp_name="ref")
            model(out, attention_mask=torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1))
    finally:
        handle.remove()
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    assert not [w for w in result["warnings"] if "inputs besides the token ids" in w], result["warnings"]
    assert result["ranks"]["0"]["rows_compared"] == 42
