"""Fingerprint passes that repeat a traced pass's calls follow a plan (dumper/passplan.py) and
write what the general hooks write; a pass that departs from its plan mid-way (another call, a
tensor rewritten in place) goes on with the general hooks and still gives every tensor the prints
the general hooks give it."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper import passplan, passprints
from helpers import load_model, make_tiny_llama, prompt_ids

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=3)


def _dump(model, root, name, plans, monkeypatch, device, padded=False):
    """A fingerprint dump of one batch-2 generate (``padded``: the second prompt's first three
    tokens masked out); the passes as (metadata, print table), and the dumper's plan counters
    (followed, left)."""
    prompt = torch.cat([prompt_ids(12), prompt_ids(12, seed=1)]).to(device)
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :3] = 0

    def generate():
        model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)

    passes, counters = _dumped(model, root, name, plans, monkeypatch, generate)
    assert len(passes) == NEW_TOKENS
    return passes, counters


def _dumped(model, root, name, plans, monkeypatch, run, **config):
    """The passes ``run()`` dumps in mode fingerprint, as (metadata JSON text, print table), and the
    dumper's plan counters (followed, left)."""
    monkeypatch.setattr(passplan, "PLANS", plans)
    config = dumper.DumperConfig(dir=str(root), cleanup_previous=True, non_intrusive_mode="fingerprint", **config)
    handle = dumper.install(model, config)
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name=name)
            run()
        handle.flush()
        counters = (handle._plans.followed, handle._plans.left)
    finally:
        handle.remove()
    passes = []
    for path in sorted(glob.glob(os.path.join(root, name, "*", "pass-*.safetensors"))):
        with safe_open(path, "pt") as f:
            passes.append((f.metadata()[fmt.PASS_META_KEY], f.get_tensor(fmt.ROWPRINTS_TENSOR)))
    return passes, counters


def _same_prints(general, planned):
    """The same calls, tensors and aliases, and every tensor the same print rows, wherever in
    the print table they lie."""
    assert len(planned) == len(general)
    for index, (one, other) in enumerate(zip(general, planned)):
        assert _resolved(*other) == _resolved(*one), f"pass {index}"


def _resolved(meta_text: str, table: torch.Tensor) -> dict:
    meta = json.loads(meta_text)
    stored = {name: t for call in meta["calls"] for name, t in call["tensors"].items() if "alias" not in t}
    out = {}
    for call in meta["calls"]:
        out[call["call"]] = {key: value for key, value in call.items() if key != "tensors"}
        for name, t in call["tensors"].items():
            first, n = stored[t.get("alias", name)]["print"]
            out[name] = (
                {key: value for key, value in t.items() if key != "print"},
                table[:, first : first + n].tolist(),
            )
    return out


def _same_dumps(general, planned):
    """The general hooks' files, byte for byte where no tensor's shape varies from step to step;
    where one does (an attention mask HF passes growing, as some transformers releases do even
    unpadded), the same prints for every tensor."""
    if any(".attention_mask" in meta for meta, _ in general):
        _same_prints(general, planned)
    else:
        _same_files(general, planned)


def _same_files(general, planned):
    assert len(planned) == len(general)
    for index, ((meta_g, table_g), (meta_p, table_p)) in enumerate(zip(general, planned)):
        assert meta_p == meta_g, f"pass {index}: metadata differs"
        assert torch.equal(table_p, table_g), f"pass {index}: prints differ"


@pytest.mark.parametrize("device", DEVICES)
def test_planned_decode_passes_write_the_general_hooks_files(llama_dir, tmp_path, monkeypatch, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(llama_dir, dtype).to(device)
    general, (followed, _) = _dump(model, tmp_path, "general", False, monkeypatch, device)
    assert followed == 0
    planned, (followed, left) = _dump(model, tmp_path, "planned", True, monkeypatch, device)
    # the prefill is met once; the first decode step's structure is met, the second's traced, and
    # every later decode step follows its plan
    assert (followed, left) == (NEW_TOKENS - 3, 0)
    _same_dumps(general, planned)


@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_batchs_growing_mask_is_followed_with_the_general_hooks_prints(
    llama_dir, tmp_path, monkeypatch, device
):
    # the attention mask grows by a column a decode step: its rows are staged after the plan's,
    # its call's metadata copied and patched, and the print table ordered otherwise than the
    # general hooks order it
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(llama_dir, dtype).to(device)
    general, _ = _dump(model, tmp_path, "general", False, monkeypatch, device, padded=True)
    planned, counters = _dump(model, tmp_path, "planned", True, monkeypatch, device, padded=True)
    assert counters == (NEW_TOKENS - 3, 0)
    assert any('"attention_mask"' in meta or ".attention_mask" in meta for meta, _ in planned)
    _same_prints(general, planned)


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
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_a_pass_that_leaves_its_plan_writes_the_general_hooks_files(
    llama_dir, tmp_path, monkeypatch, where, forward, padded
):
    runs = {}
    for plans in (False, True):
        model = load_model(llama_dir, torch.float32)
        _Detour(model, model.get_submodule(f"model.layers.1.{where}"), forward, on_pass=5)
        runs[plans] = _dump(model, tmp_path, f"plans-{plans}", plans, monkeypatch, "cpu", padded=padded)
    (general, _), (planned, (followed, left)) = runs[False], runs[True]
    # decode step 2 is traced and step 3 follows its plan; step 4 (the fifth pass) leaves it,
    # step 5 is traced again and steps 6-7 follow the new plan
    assert (followed, left) == (3, 1)
    _same_dumps(general, planned)  # padded: a growing mask staged before and after it left its plan


class _AsContiguous(torch.nn.Module):  # returns its input itself when it is contiguous already
    def forward(self, x):
        return x.contiguous()


class _Block(torch.nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared, self.contiguous, self.lin = shared, _AsContiguous(), torch.nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.lin(self.contiguous(self.shared(x))) * scale


class _Scripted(torch.nn.Module):
    """Two blocks sharing one module (as sglang's layers share a rotary embedding); each forward
    follows the next entry of ``script``: the same calls every pass, with what differs chosen."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        shared = torch.nn.Tanh()
        self.layers = torch.nn.ModuleList([_Block(shared), _Block(shared)])
        self.script: list = []

    def forward(self, input_ids):
        how = self.script.pop(0)
        h = self.embed(input_ids)
        if how.get("strided"):  # the same values laid out column-major
            h = h.transpose(1, 2).contiguous().transpose(1, 2)
        for layer in self.layers:
            h = layer(h, scale=how.get("scale", 1.0))
        return h


def _scripted_dumps(tmp_path, monkeypatch, script, filter=""):
    """The general hooks' and the planned dump of the same passes: each is (passes, counters)."""
    dumps = []
    for plans in (False, True):
        torch.manual_seed(0)
        model = _Scripted().eval()

        def run(model=model):
            for how in script:
                model.script.append(how)
                ids = torch.arange(3, 3 + how.get("tokens", 4)).unsqueeze(0)  # not an inference tensor
                with how.get("mode", torch.no_grad)():
                    model(ids)

        dumps.append(_dumped(model, tmp_path, f"plans-{plans}", plans, monkeypatch, run, filter=filter))
    return dumps


SAME = [{}] * 3  # a structure is met, traced, then its plan followed


@pytest.mark.parametrize(
    "script, counters",
    [
        # the block's input contiguous again: .contiguous() returns the tensor itself, which the
        # general hooks alias where the trace stored a copy
        pytest.param([{"strided": True}] * 3 + [{}] * 4, (3, 1), id="an-alias-where-the-trace-stored-a-copy"),
        pytest.param(
            [{"scale": np.float64(0.0)}] * 3 + [{"scale": np.float64(-0.0)}] * 3,
            (2, 1),
            id="a-float-argument-of-the-other-sign",
        ),
        pytest.param([{"scale": float("nan")}] * 5, (3, 0), id="a-nan-argument-followed"),
        pytest.param(
            # traced in inference mode (its tensors have no versions: no aliases); outside it the
            # pass copies strided rows into the pool, until the first alias leaves the plan and
            # the general hooks copy more into it
            [{"mode": torch.inference_mode, "strided": True}] * 3 + [{"strided": True}] * 2,
            (1, 1),
            id="a-pool-made-in-inference-mode-written-outside-it",
        ),
        pytest.param(
            SAME + [{"tokens": 6}] * 4 + SAME + [{"tokens": 6}],
            (7, 0),
            id="two-plans-taking-turns-the-pool-grown-between",
        ),
    ],
)
def test_passes_of_a_changing_structure_write_the_general_hooks_files(tmp_path, monkeypatch, script, counters):
    (general, _), (planned, followed_left) = _scripted_dumps(tmp_path, monkeypatch, script)
    assert followed_left == counters
    _same_files(general, planned)


def test_a_filter_leaving_out_a_shared_modules_other_calls_keeps_the_plan(tmp_path, monkeypatch):
    (general, _), (planned, followed_left) = _scripted_dumps(tmp_path, monkeypatch, [{}] * 6, filter="layers.0")
    assert followed_left == (4, 0)
    _same_files(general, planned)


class _Varying(torch.nn.Module):
    """Token ids in one flat dim, as an engine passes them; per pass, from ``script``: how many
    copies of the embedding rows ``repeat`` makes (a tensor whose shape varies, which a norm then
    takes: [T, k] rows are a norm's per-head rows to the general hooks), the length of a mask
    each ``use`` takes, and a scalar it takes after the mask."""

    class Repeat(torch.nn.Module):
        times = 1

        def forward(self, h):
            return h.repeat(self.times, 1)

    class Use(torch.nn.Module):
        def forward(self, h, mask, scale):
            return h * scale + mask.mean()

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x * 2

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.repeat, self.norm = self.Repeat(), self.Norm()
        self.uses = torch.nn.ModuleList([self.Use() for _ in range(3)])
        self.script: list = []

    def forward(self, input_ids):
        self.repeat.times, length, scale = self.script.pop(0)
        h = self.norm(self.repeat(self.embed(input_ids)))[: len(input_ids)]
        for use in self.uses:
            h = use(h, torch.ones(4, length), scale)
        return h


@pytest.mark.parametrize(
    "script, counters",
    [
        # the repeated rows seen by the norm once as [T, 8], then as [2T, 8]: the general hooks
        # store its per-head view where the trace had an alias, so the pass leaves the plan
        pytest.param([(1, 5, 1.0)] * 3 + [(2, 5, 1.0)] * 3, (2, 1), id="a-varying-tensor-a-norm-takes-per-head"),
        # the mask grows, and in the fifth pass the scalar after it changes: the mask staged for
        # the plan must not stay in the print table when the pass leaves it there
        pytest.param(
            [(1, 5, 1.0)] * 3 + [(1, 6, 1.0), (1, 7, 2.0), (1, 8, 1.0), (1, 9, 1.0)],
            (3, 1),
            id="a-grown-mask-then-a-scalar-of-the-same-call-differs",
        ),
        # masks far larger than the trace's: the general hooks print rows before the pass's end
        pytest.param([(1, 5, 1.0)] * 3 + [(1, 5000, 1.0)] * 2, (1, 1), id="varying-rows-beyond-the-staging-bytes"),
    ],
)
def test_passes_whose_tensors_vary_give_the_general_hooks_prints(tmp_path, monkeypatch, script, counters):
    monkeypatch.setattr(passprints.PassPrints.__init__, "__defaults__", (60_000, True))  # stage_bytes
    dumps = []
    for index, plans in enumerate((False, True, True)):
        torch.manual_seed(0)
        model = _Varying().eval()

        def run(model=model):
            for how in script:
                model.script.append(how)
                model(torch.arange(3, 7))

        dumps.append(_dumped(model, tmp_path, f"run-{index}", plans, monkeypatch, run))
    (general, _), (planned, followed_left), (again, _) = dumps
    assert followed_left == counters
    _same_prints(general, planned)
    _same_files(planned, again)  # the plan's places of varying tensors print as zeros, not as leftovers
