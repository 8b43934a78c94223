"""Fingerprint passes that repeat a traced pass's calls follow a plan (dumper/passplan.py) and
write what the general hooks write; a pass that departs from its plan mid-way (another call, a
tensor rewritten in place) goes on with the general hooks and still gives every tensor the prints
the general hooks give it."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper import passplan
from helpers import load_model, make_tiny_llama, prompt_ids

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=3)


def _dump(model, root, name, plans, monkeypatch, device):
    """A fingerprint dump of one batch-2 generate; the passes as (metadata, print table), and the
    dumper's plan counters (followed, left)."""
    monkeypatch.setattr(passplan, "PLANS", plans)
    prompt = torch.cat([prompt_ids(12), prompt_ids(12, seed=1)]).to(device)
    config = dumper.DumperConfig(dir=str(root), cleanup_previous=True, non_intrusive_mode="fingerprint")
    handle = dumper.install(model, config)
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name=name)
            model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        handle.flush()
        counters = (handle._plans.followed, handle._plans.left)
    finally:
        handle.remove()
    passes = []
    for path in sorted(glob.glob(os.path.join(root, name, "*", "pass-*.safetensors"))):
        with safe_open(path, "pt") as f:
            passes.append((json.loads(f.metadata()[fmt.PASS_META_KEY]), f.get_tensor(fmt.ROWPRINTS_TENSOR)))
    assert len(passes) == NEW_TOKENS
    return passes, counters


def _resolved(meta: dict, table: torch.Tensor) -> dict:
    """Every captured tensor's description and print rows, aliases followed to what they name;
    with each call's names, order, scalar values and skipped slots."""
    stored = {name: t for call in meta["calls"] for name, t in call["tensors"].items() if "alias" not in t}
    out = {}
    for call in meta["calls"]:
        out[call["call"]] = (
            call["module"],
            call["cls"],
            call["pre"],
            call["post"],
            call.get("values"),
            call.get("skipped"),
        )
        for name, t in call["tensors"].items():
            first, n = stored[t.get("alias", name)]["print"]
            out[name] = (t["shape"], t["dtype"], t["token_dims"], t["rows"], table[:, first : first + n].tolist())
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_planned_decode_passes_write_the_general_hooks_files(llama_dir, tmp_path, monkeypatch, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(llama_dir, dtype).to(device)
    general, (followed, _) = _dump(model, tmp_path, "general", False, monkeypatch, device)
    assert followed == 0
    planned, (followed, left) = _dump(model, tmp_path, "planned", True, monkeypatch, device)
    # the prefill and the first decode step are traced; every later decode step follows its plan
    assert (followed, left) == (NEW_TOKENS - 2, 0)
    for (meta_g, table_g), (meta_p, table_p) in zip(general, planned):
        assert meta_p == meta_g
        assert torch.equal(table_p, table_g)


class _Detour:
    """On one forward of the model (counted by its embedding's calls), a module works otherwise."""

    def __init__(self, model, module, forward, on_pass):
        self.module, self.original, self.forward, self.on_pass = module, module.forward, forward, on_pass
        self.passes = 0
        model.get_input_embeddings().register_forward_pre_hook(self._count)
        module.forward = self._forward

    def _count(self, *_):
        self.passes += 1

    def _forward(self, *args, **kwargs):
        if self.passes == self.on_pass:
            return self.forward(self.original, *args, **kwargs)
        return self.original(*args, **kwargs)


def _skip_up_proj(original, x):  # the MLP without one of its hooked calls
    mlp = original.__self__
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)))


def _rewrite_input(original, x):  # k_proj adds one to the normed states q_proj saw and v_proj sees next
    x.add_(1.0)
    return original(x)


@pytest.mark.parametrize(
    "where, forward",
    [("mlp", _skip_up_proj), ("self_attn.k_proj", _rewrite_input)],
    ids=["a-call-missing", "a-tensor-rewritten-in-place"],
)
def test_a_pass_that_leaves_its_plan_gets_the_general_hooks_prints(llama_dir, tmp_path, monkeypatch, where, forward):
    runs = {}
    for plans in (False, True):
        model = load_model(llama_dir, torch.float32)
        _Detour(model, model.get_submodule(f"model.layers.1.{where}"), forward, on_pass=5)
        runs[plans] = _dump(model, tmp_path, f"plans-{plans}", plans, monkeypatch, "cpu")
    (general, _), (planned, (followed, left)) = runs[False], runs[True]
    # decode steps 1-2 traced and followed, step 3 (the fifth pass) leaves its plan, step 4 is
    # traced again and the rest follow the new plan
    assert left == 1 and followed == NEW_TOKENS - 4
    for index, ((meta_g, table_g), (meta_p, table_p)) in enumerate(zip(general, planned)):
        assert _resolved(meta_p, table_p) == _resolved(meta_g, table_g), f"pass {index}"
