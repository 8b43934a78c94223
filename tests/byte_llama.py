"""A small byte-level Llama trained on Python source: its attention is peaky, so it amplifies
float noise more than random weights do. One recipe for tests/test_trained_weights.py and
benchmarks/noise_corpus.py (3 layers, hidden 128, 600 AdamW steps of 32 x 64 bytes; about 40 s
on two idle CPU cores)."""

from __future__ import annotations

import functools
import glob
import math
import os
import sysconfig

import torch

BYTE_OFFSET = 3  # ids 0, 1, 2: pad, bos, eos; a byte b is id b + 3
STEPS, BATCH, WINDOW = 600, 32, 64


@functools.lru_cache(maxsize=None)
def python_source() -> torch.Tensor:
    """The standard library's sources, then the installed packages' (an image may strip one), as
    byte ids."""
    paths = sysconfig.get_paths()
    files = sorted(glob.glob(os.path.join(paths["stdlib"], "*.py"))) + sorted(
        glob.glob(os.path.join(paths["purelib"], "*", "*.py"))
    )
    text = b"".join(open(path, "rb").read() for path in files)[:4_000_000]
    assert len(text) > 1_000_000, "too little Python source on this machine to train on"
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long() + BYTE_OFFSET


def train(data: torch.Tensor, pick: torch.Generator, device: str = "cpu"):
    """(the trained model in eval mode, its last loss). ``pick`` draws the training windows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=256 + BYTE_OFFSET,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    for step in range(STEPS):
        for group in optimizer.param_groups:  # warm-up, then cosine down to a tenth
            group["lr"] = 3e-3 * min(1, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / STEPS)))
        starts = torch.randint(0, len(data) - WINDOW, (BATCH,), generator=pick)
        batch = torch.stack([data[s : s + WINDOW] for s in starts]).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.generation_config.eos_token_id = None  # generate the asked number of tokens
    model.generation_config.pad_token_id = 0
    return model.eval(), loss.item()
