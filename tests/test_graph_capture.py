"""Dumping CUDA graph replays: the books kept on CPU tensors.

What a graph records is decided by the hooks at capture time and written by after_replay; none
of that bookkeeping needs CUDA. A forward recorded the way a capture records it (the static
slots of an arena on the CPU, filled by the forward itself, as a replay fills them on a GPU) and
written by after_replay must give the pass an eager forward of the same inputs gives: the same
tensors, names, shapes and token rows, with padding rows trimmed and row selection applied.
tests/test_gpu_graphs.py checks the real capture and replays on a GPU.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.arena import ALIGN, Arenas
from dumpdiff.dumper.config import ConfigError, DumperConfig
from dumpdiff.dumper.graphs import GraphBufferError
from helpers import load_model, make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("graphs") / "llama"))


def step_inputs(model, batch, seq=1, start=5, seed=0):
    from transformers import StaticCache

    ids = torch.randint(3, 1000, (batch, seq), generator=torch.Generator().manual_seed(seed))
    pos = (torch.arange(seq) + start).expand(batch, seq)
    return dict(
        input_ids=ids,
        position_ids=pos,
        cache_position=pos[0],
        past_key_values=StaticCache(config=model.config, max_cache_len=32),
        use_cache=True,
    )


def eager_pass(model, root, inputs, **config):
    handle = dumper.install(model, DumperConfig(dir=str(root), exp_name="eager", enable=True, **config))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return read_pass(root / "eager")


def replayed_pass(model, root, inputs, batch_rows=None, **config):
    """A forward recorded as a capture records it, then written by after_replay."""
    settings = dict(dir=str(root), exp_name="graph", graph_buffer_bytes=1 << 22)
    handle = dumper.install(model, DumperConfig(**{**settings, **config}))
    key = object()
    try:
        with torch.no_grad(), handle.graph_recording(key) as recordings:
            handle._graphs.captured_forward(handle._original_forward, (), inputs)
        assert len(recordings) == 1
        assert not os.path.exists(root / "graph")  # a capture writes nothing
        handle.configure(enable=True)
        assert handle.after_replay(key, batch_rows=batch_rows) == 1
    finally:
        handle.remove()
    return read_pass(root / "graph")


def read_pass(folder, index=0):
    with safe_open(str(folder / "rank0" / fmt.pass_file_name(index)), "pt") as handle:
        return json.loads(handle.metadata()[fmt.PASS_META_KEY]), {k: handle.get_tensor(k) for k in handle.keys()}


def assert_same_calls(meta_a, meta_b):
    assert [c["call"] for c in meta_a["calls"]] == [c["call"] for c in meta_b["calls"]]
    for call_a, call_b in zip(meta_a["calls"], meta_b["calls"]):
        assert call_a["tensors"] == call_b["tensors"], call_a["call"]


def test_a_replay_is_written_as_the_eager_pass_of_the_same_inputs(model, tmp_path):
    inputs = step_inputs(model, batch=3)
    meta_e, tensors_e = eager_pass(model, tmp_path, inputs)
    inputs["past_key_values"] = step_inputs(model, batch=3)["past_key_values"]
    meta_g, tensors_g = replayed_pass(model, tmp_path, inputs)
    assert meta_g["tokens"] == meta_e["tokens"] and meta_g["token_shape"] == [3, 1]
    assert_same_calls(meta_e, meta_g)
    assert tensors_g.keys() == tensors_e.keys()
    for name, tensor in tensors_e.items():
        assert torch.equal(tensors_g[name], tensor), name
    assert meta_g["graph"] == {"captured_token_shape": [3, 1], "batch_rows": 3, "padding_rows_trimmed": 0, "replay": 1}
    assert "graph" not in meta_e


def test_padding_rows_are_trimmed_from_every_tensor_and_the_rows(model, tmp_path):
    inputs = step_inputs(model, batch=4)
    meta_e, tensors_e = eager_pass(model, tmp_path, inputs)
    inputs["past_key_values"] = step_inputs(model, batch=4)["past_key_values"]
    meta_g, tensors_g = replayed_pass(model, tmp_path, inputs, batch_rows=2)
    assert meta_g["graph"]["padding_rows_trimmed"] == 2 and meta_g["token_shape"] == [2, 1]
    assert meta_g["tokens"] == {key: values[:2] for key, values in meta_e["tokens"].items()}
    assert [s["seq"] for s in meta_g["seqs"]] == [s["seq"] for s in meta_e["seqs"]][:2]
    for call_e, call_g in zip(meta_e["calls"], meta_g["calls"]):
        for name, entry in call_e["tensors"].items():
            shape = list(entry["shape"])
            if entry["token_dims"] is not None:
                shape[0] = shape[0] // 2
            assert call_g["tensors"][name]["shape"] == shape, name
    for name, tensor in tensors_e.items():
        entry = next(c["tensors"][name] for c in meta_e["calls"] if name in c["tensors"])
        expected = tensor[: tensor.shape[0] // 2] if entry["token_dims"] is not None else tensor
        assert torch.equal(tensors_g[name], expected), name


@pytest.mark.parametrize("mode", ["all", "fingerprint"])
def test_replays_of_other_batch_sizes_in_turn_each_write_their_own_pass(model, tmp_path, mode):
    """Replays of one graph with 4, 2, 4 and 1 real batch rows (the metadata of each batch size
    is worked out once and shared): each pass is the one a single replay of that size writes."""
    inputs = step_inputs(model, batch=4)
    handle = dumper.install(
        model,
        DumperConfig(dir=str(tmp_path), exp_name="turns", graph_buffer_bytes=1 << 22, non_intrusive_mode=mode),
    )
    key = object()
    sizes = [4, 2, 4, 1]
    try:
        with torch.no_grad(), handle.graph_recording(key):
            handle._graphs.captured_forward(handle._original_forward, (), inputs)
        handle.configure(enable=True)
        for rows in sizes:
            assert handle.after_replay(key, batch_rows=rows) == 1
    finally:
        handle.remove()
    for index, rows in enumerate(sizes):
        meta_t, tensors_t = read_pass(tmp_path / "turns", index)
        inputs["past_key_values"] = step_inputs(model, batch=4)["past_key_values"]
        meta_1, tensors_1 = replayed_pass(
            model, tmp_path / f"single{index}", inputs, batch_rows=rows, non_intrusive_mode=mode
        )
        assert meta_t["token_shape"] == meta_1["token_shape"] == [rows, 1]
        assert_same_calls(meta_1, meta_t)
        assert tensors_t.keys() == tensors_1.keys()
        for name, tensor in tensors_1.items():
            assert torch.equal(tensors_t[name], tensor), (rows, name)


def test_row_selection_applies_to_the_replay_s_real_rows(model, tmp_path):
    inputs = step_inputs(model, batch=2, seq=4, start=0)
    meta_e, tensors_e = eager_pass(model, tmp_path, inputs, positions="2:")
    inputs["past_key_values"] = step_inputs(model, batch=2, seq=4, start=0)["past_key_values"]
    meta_g, tensors_g = replayed_pass(model, tmp_path, inputs, positions="2:")
    assert meta_g["kept_rows"] == meta_e["kept_rows"] == [2, 3, 6, 7]
    assert_same_calls(meta_e, meta_g)
    for name, tensor in tensors_e.items():
        assert torch.equal(tensors_g[name], tensor), name


@pytest.mark.parametrize("batch_rows", [None, 1])
def test_fingerprints_recorded_in_the_graph_are_the_eager_ones(model, tmp_path, batch_rows):
    inputs = step_inputs(model, batch=2)
    meta_e, tensors_e = eager_pass(model, tmp_path, inputs, non_intrusive_mode="fingerprint")
    inputs["past_key_values"] = step_inputs(model, batch=2)["past_key_values"]
    meta_g, tensors_g = replayed_pass(model, tmp_path, inputs, batch_rows, non_intrusive_mode="fingerprint")
    assert list(tensors_g) == [fmt.ROWPRINTS_TENSOR] and meta_g["rowprint"] == meta_e["rowprint"]
    table_e, table_g = tensors_e[fmt.ROWPRINTS_TENSOR], tensors_g[fmt.ROWPRINTS_TENSOR]
    for call_e, call_g in zip(meta_e["calls"], meta_g["calls"]):
        for name, entry in call_e["tensors"].items():
            if "print" not in entry:
                continue
            first_e, count_e = entry["print"]
            first_g, count_g = call_g["tensors"][name]["print"]
            per_row = entry["token_dims"] is not None and count_e > 1
            keep = count_e // 2 if per_row and batch_rows == 1 else count_e
            assert count_g == keep, name
            assert torch.equal(table_g[:, first_g : first_g + count_g], table_e[:, first_e : first_e + keep]), name


def test_a_budget_too_small_fails_the_capture_naming_what_did_not_fit(model, tmp_path):
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), graph_buffer_bytes=2 * ALIGN))
    try:
        with torch.no_grad(), pytest.raises(GraphBufferError) as caught, handle.graph_recording("g"):
            handle._graphs.captured_forward(handle._original_forward, (), step_inputs(model, batch=2))
        assert handle._graphs.recordings("g") == []
    finally:
        handle.remove()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"DUMPER_GRAPH_BUFFER_BYTES={2 * ALIGN} is too small")
    needed = int(message.split("the selection needs ")[1].split()[0])
    assert needed > 2 * ALIGN and f"at least {needed}" in message
    assert "#0." in message.split(" did not fit")[0]


def test_replays_while_disabled_write_nothing_and_unrecorded_graphs_say_why(model, tmp_path, caplog):
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), exp_name="g", graph_buffer_bytes=1 << 22))
    try:
        with torch.no_grad(), handle.graph_recording("g"):
            handle._graphs.captured_forward(handle._original_forward, (), step_inputs(model, batch=2))
        assert handle.after_replay("g") == 0  # dumping disabled: the slots are filled, nothing is written
        handle.configure(enable=True)
        with caplog.at_level(logging.WARNING, logger="dumper"):
            assert handle.after_replay("other") == 0
        assert "recorded nothing at capture" in caplog.text
        with caplog.at_level(logging.WARNING, logger="dumper"):
            assert handle.after_replay("g", batch_rows=3) == 0  # more rows than the graph holds
        assert "not dumped" in caplog.text and "batch_rows=3" in caplog.text
        assert handle.after_replay("g", batch_rows=1) == 1
        handle.flush()
    finally:
        handle.remove()
    meta, _ = read_pass(tmp_path / "g")
    assert meta["graph"]["replay"] == 1 and meta["graph"]["batch_rows"] == 1


def test_graph_dumping_needs_a_budget_and_keeps_it_fixed(model, tmp_path):
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path)))
    try:
        with pytest.raises(ConfigError, match="DUMPER_GRAPH_BUFFER_BYTES > 0"):
            handle.after_replay("g")
    finally:
        handle.remove()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), graph_buffer_bytes=4096))
    try:
        with pytest.raises(ConfigError, match="fixed at install"):
            handle.configure(graph_buffer_bytes=8192)
        from dumpdiff.dumper.control import handle as control

        with pytest.raises(ConfigError, match="DUMPER_GRAPH_BUFFER_BYTES"):
            control(handle, "configure", {"graph_buffer_bytes": 1})
    finally:
        handle.remove()
    with pytest.raises(ConfigError, match="DUMPER_GRAPH_BUFFER_BYTES"):
        DumperConfig.from_env({"DUMPER_GRAPH_BUFFER_BYTES": "lots"})
    assert DumperConfig.from_env({"DUMPER_GRAPH_BUFFER_BYTES": "1e9"}).graph_buffer_bytes == 10**9


def test_the_arena_keeps_one_budget_for_the_largest_graph():
    arenas = Arenas(4 * ALIGN)
    first, second = arenas.layout(), arenas.layout()
    assert first.record("a", torch.arange(10, dtype=torch.float32))
    assert first.record("b", torch.ones(3, 2, dtype=torch.bfloat16))
    assert [slot[2] for slot in first.slots] == [0, ALIGN]  # each slot aligned
    assert second.record("c", torch.zeros(ALIGN, dtype=torch.int32))  # starts at 0 again: graphs take turns
    assert arenas.reserved == 4 * ALIGN
    assert not second.record("d", torch.zeros(1, dtype=torch.int8))  # 4 * ALIGN used
    assert second.first_missing == ("d", 1)
    assert torch.equal(first.host_copy()["a"], torch.arange(10, dtype=torch.float32)) is False  # c overwrote it
    assert torch.equal(second.host_copy()["c"], torch.zeros(ALIGN, dtype=torch.int32))


def test_a_budget_off_the_alignment_still_holds_the_last_slot_s_aligned_end():
    """A replay copies off every byte up to the last slot's aligned end: the arena must hold it
    when the budget (DUMPER_GRAPH_BUFFER_BYTES=1e7, say) is not a multiple of the alignment."""
    arenas = Arenas(3 * ALIGN + 40)
    layout = arenas.layout()
    assert layout.take("a", torch.zeros(ALIGN // 2)) is not None  # 2 * ALIGN bytes
    assert layout.take("b", torch.zeros(ALIGN // 4 + 1)) is not None  # ends past 3 * ALIGN + 40
    device = torch.device("cpu")
    assert layout.used[device] == 4 * ALIGN <= arenas.arena(device).numel()
    assert set(layout.host_copy()) == {"a", "b"}


def test_forwards_captured_into_one_graph_keep_their_own_slots(model, tmp_path):
    """A graph capturing two forwards replays both before anything is copied off: each forward's
    pass must hold its own tensors, not the last forward's."""
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), exp_name="two", graph_buffer_bytes=1 << 22))
    key = object()
    first, second = step_inputs(model, batch=2, seed=1), step_inputs(model, batch=2, seed=2)
    try:
        with torch.no_grad(), handle.graph_recording(key) as recordings:
            handle._graphs.captured_forward(handle._original_forward, (), first)
            handle._graphs.captured_forward(handle._original_forward, (), second)
        assert len(recordings) == 2
        handle.configure(enable=True)
        assert handle.after_replay(key) == 2
    finally:
        handle.remove()
    for index, inputs in enumerate((first, second)):
        meta, tensors = read_pass(tmp_path / "two", index)
        assert meta["tokens"]["ids"] == inputs["input_ids"].view(-1).tolist()
        assert torch.equal(tensors[fmt.ROOT_PATH + "#0.in.input_ids"], inputs["input_ids"]), index


def test_the_sglang_adapter_reads_a_captured_batch_s_layout_from_shapes():
    from dumpdiff.dumper.engines.sglang import SglangAdapter

    class ForwardBatch:  # sglang's class is found by its name; at capture its values are not a batch's
        input_ids = torch.zeros(24, dtype=torch.long)

    assert SglangAdapter().capture_shape(None, (torch.zeros(24), torch.zeros(24), ForwardBatch()), {}) == [24]
    with pytest.raises(ValueError, match="without a ForwardBatch"):
        SglangAdapter().capture_shape(None, (), {})


def test_a_replayed_dump_reads_and_compares_as_an_eager_one(model, tmp_path):
    from helpers import check_schema, dumpdiff

    inputs = step_inputs(model, batch=4, start=0)  # rows at position 0: alignable on their own
    eager_pass(model, tmp_path, inputs)
    inputs["past_key_values"] = step_inputs(model, batch=4)["past_key_values"]
    meta, _ = replayed_pass(model, tmp_path, inputs, batch_rows=3)
    check_schema(meta, "pass")
    code, out, err = dumpdiff("first-divergence", tmp_path / "eager", tmp_path / "graph", "--format", "json")
    assert code == 0, err
    verdict = json.loads(out)["ranks"]["0"]
    assert verdict["alignment"]["rows_b"] == 3 and verdict["alignment"]["unaligned_b"] == 0


def test_the_graph_recipe_refuses_a_sliding_window_cache_and_takes_a_full_one(model, tmp_path):
    """examples/hf_cuda_graph.py replays a static cache in a graph: a sliding-window layer keeps
    its length in a Python int that a replay does not advance, so a Gemma-2 is refused up front
    rather than dumped wrong once its window fills; the Llama builds."""
    import sys

    from tiny_models import make_tiny_gemma2

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    try:
        from hf_cuda_graph import GraphDecoder, _static_cache, has_sliding_layers
    finally:
        sys.path.pop(0)
    GraphDecoder(model, batch=2, max_len=32)
    gemma = load_model(make_tiny_gemma2(tmp_path / "gemma2", hidden_size=64, num_hidden_layers=2))
    from transformers import StaticCache

    cache = _static_cache(StaticCache, gemma, 2, 32, "cpu")
    if not has_sliding_layers(cache):
        pytest.skip("this transformers' static cache has no sliding-window layers")
    with pytest.raises(ValueError, match="sliding-window attention layers"):
        GraphDecoder(gemma, batch=2, max_len=32)
