"""Dumping CUDA graph replays on a GPU: an HF Llama's decode steps, each one replay of a graph
captured with a static KV cache (examples/hf_cuda_graph.py), dumped against the same steps run
eagerly: the same tokens, the same calls and shapes, the same alignment, bit-identical tensors;
a batch padded up to the captured size has its padding rows trimmed; a graph-only bug (an output
buffer a capture-time check leaves unrefreshed) is named at its call; a budget too small is one
line naming what did not fit.

Skipped without CUDA (CI has no GPU); run on a GPU machine with
``python -m pytest -q tests/test_gpu_graphs.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.graphs import GraphBufferError
from helpers import dumpdiff, load_model, make_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT, STEPS = 12, 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("graphs") / "llama", num_hidden_layers=3)


def fresh_model(path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_model(path).cuda()


class StaleOutput(torch.nn.Module):
    """A projection whose output buffer is refreshed on every eager call but not inside a capture
    (a check meant for something else): each replay returns what the warm-up left there."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.outs = {}  # one static output buffer per shape

    def forward(self, x):
        y = self.inner(x)
        if tuple(y.shape) not in self.outs:
            self.outs[tuple(y.shape)] = torch.empty_like(y)
        out = self.outs[tuple(y.shape)]
        if not torch.cuda.is_current_stream_capturing():
            out.copy_(y)
        return out


def run(path, root, name, graphs, batch=2, captured=None, plant=False, **config):
    """Dump prefill + decode steps of one batch as ``name``; returns the new tokens."""
    from hf_cuda_graph import GraphDecoder

    model = fresh_model(path)
    if plant:
        mlp = model.model.layers[1].mlp
        mlp.down_proj = StaleOutput(mlp.down_proj)
    settings = dict(dir=str(root), cleanup_previous=True, graph_buffer_bytes=64 << 20)
    handle = dumper.install(model, dumper.DumperConfig(**{**settings, **config}))
    try:
        rows = captured or batch
        decoder = GraphDecoder(model, rows, PROMPT + STEPS + 1, handle, graphs)
        if graphs:
            decoder.capture()
        prompt = torch.randint(3, 1000, (rows, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
        handle.configure(enable=True, exp_name=name)
        tokens = decoder.generate(prompt, STEPS, batch_rows=batch if captured else None)
    finally:
        handle.remove()
    return tokens


def passes(folder):
    rank = os.path.join(folder, "rank0")
    out = []
    for name in sorted(n for n in os.listdir(rank) if n.endswith(".safetensors")):
        with safe_open(os.path.join(rank, name), "pt") as handle:
            meta = json.loads(handle.metadata()[fmt.PASS_META_KEY])
            out.append((meta, {k: handle.get_tensor(k) for k in handle.keys()}))
    return out


def verdict(a, b):
    code, out, err = dumpdiff("first-divergence", a, b, "--format", "json", "--no-progress")
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("mode", ["all", "fingerprint"])
def test_replayed_decode_steps_dump_as_eager_ones(model_path, tmp_path, mode):
    eager = run(model_path, tmp_path, "eager", graphs=False, non_intrusive_mode=mode)
    graph = run(model_path, tmp_path, "graph", graphs=True, non_intrusive_mode=mode)
    assert torch.equal(eager, graph)
    a, b = passes(tmp_path / "eager"), passes(tmp_path / "graph")
    assert len(a) == len(b) == 1 + STEPS
    for (meta_a, tensors_a), (meta_b, tensors_b) in zip(a, b):
        assert meta_a["tokens"] == meta_b["tokens"] and meta_a["mode"] == meta_b["mode"]
        calls_a = {c["call"]: c["tensors"] for c in meta_a["calls"]}
        calls_b = {c["call"]: c["tensors"] for c in meta_b["calls"]}
        assert calls_a.keys() == calls_b.keys()
        for call, tensors in calls_a.items():
            for name, entry in tensors.items():
                assert entry["shape"] == calls_b[call][name]["shape"], name
        assert tensors_a.keys() == tensors_b.keys()
        for name, tensor in tensors_a.items():
            if name == fmt.ROWPRINTS_TENSOR:
                continue  # laid out in another order (staging blocks against call order): compared per tensor
            assert torch.equal(tensor.view(-1).view(torch.uint8), tensors_b[name].view(-1).view(torch.uint8)), name
        if fmt.ROWPRINTS_TENSOR in tensors_a:
            table_a, table_b = tensors_a[fmt.ROWPRINTS_TENSOR], tensors_b[fmt.ROWPRINTS_TENSOR]
            for call, tensors in calls_a.items():
                for name, entry in tensors.items():
                    if "print" in entry:
                        (first_a, n), (first_b, n_b) = entry["print"], calls_b[call][name]["print"]
                        assert n == n_b and torch.equal(
                            table_a[:, first_a : first_a + n], table_b[:, first_b : first_b + n]
                        ), name
    assert all("graph" in meta for meta, _ in b[1:]) and "graph" not in b[0][0]
    code, result = verdict(tmp_path / "eager", tmp_path / "graph")
    assert code == 0, result
    alignment = result["ranks"]["0"]["alignment"]
    assert alignment["unaligned_b"] == 0 and alignment["rows_b"] == 2 * (PROMPT + STEPS)


def test_padding_rows_are_trimmed_and_marked(model_path, tmp_path):
    eager = run(model_path, tmp_path, "eager", graphs=False, batch=4)
    graph = run(model_path, tmp_path, "graph", graphs=True, batch=2, captured=4)
    assert torch.equal(eager, graph)  # the padded rows compute, the dump drops them
    for meta, tensors in passes(tmp_path / "graph")[1:]:
        assert meta["graph"]["batch_rows"] == 2 and meta["graph"]["padding_rows_trimmed"] == 2
        assert meta["token_shape"] == [2, 1] and len(meta["tokens"]["ids"]) == 2
        assert len({s["seq"] for s in meta["seqs"]}) == 2
        assert tensors["model.embed_tokens#0.out.0"].shape[0] == 2
    code, result = verdict(tmp_path / "eager", tmp_path / "graph")
    assert code == 0, result
    assert result["ranks"]["0"]["alignment"]["unaligned_b"] == 0


@pytest.mark.parametrize("mode", ["all", "fingerprint"])
def test_a_stale_static_buffer_is_named_at_its_call(model_path, tmp_path, mode):
    run(model_path, tmp_path, "eager", graphs=False, plant=True, non_intrusive_mode=mode)
    run(model_path, tmp_path, "graph", graphs=True, plant=True, non_intrusive_mode=mode)
    code, result = verdict(tmp_path / "eager", tmp_path / "graph")
    assert code == 1
    culprit = result["culprit"]
    assert culprit["call"] == "model.layers.1.mlp.down_proj#0", culprit


def test_a_budget_too_small_is_one_line_naming_what_did_not_fit(model_path, tmp_path):
    from hf_cuda_graph import GraphDecoder

    model = fresh_model(model_path)
    handle = dumper.install(model, dumper.DumperConfig(dir=str(tmp_path), graph_buffer_bytes=4096))
    try:
        decoder = GraphDecoder(model, 2, 32, handle)
        with pytest.raises(GraphBufferError) as caught:
            decoder.capture()
    finally:
        handle.remove()
    message = str(caught.value)
    assert "\n" not in message and "DUMPER_GRAPH_BUFFER_BYTES=4096" in message
    assert "did not fit" in message and "#0." in message
