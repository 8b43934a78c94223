"""The dumper on CUDA: asynchronous copies into pinned host memory give the same bytes as a
synchronous CPU copy, in-place kernels queued after a hook cannot change what it captured, row
selection and back-pressure work on device tensors, and a bf16 Llama dump pair is analyzable.

Skipped without CUDA (CI has no GPU); run on a GPU machine with
``python -m pytest -q tests/test_gpu.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.config import DumperConfig
from helpers import dump_pair, first_divergence_json

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def read_pass(path):
    with safe_open(str(path), "pt") as handle:
        meta = json.loads(handle.metadata()[fmt.PASS_META_KEY])
        return meta, {k: handle.get_tensor(k) for k in handle.keys()}


class Scribbler(torch.nn.Module):
    """Big outputs, then in-place kernels on them right after the hook: a copy not ordered
    before those kernels would capture scribbled values."""

    def __init__(self, width=4096):
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        up = self.up(hidden)
        for _ in range(8):
            up.mul_(3.0).add_(1.0)  # in place, queued after the hook's async copy of `up`
        out = self.down(up)
        out.zero_()
        return out


def test_async_pinned_copies_equal_a_synchronous_cpu_copy(tmp_path):
    torch.manual_seed(0)
    model = Scribbler().cuda().eval()
    sync_copies = {}

    def sync_hook(name):
        def hook(module, args, output):
            sync_copies[name] = output.detach().to("cpu", copy=True)  # blocking: the value at hook time

        return hook

    for name in ("embed", "up", "down"):
        getattr(model, name).register_forward_hook(sync_hook(name))
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="gpu"))
    ids = torch.randint(0, 64, (2, 512), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            out = model(ids)
    handle.remove()
    assert bool((out == 0).all())
    for pass_id in range(3):
        meta, tensors = read_pass(tmp_path / "gpu" / "rank0" / fmt.pass_file_name(pass_id))
        for name in ("embed", "up", "down"):
            dumped = tensors[f"{name}#0.out.0"]
            assert dumped.dtype == sync_copies[name].dtype and dumped.shape == sync_copies[name].shape
            assert torch.equal(dumped.view(torch.uint8), sync_copies[name].view(torch.uint8)), name
    # the in-place kernels did run on the live tensor (down's input), after up's output was copied
    calls = {c["call"]: c for c in meta["calls"]}
    assert "alias" not in calls["down#0"]["tensors"]["down#0.in.0"]
    assert not torch.equal(tensors["up#0.out.0"], tensors["down#0.in.0"])


def test_bf16_and_row_selection_on_device(tmp_path):
    torch.manual_seed(0)
    model = Scribbler(256).cuda().to(torch.bfloat16).eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="sel", positions="100:"))
    ids = torch.randint(0, 64, (1, 128), device="cuda")
    with torch.no_grad():
        hidden = model.embed(ids).detach().cpu()
        model(ids)
    handle.remove()
    meta, tensors = read_pass(tmp_path / "sel" / "rank0" / fmt.pass_file_name(0))
    assert meta["kept_rows"] == list(range(100, 128))
    kept = tensors["embed#0.out.0"]
    assert kept.dtype == torch.bfloat16 and kept.shape == (28, 256)
    assert torch.equal(kept.view(torch.int16), hidden[0, 100:].contiguous().view(torch.int16))


def test_back_pressure_bounds_host_memory_on_device(tmp_path):
    model = Scribbler(1024).cuda().eval()
    ids = torch.randint(0, 64, (4, 1024), device="cuda")
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="bp", queue_bytes=8 << 20))
    with torch.no_grad():
        for _ in range(4):
            model(ids)
    writer = handle._writer
    handle.remove()
    pass_bytes = os.path.getsize(tmp_path / "bp" / "rank0" / fmt.pass_file_name(0))
    assert writer.passes_written == 4
    assert writer.peak_pending_bytes <= max(8 << 20, pass_bytes)


def test_bf16_llama_dump_pair_is_analyzed(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    dump_pair(model, tmp_path, torch.randint(3, 1024, (1, 64), device="cuda"), new_tokens=6)
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec", "--strict-only")
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["proof"][1].startswith("embedding output (model.embed_tokens) bit-identical")
    assert verdict["alignment"]["unaligned_b"] == 0
    assert code == (1 if verdict["rows_differing"] else 0)


GPU_ARCHS = {  # moderate sizes, so the GPU picks its real kernels (cuBLAS GEMMs, SDPA flash / memory-efficient)
    "llama": dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024),
    "qwen2": dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024),
    "mistral": dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024, sliding_window=128),
    "gemma2": dict(
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024, head_dim=64, sliding_window=128
    ),
    "phi3": dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024),
    "gpt_neox": dict(num_attention_heads=8, intermediate_size=1024),
    "qwen3_moe": dict(
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
}


@pytest.mark.parametrize("planted", [False, True], ids=["natural", "planted"])
@pytest.mark.parametrize("arch", sorted(GPU_ARCHS))
def test_bf16_natural_gpu_divergence_is_called_noise(arch, planted, tmp_path):
    """bf16 on the GPU: prefill and decode differ naturally (other kernels and splits per shape).
    The noise-aware verdict must call that noise on each architecture, also for calls with
    bit-identical inputs (judged in epsilons), and still name a decode-only MLP error of 100% (with
    an ulp of bf16 noise at its input, the 30x line for carried noise sits at about 25%)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        arch,
        vocab_size=4096,
        hidden_size=512,
        num_hidden_layers=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=1024,
        **GPU_ARCHS[arch],
    )
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    layers = model.gpt_neox.layers if arch == "gpt_neox" else model.model.layers
    if planted:

        def decode_only(module, args, out):
            hidden = out[0] if isinstance(out, tuple) else out
            if hidden.shape[1] != 1:
                return None
            return (hidden * 2, *out[1:]) if isinstance(out, tuple) else hidden * 2

        layers[2].mlp.register_forward_hook(decode_only)
    prompt = torch.randint(3, 4096, (1, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dump_pair(model, tmp_path, prompt, new_tokens=8)
    code, result = first_divergence_json(tmp_path / "ref", tmp_path / "dec")
    verdict = result["ranks"]["0"]
    named = [c["call"] for c in verdict.get("noise", {}).get("culprits", [])]
    prefix = "gpt_neox.layers" if arch == "gpt_neox" else "model.layers"
    assert named == ([f"{prefix}.2.mlp#0"] if planted else []), (named, verdict.get("noise", {}).get("top_jumps"))


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "kv-page"])
def test_a_corrupted_kv_page_at_real_size_is_named_in_bf16(planted, tmp_path):
    """bf16 on the GPU at a realistic size: a left-padded batch of 3 prompts of 180-450 tokens,
    12 decode steps. A decode-only corrupted KV page at one layer past 0 changes that layer's
    attention by tens of percent of the row, yet its jump (about 20x) stays under any fixed line
    that clean runs on random weights need; against the same op in other layers (1-2x) it
    stands out and is named at its layer. The clean run names nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import dump_padded_batch
    from plants import plant

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=8192,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=1024,
    )
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    if planted:
        plant(model, "kv-garbage", 5)
    prompts = [
        torch.randint(3, 8192, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (180, 310, 450)
    ]
    _, ref, dec = dump_padded_batch(model, tmp_path, prompts=prompts, new_tokens=12)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    named = verdict["noise"]["culprits"]
    if planted:
        assert result["kind"] == "state-bug" and named[0]["module"].startswith("model.layers.5.self_attn"), (
            named,
            verdict["noise"]["top_jumps"],
        )
    else:
        assert result["kind"] == "batch-variance" and named == [], (named, verdict["noise"]["top_jumps"])
