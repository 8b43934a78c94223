"""Fingerprint dumps (DUMPER_NON_INTRUSIVE_MODE=fingerprint) on real tiny HF models: the same
alignment proof, culprit and rows as full dumps of the same run, against each other or against a
full dump; the prints the dumper computes are those the analyzer computes from the bytes; the
focused second run gives what the fingerprints cannot."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil

import numpy as np
import pytest
import torch
from test_core_loop import plant_stale_kv

from dump_surgery import copy_dump, edit_pass_meta, one_line_error, pass_path, rewrite_header
from helpers import (
    dump_pair,
    dumpdiff,
    first_divergence_json,
    load_model,
    make_tiny_llama,
    make_tiny_qwen3_moe,
    prompt_ids,
)

FP = {"non_intrusive_mode": "fingerprint"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=4)


def _model(llama_dir, case):
    dtype = torch.float32 if case == "float32-natural" else torch.bfloat16
    model = load_model(llama_dir, dtype)
    if case == "bfloat16-stale-kv":
        plant_stale_kv(model, layer=1)
    return model


@pytest.fixture(scope="module", params=["float32-natural", "bfloat16-stale-kv"])
def pairs(request, llama_dir, tmp_path_factory):
    """{"full": (ref, dec), "fp": (ref, dec)} of one run dumped both ways."""
    root = tmp_path_factory.mktemp(request.param)
    model = _model(llama_dir, request.param)
    prompt = prompt_ids(20)
    full = dump_pair(model, root / "full", prompt, new_tokens=6)[:2]
    fp = dump_pair(model, root / "fp", prompt, new_tokens=6, **FP)[:2]
    return request.param, {"full": full, "fp": fp}


def _strict_part(result):
    verdict = result["ranks"]["0"]
    culprit = result["culprit"]
    return {
        "proof": verdict["alignment"]["proof"],
        "rows_compared": verdict["rows_compared"],
        "rows_differing": verdict["rows_differing"],
        "per_row": verdict["per_row"],
        "groups": verdict["groups"],
        "culprit": {k: culprit[k] for k in ("call", "module", "cls", "rows", "n_rows", "victims", "note", "shapes")},
    }


def test_fingerprint_dumps_give_the_full_dumps_strict_verdict(pairs):
    case, dumps = pairs
    _, full = first_divergence_json(*dumps["full"])
    if case == "bfloat16-stale-kv":
        assert full["culprit"]["call"] == "model.layers.1.self_attn#0"
    else:
        assert full["culprit"]["module"].startswith("model.layers.0.")
    fp_ref, fp_dec = dumps["fp"]
    full_ref, full_dec = dumps["full"]
    for ref, dec in ((fp_ref, fp_dec), (full_ref, fp_dec), (fp_ref, full_dec)):  # either side may be fingerprints
        code, result = first_divergence_json(ref, dec)
        assert code == 1
        assert _strict_part(result) == _strict_part(full), (ref, dec)
        assert result["kind"] == "not-judged" and "noise" not in result["ranks"]["0"]
        culprit = result["culprit"]
        assert culprit["max_abs"] is None and "fingerprint dump" in culprit["error_note"]
        assert "not judged" in result["ranks"]["0"]["summary"] and "dumpdiff focus" in result["ranks"]["0"]["summary"]


def test_a_fingerprint_dump_and_a_full_dump_of_the_same_prefill_are_identical(pairs):
    """The analyzer's prints of the full dump's bytes are the dumper's prints, row for row."""
    _, dumps = pairs
    code, out, err = dumpdiff("first-divergence", dumps["fp"][0], dumps["full"][0], "--no-progress")
    assert code == 0 and "NO DIVERGENCE" in out, out + err


def test_fingerprint_files_hold_only_the_print_table_and_are_a_fraction_of_the_full_dump(pairs):
    _, dumps = pairs
    from safetensors import safe_open

    sizes = {}
    for kind, (ref, dec) in dumps.items():
        files = glob.glob(os.path.join(ref, "rank0", "*.safetensors")) + glob.glob(
            os.path.join(dec, "rank0", "*.safetensors")
        )
        sizes[kind] = sum(os.path.getsize(f) for f in files)
        if kind == "fp":
            for path in files:
                with safe_open(path, "np") as handle:
                    assert list(handle.keys()) == ["~rowprints"]
                    meta = json.loads(handle.metadata()["dumpdiff.pass"])
                    rows = handle.get_tensor("~rowprints").shape[1]
                assert meta["dump_mode"] == "fingerprint" and meta["rowprint"] == 1
                placed = [t["print"] for c in meta["calls"] for t in c["tensors"].values() if "print" in t]
                assert sum(n for _, n in placed) == rows  # every stored row printed once
    assert sizes["fp"] < sizes["full"] / 2, sizes  # tiny hidden size: the metadata is most of it here


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_prints_carried_in_a_full_dump_are_the_analyzers_prints_of_its_bytes(llama_dir, tmp_path, device, monkeypatch):
    """DUMPER_FINGERPRINTS=1: each stored tensor's prints, computed where it lies (on a GPU: by
    CUDA kernels), equal the analyzer's prints of its bytes on the CPU; the index reads them and
    hashes nothing."""
    model = load_model(llama_dir, torch.bfloat16).to(device)
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(20).to(device), new_tokens=4, fingerprints="1")
    from dumpdiff.analyzer.dump.load import PassFile, open_dump
    from dumpdiff.analyzer.index import prints as printindex
    from dumpdiff.analyzer.index.passtables import stored_tensors
    from dumpdiff.analyzer.index.rowplan import pass_rows

    checked, integer_tensors = 0, set()
    for path in (ref, dec):
        for ref_ in open_dump(path).ranks[0].passes:
            pf = PassFile(ref_)
            carried, _ = pf.bits("~rowprints")
            metas, stored = stored_tensors(pf)
            valid = np.asarray(pf.meta["tokens"]["valid"], dtype=bool)
            plans = pass_rows(pf.meta, len(valid), valid)
            integer_tensors |= {name for name in stored if metas[name]["dtype"].startswith("int")}
            for name in stored:
                bits, dtype = pf.bits(name)
                plan = plans.plan(pf.ref.path, name, metas[name], bits.shape)
                first, count = metas[name]["print"]
                here = printindex._printed_here(plan.rows(bits), dtype)
                kept = carried[:, first : first + count][:, plan.srow]
                assert np.array_equal(here[0], kept[0].view(np.int64)), name
                assert np.array_equal(here[1], kept[1].view(np.float64), equal_nan=True), name
                checked += 1
    assert checked > 50
    _, plain = first_divergence_json(
        *dump_pair(model, tmp_path / "plain", prompt_ids(20).to(device), new_tokens=4, fingerprints="0")[:2]
    )

    def no_hashing(*args, **kwargs):
        raise AssertionError("the index hashed tensor bytes")

    monkeypatch.setattr(printindex, "_printed_here", no_hashing)
    read = []
    bits_of = PassFile.bits
    monkeypatch.setattr(PassFile, "bits", lambda self, name: read.append(name) or bits_of(self, name))
    printindex.build_many([open_dump(ref)], progress=False)
    # the prints, and the integer tensors that might hold the token ids: no float tensor's bytes
    assert "~rowprints" in read and set(read) - {"~rowprints"} <= integer_tensors, sorted(set(read))
    from dumpdiff.analyzer.verdict.diverge import first_divergence

    carried = first_divergence(ref, dec, progress=False, rebuild_index=True)
    assert carried["culprit"] == plain["culprit"] if plain["culprit"] else carried["culprit"] is None
    assert carried["kind"] == plain["kind"]


def test_focus_prints_settings_whose_dump_gives_the_full_dumps_figures_noise_verdict_and_repro(llama_dir, tmp_path):
    model = _model(llama_dir, "float32-natural")
    prompt = prompt_ids(20)
    fp_ref, fp_dec, _ = dump_pair(model, tmp_path / "fp", prompt, new_tokens=6, **FP)
    env_file = tmp_path / "focus.env"
    code, out, err = dumpdiff("focus", fp_ref, fp_dec, "--no-progress", "--env-file", env_file)
    assert code == 0, err
    assert env_file.read_text() == out
    settings = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("DUMPER_"))
    settings = {k: shlex.split(v)[0] for k, v in settings.items()}
    assert settings["DUMPER_NON_INTRUSIVE_MODE"] == "all"
    config = {"filter": settings["DUMPER_FILTER"], "positions": settings["DUMPER_POSITIONS"]}
    ref, dec, _ = dump_pair(model, tmp_path / "focused", prompt, new_tokens=6, **config)
    full_ref, full_dec, _ = dump_pair(model, tmp_path / "full", prompt, new_tokens=6)
    _, full = first_divergence_json(full_ref, full_dec)
    code, focused = first_divergence_json(ref, dec)
    assert code == 1
    assert focused["culprit"]["call"] == full["culprit"]["call"]
    for key in ("max_abs", "max_ulp", "rel"):
        assert focused["culprit"][key] == full["culprit"][key] and focused["culprit"][key] is not None
    assert focused["kind"] == full["kind"] == "batch-variance"
    assert "noise" in focused["ranks"]["0"]
    sizes = {
        d: sum(os.path.getsize(f) for f in glob.glob(os.path.join(d, "rank0", "*.safetensors")))
        for d in (ref, full_ref)
    }
    assert sizes[ref] < sizes[full_ref] / 2, sizes
    code, out, err = dumpdiff("repro", ref, dec, "--out", tmp_path / "repro", "--model", llama_dir, "--no-progress")
    assert code == 0 and f"{full['culprit']['call']} [Linear], replayed as linear" in out, err


def test_focus_on_identical_runs_says_there_is_nothing_to_focus_on(pairs):
    _, dumps = pairs
    code, out, err = dumpdiff("focus", dumps["fp"][0], dumps["fp"][0], "--no-progress")
    assert code == 1 and out == "" and "nothing to focus on" in err


def test_commands_that_need_values_refuse_fingerprint_dumps_in_one_line(pairs, tmp_path):
    _, dumps = pairs
    fp_ref, fp_dec = dumps["fp"]
    repeat = copy_dump(fp_ref, tmp_path / "repeat")
    one_line_error(
        dumpdiff("first-divergence", fp_ref, fp_dec, "--noise", repeat, "--no-progress"), "--noise", "fingerprints only"
    )
    one_line_error(dumpdiff("repro", fp_ref, fp_dec, "--out", tmp_path / "repro", "--no-progress"), "dumpdiff focus")


def test_a_damaged_print_table_or_an_unknown_print_version_is_one_line_exit_2(pairs, tmp_path):
    _, dumps = pairs
    fp_ref, fp_dec = dumps["fp"]
    short = copy_dump(fp_dec, tmp_path / "short")

    def cut_table(header):  # the table claims fewer rows than the tensors place in it
        entry = header["~rowprints"]
        start, end = entry["data_offsets"]
        entry["shape"] = [3, entry["shape"][1] // 2]
        entry["data_offsets"] = [start, start + 3 * 8 * entry["shape"][1]]
        return header

    rewrite_header(pass_path(short, 0), cut_table)
    one_line_error(dumpdiff("first-divergence", fp_ref, short, "--no-progress"), "pass-000000", "damaged")
    newer = copy_dump(fp_dec, tmp_path / "newer")
    edit_pass_meta(pass_path(newer, 1), lambda meta: meta.update(rowprint=2))
    one_line_error(dumpdiff("first-divergence", fp_ref, newer, "--no-progress"), "version 2")
    unplaced = copy_dump(fp_dec, tmp_path / "unplaced")

    def drop_a_place(meta):
        for call in meta["calls"]:
            for tmeta in call["tensors"].values():
                tmeta.pop("print", None)

    edit_pass_meta(pass_path(unplaced, 1), drop_a_place)
    one_line_error(
        dumpdiff("first-divergence", fp_ref, unplaced, "--no-progress"), "neither bytes nor row fingerprints"
    )


def test_fingerprint_dumps_of_two_ranks_are_compared_rank_by_rank(llama_dir, tmp_path):
    """Each tensor-parallel rank writes its own fingerprint files; the verdict is given per rank."""
    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path / "rank0", prompt_ids(20), new_tokens=4, **FP)
    bugged = _model(llama_dir, "bfloat16-stale-kv")  # its first bit flip is the stale key's attention
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="1", WORLD_SIZE="2")
    try:
        ref1, dec1, _ = dump_pair(bugged, tmp_path / "rank1", prompt_ids(20), new_tokens=4, **FP)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    for one, both in ((ref1, ref), (dec1, dec)):
        shutil.move(os.path.join(one, "rank1"), os.path.join(both, "rank1"))
    code, result = first_divergence_json(ref, dec)
    assert code == 1 and set(result["ranks"]) == {"0", "1"}
    assert result["ranks"]["0"]["culprit"]["module"].startswith("model.layers.0.")
    assert result["ranks"]["1"]["culprit"]["call"] == "model.layers.1.self_attn#0"


def test_a_full_dump_keeps_one_index_per_fingerprint_kind(pairs):
    """Compared with a fingerprint dump and with a full dump in turn, a full dump's two indexes
    are each built once: neither comparison rebuilds the other's."""
    _, dumps = pairs
    (full_ref, full_dec), (_, fp_dec) = dumps["full"], dumps["fp"]
    first_divergence_json(full_ref, full_dec)
    first_divergence_json(full_ref, fp_dec)
    stamps = {
        kind: os.path.join(full_ref, "index", *sub, "stamp.json")
        for kind, sub in (("xxh3", ()), ("rowprint", ("rowprint",)))
    }
    before = {kind: os.stat(path).st_mtime_ns for kind, path in stamps.items()}
    first_divergence_json(full_ref, full_dec)
    first_divergence_json(full_ref, fp_dec)
    assert {kind: os.stat(path).st_mtime_ns for kind, path in stamps.items()} == before


def test_a_fingerprint_dump_against_a_metadata_only_dump_is_one_line_exit_2(llama_dir, pairs, tmp_path):
    _, dumps = pairs
    model = load_model(llama_dir, torch.float32)
    core_ref, _, _ = dump_pair(model, tmp_path, prompt_ids(20), new_tokens=6, non_intrusive_mode="core")
    one_line_error(
        dumpdiff("first-divergence", core_ref, dumps["fp"][1], "--no-progress", "--allow-mismatch"),
        "NON_INTRUSIVE_MODE",
    )


def test_focus_says_in_one_line_when_its_env_file_cannot_be_written(pairs, tmp_path):
    _, dumps = pairs
    one_line_error(
        dumpdiff("focus", *dumps["fp"], "--no-progress", "--env-file", tmp_path / "no" / "such" / "f.env"), "--env-file"
    )


def test_row_selected_fingerprint_dumps_give_the_row_selected_full_dumps_verdict(llama_dir, tmp_path):
    """DUMPER_POSITIONS with fingerprints: the rows kept are printed as the full dump stores them."""
    model = _model(llama_dir, "bfloat16-stale-kv")
    prompt = prompt_ids(20)
    full = dump_pair(model, tmp_path / "full", prompt, new_tokens=6, positions="20:")[:2]
    fp = dump_pair(model, tmp_path / "fp", prompt, new_tokens=6, positions="20:", **FP)[:2]
    _, want = first_divergence_json(*full)
    for ref, dec in (fp, (full[0], fp[1])):
        code, got = first_divergence_json(ref, dec)
        assert code == 1 and _strict_part(got) == _strict_part(want)
    assert want["ranks"]["0"]["rows_compared"] == 5 and want["culprit"]["call"] == "model.layers.1.self_attn#0"


def test_an_moe_models_fingerprint_dump_gives_the_full_dumps_verdict(tmp_path):
    """Expert buffers hold a data-dependent subset of tokens: printed whole, not comparable row by
    row, with the same reason as in a full dump."""
    model = load_model(make_tiny_qwen3_moe(tmp_path / "moe"), torch.float32)
    prompt = prompt_ids(16)
    full = dump_pair(model, tmp_path / "full", prompt, new_tokens=5)[:2]
    fp = dump_pair(model, tmp_path / "fp", prompt, new_tokens=5, **FP)[:2]
    code, want = first_divergence_json(*full)
    got_code, got = first_divergence_json(*fp)
    assert got_code == code
    assert got["ranks"]["0"]["not_comparable"] == want["ranks"]["0"]["not_comparable"]
    assert any("experts" in n["call"] for n in got["ranks"]["0"]["not_comparable"])
    if code == 1:
        assert _strict_part(got) == _strict_part(want)


def test_focus_selects_an_op_in_every_layer_and_the_positions_that_differ():
    from dumpdiff.analyzer.report.focus import module_filter, positions_text

    pattern = re.compile(
        module_filter(["model.layers.3.mlp.experts.7.down_proj", "model.layers.3.mlp"], "model.embed_tokens")
    )
    assert all(
        pattern.search(m)
        for m in ("model.embed_tokens", "model.layers.10.mlp.experts.0.down_proj", "model.layers.0.mlp")
    )
    assert not any(
        pattern.search(m)
        for m in (
            "model.layers.1.mlp.up_proj",
            "model.layers.1.self_attn",
            "model.embed_tokens_extra",
            "xmodel.layers.1.mlp",
        )
    )
    assert positions_text([14, 12, 13, 20, 12]) == "12:15,20" and positions_text([5]) == "5"
