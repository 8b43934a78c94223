"""Tiny random-weight Hugging Face models, made locally (no hub is reachable here).

Used by the demo, the tests and the sglang test server.  Each call writes a complete model
directory (config, safetensors weights, generation config, tokenizer) with save_pretrained:

    python examples/tiny_models.py /tmp/tiny-llama            # dense Llama (runs on sglang CPU)
    python examples/tiny_models.py /tmp/tiny-moe --moe        # Qwen3-MoE (sglang: GPU only)

Weights are random, so predictions are near uniform: fine for comparing engines op by op,
meaningless as a language model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Token ids shared by the tokenizer and the model config.
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# Shapes common to both models; small enough that a forward pass takes milliseconds on CPU.
_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=2048,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=UNK_ID,
)


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer over the words "w3" .. "w{vocab_size-1}" (ids 3 ..), split on
    whitespace, BOS prepended like Llama's.  Unknown words map to <unk>."""
    vocab = {UNK: UNK_ID, BOS: BOS_ID, EOS: EOS_ID}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=UNK)


def _save(model_cls, config, path, seed: int, dtype: str) -> Path:
    path = Path(path)
    torch.manual_seed(seed)  # the random init below is the whole "training"
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    model.config.dtype = dtype  # what engines read to pick a dtype ("auto")
    model.save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def make_tiny_llama(path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random 2-layer Llama (GQA 4 query / 2 kv heads) to `path`; any LlamaConfig
    field can be overridden, e.g. num_hidden_layers=4.  Returns the path."""
    return _save(LlamaForCausalLM, LlamaConfig(**{**_SMALL, **overrides}), path, seed, dtype)


def make_tiny_qwen3(path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random 2-layer dense Qwen3 (per-head q_norm and k_norm) to `path`; runs on sglang CPU."""
    return _save(Qwen3ForCausalLM, Qwen3Config(**{**_SMALL, "head_dim": 16, **overrides}), path, seed, dtype)


def make_tiny_gemma2(path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random 2-layer Gemma-2 to `path`: its embedding scales the looked-up row by
    sqrt(hidden_size), and each layer holds four norms."""
    return _save(Gemma2ForCausalLM, Gemma2Config(**{**_SMALL, "head_dim": 16, **overrides}), path, seed, dtype)


def make_tiny_phi3(path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random 2-layer Phi-3 to `path`: HF fuses qkv_proj and gate_up_proj as the engines
    do; runs on sglang CPU."""
    return _save(Phi3ForCausalLM, Phi3Config(**{**_SMALL, **overrides}), path, seed, dtype)


def make_tiny_qwen3_moe(path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random 2-layer Qwen3-MoE (4 experts, top-2, every layer sparse) to `path`.
    sglang runs MoE only with the real CUDA kernels, so this one is for HF and GPU runs."""
    config = Qwen3MoeConfig(
        **{
            **_SMALL,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            **overrides,
        }
    )
    return _save(Qwen3MoeForCausalLM, config, path, seed, dtype)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="output directory")
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE instead of Llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers")
    args = ap.parse_args(argv)
    extra = {} if args.layers is None else {"num_hidden_layers": args.layers}
    make = make_tiny_qwen3_moe if args.moe else make_tiny_llama
    print(make(args.path, seed=args.seed, dtype=args.dtype, **extra))


if __name__ == "__main__":
    main()
