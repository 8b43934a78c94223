"""Architectures beyond Llama, built tiny with random weights.

Models whose decode state is not a KV cache: Mamba keeps a recurrent state in ``cache_params``
(its cache reports no length), RecurrentGemma keeps it inside its layers. Their decode steps
must still be dumped as decode rows at the right positions, in the prefill's sequence, or they
pair with the wrong reference rows (a one-token "prompt" at position 0) and the verdict is wrong.
Transformers laid out unlike Llama go through the same check: GPT-2 (Conv1D projections, learned
positions), Phi-3 and GPT-NeoX (one fused qkv projection), Gemma-2 (sliding window, soft-capped
logits, norms after each block).

Clean runs whose float noise once looked like an introduced error: a one-number gate output
(cancellation), a float32 block around a bfloat16 mixer. A stale key that leaves a sliding
window: later rows get its error only through the cache."""

from __future__ import annotations

import pytest
import torch
from test_core_loop import plant_stale_kv

from dumpdiff.analyzer.dump.load import open_dump
from dumpdiff.analyzer.index.store import load_index
from helpers import dump_padded_batch, dump_pair, first_divergence_json, prompt_ids

COMMON = dict(vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, num_hidden_layers=3)
ARCHS = {
    "mamba": (dict(state_size=8, expand=2, conv_kernel=4), "backbone.layers.1.mixer"),
    "recurrent_gemma": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=128,
            lru_width=64,
            attention_window_size=16,
            conv1d_width=4,
            block_types=["recurrent", "attention", "recurrent"],
        ),
        "model.layers.2.temporal_block",
    ),
    "gpt2": (dict(n_head=4, n_positions=256), "transformer.h.1.mlp"),
    "phi3": (
        dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512),
        "model.layers.1.mlp",
    ),
    "gpt_neox": (
        dict(num_attention_heads=4, intermediate_size=128, max_position_embeddings=512),
        "gpt_neox.layers.1.mlp",
    ),
    "gemma2": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            head_dim=16,
            sliding_window=8,
        ),
        "model.layers.1.mlp",
    ),
}
EXTRA = {
    "qwen2_moe": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
    "falcon_mamba": dict(state_size=8, expand=2, conv_kernel=4),
    "mistral": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        sliding_window=16,
    ),
}


def tiny(arch: str, tmp_path, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = ARCHS[arch][0] if arch in ARCHS else EXTRA[arch]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **COMMON, **extra))
    model.save_pretrained(tmp_path / arch)  # reloaded as a user's model would be
    model = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # always the full number of new tokens
    return model


def plant_decode_error(model, path: str, scale: float = 1e-2):
    """In decode steps only (one new token), the module's output is off by ``scale`` relative."""

    def perturb(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] != 1:
            return None
        hidden = hidden * (1 + scale)
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

    model.get_submodule(path).register_forward_hook(perturb)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_decode_rows_align_and_a_decode_bug_is_named(arch, tmp_path):
    model = tiny(arch, tmp_path)
    prompt = torch.randint(3, 1024, (1, 20), generator=torch.Generator().manual_seed(1))
    new = 5
    # A clean run: every decode step is a decode row of the prompt's sequence, at its position.
    ref, dec, output = dump_pair(model, tmp_path / "clean", prompt, new_tokens=new)
    tokens = load_index(open_dump(dec), progress=False).cols("tokens")
    decode = tokens["mode"] == "decode"
    assert decode.sum() == new - 1 and set(tokens["seq"][decode].tolist()) == {tokens["seq"][0]}
    assert tokens["pos"][decode].tolist() == list(range(20, 20 + new - 1))
    assert tokens["id"][decode].tolist() == output[0, 20 : 20 + new - 1].tolist()
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["rows_compared"] == 20 + new - 1
    assert verdict.get("noise", {}).get("culprits", []) == []  # float noise only: no culprit
    # The same model with an error in decode steps only: the noise-aware verdict names it.
    plant_decode_error(model, ARCHS[arch][1])
    ref, dec, _ = dump_pair(model, tmp_path / "planted", prompt, new_tokens=new)
    code, result = first_divergence_json(ref, dec)
    culprits = result["ranks"]["0"]["noise"]["culprits"]
    assert code == 1 and culprits and culprits[0]["module"] == ARCHS[arch][1], culprits
    assert culprits[0]["kinds"] == {"decode": new - 1}


@pytest.mark.parametrize(
    "arch, dtype, seeds", [("qwen2_moe", torch.float32, (0, 8, 10)), ("falcon_mamba", torch.bfloat16, (0,))]
)
def test_clean_runs_name_no_introduced_error(arch, dtype, seeds, tmp_path):
    """Qwen2-MoE's shared_expert_gate outputs one number per token: a value near zero made float
    noise a 40-135x "relative" error (these seeds did); errors are now relative to at least the
    tensor's typical row magnitude. FalconMamba in bfloat16 wraps a bfloat16 mixer in float32
    blocks: the block's floor is now the mixer's epsilon, not float32's (it was named at 7.7e3x)."""
    model = tiny(arch, tmp_path, dtype)
    for seed in seeds:
        ref, dec, _ = dump_pair(model, tmp_path / f"s{seed}", prompt_ids(32, seed=seed), new_tokens=6)
        code, result = first_divergence_json(ref, dec)
        verdict = result["ranks"]["0"]
        assert code == 1 and verdict["alignment"]["unaligned_b"] == 0
        assert verdict["noise"]["culprits"] == [], (seed, verdict["noise"]["culprits"])


def test_stale_key_that_leaves_the_sliding_window_is_named_once(tmp_path):
    """Mistral, window 16: a corrupted cached key of layer 1 is seen by the first decode rows,
    then leaves the window; the rows after it still differ (through layer 2's cache), but only
    layer 1's attention introduced anything: the model call, whose inputs are token ids and so
    never differ, was named too on such a row."""
    model = tiny("mistral", tmp_path)
    plant_stale_kv(model, layer=1, position=3)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(32), new_tokens=6)
    code, result = first_divergence_json(ref, dec)
    culprits = result["ranks"]["0"]["noise"]["culprits"]
    assert code == 1 and [c["call"] for c in culprits] == ["model.layers.1.self_attn#0"], culprits


def test_left_padded_batch_of_a_state_space_model_pairs_every_row(tmp_path):
    """Mamba's decode steps get neither the attention mask nor positions: each row's position is
    carried from the pass before, padding excluded, so every decode row of every padded prompt
    pairs with its own reference prefill."""
    model = tiny("mamba", tmp_path)
    prompts, ref, dec = dump_padded_batch(model, tmp_path / "dumps", new_tokens=4)
    code, result = first_divergence_json(ref, dec)
    alignment = result["ranks"]["0"]["alignment"]
    assert alignment["rows_b"] == sum(map(len, prompts)) + 3 * 3  # 3 decode steps per prompt
    assert alignment["unkeyed_b"] == alignment["unaligned_b"] == 0, alignment
    assert result["ranks"]["0"]["rows_compared"] == alignment["rows_b"]


def test_a_reset_cache_reused_by_a_second_generate_starts_a_new_sequence(tmp_path):
    """A cache that reported a length and reports 0 again was reset: the next prefill is a
    prefill of a new sequence, not an extend of the old one (whose token count it would inherit)."""
    from transformers import StaticCache

    from dumpdiff import dumper
    from helpers import load_model, make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path / "llama"))
    model.generation_config.eos_token_id = None
    cache = StaticCache(config=model.config, max_cache_len=64)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path / "dumps"), enable=True, exp_name="dec"))
    with torch.no_grad():
        model.generate(prompt_ids(8, seed=1), max_new_tokens=3, do_sample=False, past_key_values=cache)
        cache.reset()
        second = model.generate(prompt_ids(8, seed=2), max_new_tokens=3, do_sample=False, past_key_values=cache)
        handle.configure(exp_name="ref")
        model(second)
    handle.remove()
    tokens = load_index(open_dump(str(tmp_path / "dumps" / "dec")), progress=False).cols("tokens")
    firsts = [
        (tokens["mode"][m][0], tokens["seq"][m][0], tokens["pos"][m].tolist())
        for m in (tokens["pass"] == p for p in (0, 3))
    ]
    assert firsts[0][0] == firsts[1][0] == "prefill" and firsts[1][2] == list(range(8)) and firsts[0][1] != firsts[1][1]
    code, result = first_divergence_json(tmp_path / "dumps" / "ref", tmp_path / "dumps" / "dec")
    assert result["ranks"]["0"]["rows_compared"] == 8 + 2  # the second sequence: prompt and two decode rows
