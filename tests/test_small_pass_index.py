"""Small passes (decode steps) are indexed from a structure worked out once per shape of step
(analyzer/index/smallpass.py): the tables must be the ones the tensor-by-tensor path builds, for every
row layout the dumper writes, and a step whose structure changed must not reuse the old one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dumpdiff.analyzer.dump.dtypes import BY_NAME
from dumpdiff.analyzer.dump.load import PassFile, open_dump
from dumpdiff.analyzer.index import build as indexbuild
from dumpdiff.analyzer.index import smallpass
from dumpdiff.analyzer.index.rowplan import RowPlan
from dumpdiff.analyzer.index.rows import reader_of
from helpers import dump_pair, load_model, make_tiny_llama, prompt_ids


def tables_both_ways(ref):
    """(through smallpass, tensor by tensor) tables of one pass, as comparable text."""
    pf = PassFile(ref)
    valid = np.asarray(pf.meta["tokens"]["valid"], dtype=bool)
    n_rows = len(valid)
    small = smallpass.small_pass_tables(pf, n_rows, valid)
    assert small is not None
    direct = indexbuild._tensor_by_tensor(pf, n_rows, valid)
    return as_text(small), as_text(direct)


def as_text(tables) -> str:
    """Index tables (columns of numpy arrays, encoded text, lists) as comparable text."""
    return json.dumps(
        {
            t: {
                c: (
                    v.tolist()
                    if isinstance(v, np.ndarray)
                    else [v.codes.tolist(), v.vocabulary.tolist()]
                    if hasattr(v, "codes")
                    else v
                )
                for c, v in cols.items()
            }
            for t, cols in tables.items()
        },
        default=str,
    )


def built_json(tables) -> str:
    """A build's pyarrow tables as comparable text (json: NaN equals NaN)."""
    return json.dumps({name: table.to_pydict() for name, table in tables.items()})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = load_model(make_tiny_llama(tmp_path_factory.mktemp("llama")))
    model.generation_config.eos_token_id = None
    return model


def padded_batch_dump(model, root, **config):
    """Three left-padded prompts, generated together: padding rows, and attention masks whose
    shape grows every step (every decode step's structure differs from the one before)."""
    from dumpdiff import dumper

    prompts = [prompt_ids(n, seed=n)[0].tolist() for n in (5, 9, 13)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="dec", **config))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    handle.remove()
    return root / "dec"


@pytest.mark.parametrize("config", [{}, {"positions": "3:"}, {"last_rows": 2}], ids=["all", "positions", "last_rows"])
def test_padded_batch_steps_index_as_tensor_by_tensor(llama, tmp_path, config, monkeypatch):
    built = count_structures(monkeypatch)
    dec = padded_batch_dump(llama, tmp_path, **config)
    passes = open_dump(str(dec)).ranks[0].passes
    assert len(passes) == 6
    for ref in passes:
        small, direct = tables_both_ways(ref)
        assert small == direct, ref.path
    # the prefill; the first decode step; the second, where the masks are seen growing (they
    # become volatile); the three steps after it reuse that one
    assert len(built) == 3


@pytest.mark.parametrize("config", [{}, {"positions": "3:"}, {"last_rows": 2}], ids=["all", "positions", "last_rows"])
def test_the_index_says_where_each_row_lies_in_its_file(llama, tmp_path, config):
    """The rows table's offset of a row is where its bytes are in the pass file (the noise-aware
    walk slices rows out of whole-file reads by it): checked against the row reader, which
    finds them through the file's header, for every row of a padded batch's prefill and decode
    steps (growing masks, padding rows, selected and last rows); -1 only where token dims do
    not lead."""
    from dumpdiff.analyzer.index.store import load_indexes

    dec = padded_batch_dump(llama, tmp_path, **config)
    index = load_indexes([open_dump(str(dec))], progress=False)[0].rank(0)
    rows, tensors = index.frame("rows"), index.frame("tensors")
    rows = rows.merge(tensors[["pass", "tensor", "token_dims", "selected"]], on=["pass", "tensor"])
    leading = [
        dims in (None, "null") or sel or json.loads(dims) == list(range(len(json.loads(dims))))
        for dims, sel in zip(rows["token_dims"], rows["selected"])
    ]
    assert ((rows["offset"] >= 0) == np.array(leading)).all()
    assert np.array(leading).mean() > 0.9
    reader, paths = reader_of(index), {p.pass_id: p.path for p in open_dump(str(dec)).ranks[0].passes}
    files = {pass_id: np.fromfile(path, np.uint8) for pass_id, path in paths.items()}
    for pass_id, tensor, srow, offset in zip(rows["pass"], rows["tensor"], rows["srow"], rows["offset"]):
        if offset >= 0:
            expected = reader.stored_bits(int(pass_id), tensor, [int(srow)])[0].reshape(-1).view(np.uint8)
            assert np.array_equal(files[pass_id][offset : offset + len(expected)], expected), (pass_id, tensor, srow)


def count_structures(monkeypatch) -> list:
    """Counts the structures built from now on (none remembered from earlier tests)."""
    built = []
    real_init = smallpass.Structure.__init__

    def counting_init(self, *args):
        built.append(1)
        real_init(self, *args)

    monkeypatch.setattr(smallpass.Structure, "__init__", counting_init)
    monkeypatch.setattr(smallpass, "_known", type(smallpass._known)(maxlen=smallpass.REMEMBERED))
    return built


def test_a_steady_decode_reuses_one_structure_and_notices_a_change(llama, tmp_path, monkeypatch):
    """One prompt without a mask: every decode step has the same structure, worked out once; a
    second run with another batch size gets its own, and each step's tables stay exact."""
    built = count_structures(monkeypatch)
    _, dec, _ = dump_pair(llama, tmp_path / "one", prompt_ids(10), new_tokens=8)
    passes = open_dump(dec).ranks[0].passes
    for ref in passes:
        small, direct = tables_both_ways(ref)
        assert small == direct
    assert len(built) == 2  # the prefill, then one for all 7 decode steps
    _, dec2, _ = dump_pair(llama, tmp_path / "two", torch.cat([prompt_ids(10), prompt_ids(10, seed=3)]), new_tokens=4)
    for ref in open_dump(dec2).ranks[0].passes:
        small, direct = tables_both_ways(ref)
        assert small == direct
    assert len(built) == 4


def test_row_plans_find_the_bytes_of_kept_rows():
    """Where a plan says a tensor's kept rows lie in the file is where rows() finds them, for
    token dims that lead and for the [B, heads, S, D] layout (rows gathered byte by byte)."""
    meta = {"tokens": {}, "last_rows": [2, 5]}
    valid = np.array([True, False, True, True, True, False])  # token rows 1 and 5 are padding
    f32 = BY_NAME["float32"]
    cases = [
        ({"shape": [2, 3, 4], "token_dims": [0, 1], "rows": "all"}, True),
        ({"shape": [2, 5, 3, 7], "token_dims": [0, 2], "rows": "all"}, False),
        ({"shape": [2, 1, 4], "token_dims": [0, 1], "rows": "last"}, True),
        ({"shape": [4, 4], "token_dims": None, "rows": None}, True),
    ]
    for tmeta, contiguous in cases:
        shape = tuple(tmeta["shape"])
        plan = RowPlan(tmeta, meta, 6, valid, shape)
        assert plan.contiguous == contiguous
        begin = 24
        file = np.random.default_rng(0).integers(0, 255, begin + 4 * int(np.prod(shape))).astype(np.uint8)
        tensor = file[begin:].view(np.uint32).reshape(shape)
        expected = plan.rows(tensor).reshape(-1).view(np.uint8)
        if contiguous:
            got = np.concatenate([file[a:b] for a, b in plan.byte_runs(begin, f32)])
            width = len(expected) // len(plan.srow)
            by_offset = np.concatenate([file[o : o + width] for o in plan.row_offsets(begin, f32).tolist()])
            assert np.array_equal(by_offset, expected), tmeta
        else:
            got = file[plan.byte_index(begin, f32)]
            assert (plan.row_offsets(begin, f32) == -1).all()
        assert np.array_equal(got, expected), tmeta
    dropped = RowPlan(cases[0][0], meta, 6, valid, (2, 3, 4))
    assert dropped.kept_rows.tolist() == [0, 2, 3, 4] and len(dropped.byte_runs(0, f32)) == 2  # rows 0 | 2-4


@pytest.mark.parametrize("damage", ["float shape", "bool pre", "string dim"])
def test_a_damaged_step_among_identical_ones_is_refused(llama, tmp_path, damage):
    """Calls written as in a checked step skip re-checking; a damaged step's calls are not written
    so (even where JSON's 1 == 1.0 == true makes them equal), so they are checked and refused:
    one line, exit 2."""
    from dump_surgery import edit_pass_meta, one_line_error, pass_path
    from helpers import dumpdiff

    _, dec, _ = dump_pair(llama, tmp_path, prompt_ids(10), new_tokens=8)

    def edit(meta):
        tensors = meta["calls"][-1]["tensors"]
        name = next(iter(tensors))
        if damage == "float shape":
            tensors[name]["shape"] = [float(s) for s in tensors[name]["shape"]]
        elif damage == "bool pre":
            meta["calls"][1]["pre"] = True if meta["calls"][1]["pre"] == 1 else "x"
        else:
            tensors[name]["token_dims"] = ["0"]

    edit_pass_meta(pass_path(dec, 5), edit)
    one_line_error(dumpdiff("index", dec, "--rebuild", "--no-progress"), "pass-000005", "is malformed")


def test_a_step_keeps_its_own_scalar_values_and_tensor_order(llama, tmp_path):
    """A call taken as already checked must match as written: a scalar argument of another type
    (replayed by a repro) or another tensor order keeps the pass's own call."""
    from dump_surgery import edit_pass_meta, pass_path

    _, dec, _ = dump_pair(llama, tmp_path, prompt_ids(10), new_tokens=8)
    passes = open_dump(dec).ranks[0].passes

    def edit(meta):
        root = meta["calls"][0]
        key = next((k for k, v in root.get("values", {}).items() if type(v) is int), None)
        if key is not None:
            root["values"][key] = float(root["values"][key])
        meta["calls"][2]["tensors"] = dict(reversed(list(meta["calls"][2]["tensors"].items())))
        return key

    keys = []
    edit_pass_meta(pass_path(dec, 5), lambda meta: keys.append(edit(meta)))
    PassFile(passes[4])  # the undamaged step before: its calls are checked and remembered
    edited = PassFile(passes[5]).meta
    assert keys[0] is not None  # the model call takes an int argument (logits_to_keep)
    assert type(edited["calls"][0]["values"][keys[0]]) is float
    before = list(PassFile(passes[4]).meta["calls"][2]["tensors"])
    assert list(edited["calls"][2]["tensors"]) == before[::-1] != before


def test_steps_read_into_one_reused_buffer_keep_their_own_tables(llama, tmp_path):
    """Small passes are read into one buffer per thread, reused by the next pass: the tables of
    every step, indexed one after another that way, are those of each step read on its own
    (nothing in a pass's tables may still point into the buffer once the next one is read)."""
    dec = padded_batch_dump(llama, tmp_path)
    passes = open_dump(str(dec)).ranks[0].passes
    shared = [indexbuild.index_pass(PassFile(ref, whole=True, buffer_for=indexbuild._reused_buffer)) for ref in passes]
    buffer = indexbuild._scratch.buffer
    alone = [indexbuild.index_pass(PassFile(ref, whole=True)) for ref in passes]
    assert [as_text(t) for t in shared] == [as_text(t) for t in alone]
    assert indexbuild._scratch.buffer is buffer and len(buffer) >= max(ref.nbytes for ref in passes[1:])


def test_read_buffers_are_reused_within_a_bound(monkeypatch):
    """A large pass's tensors are read into buffers kept for the next tensors and passes: a
    freed buffer serves any tensor it can hold (the smallest such one), the kept ones never
    add up to more than the read-ahead bound, the smallest are let go first, and a huge one
    (the logits) is not kept."""
    monkeypatch.setattr(indexbuild, "READ_AHEAD_BYTES", 100)
    monkeypatch.setattr(indexbuild, "POOLED_BYTES", 40)
    pool = indexbuild._ReadBuffers()
    sizes = [10, 30, 20, 40, 35, 90]
    given = [np.empty(n, np.uint8) for n in sizes]
    for buffer in given:
        pool.give(buffer)
    # 10+20+30+40 fit the bound; 35 more does not, and the smallest go until it does; 90 is huge
    assert [b.nbytes for b in pool._free] == [35, 40]
    taken = pool.take(25)
    assert taken is given[4]  # the smallest that holds 25 bytes
    fresh = pool.take(45)  # none kept is large enough
    assert fresh.nbytes == 45 and not any(fresh is b for b in given)
    pool.clear()
    assert pool._free == []


def test_large_passes_hashed_in_pieces_by_worker_processes_give_the_same_tables(llama, tmp_path, monkeypatch):
    """On a host with cores to spare, a large pass (a prefill) is hashed in pieces of its tensors
    by worker processes, as per-row hashing holds the GIL: the tables are those one process
    builds, pass by pass and tensor by tensor."""
    from dumpdiff.analyzer.index import settings as index

    dec = padded_batch_dump(llama, tmp_path)
    alone = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    monkeypatch.setattr(indexbuild, "INLINE_PASS_BYTES", 1)  # every pass is large here
    monkeypatch.setattr(indexbuild, "PIECE_BYTES", 4096)  # and goes in several pieces
    monkeypatch.setattr(index, "INDEX_PROCESSES", 2)
    submitted = []
    real_submit = indexbuild._submit_pieces
    monkeypatch.setattr(indexbuild, "_submit_pieces", lambda pool, ref: submitted.append(ref) or real_submit(pool, ref))
    pieces = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    assert len(submitted) == 6
    assert built_json(pieces) == built_json(alone)


def test_a_worker_process_that_dies_is_one_clear_error(llama, tmp_path, monkeypatch):
    """A worker process killed mid-build (the kernel's out-of-memory killer) is a DumpError that
    says so and how to rerun (the command line prints it as one line, exit 2), not an internal
    error."""
    from dumpdiff.analyzer.errors import DumpError
    from dumpdiff.analyzer.index import settings as index

    dec = padded_batch_dump(llama, tmp_path)
    monkeypatch.setattr(indexbuild, "INLINE_PASS_BYTES", 1)
    monkeypatch.setattr(indexbuild, "PIECE_BYTES", 4096)
    monkeypatch.setattr(index, "INDEX_PROCESSES", 2)
    started = []
    real_start = indexbuild._start_in_processes

    def start_then_kill(*args):
        pool, futures, pieces = real_start(*args)
        started.append(pool)
        for proc in pool.processes:
            proc.kill()  # as the out-of-memory killer would, with every piece submitted
        return pool, futures, pieces

    monkeypatch.setattr(indexbuild, "_start_in_processes", start_then_kill)
    with pytest.raises(DumpError, match="worker process indexing the dumps died.*DUMPDIFF_INDEX_PROCESSES=0"):
        indexbuild.build_many([open_dump(str(dec))], progress=False)
    assert started and all(proc.poll() is not None for proc in started[0].processes)  # none left behind


def test_worker_processes_that_cannot_start_leave_the_build_to_threads(llama, tmp_path, monkeypatch, caplog):
    """Worker processes that cannot import what they need (an odd install) are not a failed build:
    the pool is ready only once each has, and otherwise threads build the same tables, with a
    warning that says why."""
    import logging

    from dumpdiff.analyzer.index import settings as index
    from dumpdiff.analyzer.index import workers

    dec = padded_batch_dump(llama, tmp_path)
    alone = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    monkeypatch.setattr(indexbuild, "INLINE_PASS_BYTES", 1)
    monkeypatch.setattr(indexbuild, "PIECE_BYTES", 4096)
    monkeypatch.setattr(index, "INDEX_PROCESSES", 2)
    monkeypatch.setattr(indexbuild, "WorkerPool", lambda n, module: workers.WorkerPool(n, "dumpdiff_no_such_module"))
    with caplog.at_level(logging.WARNING, logger="dumpdiff"):
        tables = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    assert built_json(tables) == built_json(alone)
    assert "indexing on threads alone" in caplog.text and "could not start" in caplog.text, caplog.text


@pytest.mark.parametrize("config", [{}, {"positions": "3:"}, {"last_rows": 2}], ids=["all", "positions", "last_rows"])
def test_tensors_streamed_a_block_of_rows_at_a_time_give_the_tables_of_whole_reads(
    llama, tmp_path, monkeypatch, config
):
    """A tensor whose rows lie in order in the file is streamed a block of rows at a time through
    one small buffer (memory bounded, the buffer stays in cache): its rows, padding rows left out,
    get the figures the whole-tensor read gives."""
    dec = padded_batch_dump(llama, tmp_path, **config)
    monkeypatch.setattr(indexbuild, "INLINE_PASS_BYTES", 1)  # every pass is large: read tensor by tensor
    with monkeypatch.context() as whole:
        whole.setattr(indexbuild, "_plan_in_blocks", lambda *args: None)  # every tensor read whole
        alone = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    in_blocks = []
    real = indexbuild._rows_in_blocks
    monkeypatch.setattr(
        indexbuild, "_rows_in_blocks", lambda pf, name, *a, **k: in_blocks.append(name) or real(pf, name, *a, **k)
    )
    monkeypatch.setattr(indexbuild, "ROW_BLOCK_BYTES", 700)  # a few rows a block, a short last block
    blocks = indexbuild.build_many([open_dump(str(dec))], progress=False)[0]
    assert len(in_blocks) > 100 and any("lm_head" in name for name in in_blocks)
    assert built_json(blocks) == built_json(alone)
