"""Bad input to the real CLI: one line on stderr saying what is wrong and what to do, exit 2,
no traceback, nothing on stdout. Damage that leaves whole passes behind (a torn last manifest
line, NaN/Inf, odd bytes in folder names) is not an error: the comparison goes on and says so.

Every case damages a copy of a real dump of a real tiny HF model, as a disk, a copy or a crash would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dump_surgery import (
    both_commands,
    copy_dump,
    edit_pass_meta,
    match_manifest_size,
    one_line_error,
    pass_path,
    read_manifest,
    rewrite_header,
    write_manifest,
)
from helpers import ROOT, dump_pair, dumpdiff, load_model, make_tiny_llama, prompt_ids

PROMPT = prompt_ids(12)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A real reference/decode pair (2-layer float32 Llama, 12 prompt tokens, 4 generated)."""
    root = tmp_path_factory.mktemp("dumps")
    model = load_model(make_tiny_llama(root / "model"))
    ref, dec, _ = dump_pair(model, root / "d", PROMPT, new_tokens=4, min_free_bytes=0)
    return ref, dec


# --- each case: damage (a copy of) the decode dump, return what the user passes -------------
def missing_dir(dec, tmp):
    return os.path.join(tmp, "no-such-dump")


def file_not_dir(dec, tmp):
    return os.path.join(dec, "run.json")


def empty_dir(dec, tmp):
    os.makedirs(os.path.join(tmp, "empty"))
    return os.path.join(tmp, "empty")


def not_a_dump(dec, tmp):
    os.makedirs(os.path.join(tmp, "photos"))
    open(os.path.join(tmp, "photos", "cat.jpg"), "wb").write(b"\xff\xd8\xff")
    return os.path.join(tmp, "photos")


def dumper_dir(dec, tmp):
    return os.path.dirname(dec)  # the DUMPER_DIR holding the experiment dec


def header_length_corrupt(dec, tmp):
    with open(pass_path(dec, 1), "r+b") as handle:
        handle.write(b"\xff" * 7 + b"\x7f")  # a header length of exabytes
    return dec


def header_json_corrupt(dec, tmp):
    with open(pass_path(dec, 1), "r+b") as handle:
        handle.seek(40)
        handle.write(b"}}{{")
    return dec


def truncated(dec, tmp):
    os.truncate(pass_path(dec, 2), os.path.getsize(pass_path(dec, 2)) - 100)
    return dec


def truncated_manifest_edited(dec, tmp):
    path = pass_path(dec, 2)
    os.truncate(path, os.path.getsize(path) - 100)  # cut into the tensor bytes
    match_manifest_size(path)
    return dec


def manifest_names_missing_file(dec, tmp):
    os.unlink(pass_path(dec, 1))
    return dec


def manifest_size_infinity(dec, tmp):
    entries = read_manifest(dec)
    entries[0]["bytes"] = float("inf")  # json writes Infinity, and Python's json reads it back (found by the fuzzer)
    write_manifest(dec, entries)
    return dec


def manifest_names_outside_file(dec, tmp):
    entries = read_manifest(dec)
    entries[0]["file"] = "../../ref/rank0/pass-000000.safetensors"
    write_manifest(dec, entries)
    return dec


def future_format(dec, tmp):
    run = json.load(open(os.path.join(dec, "run.json")))
    json.dump(dict(run, version=run["version"] + 1), open(os.path.join(dec, "run.json"), "w"))
    return dec


def run_json_garbage(dec, tmp):
    open(os.path.join(dec, "run.json"), "wb").write(b"\x00\x01{not json")
    return dec


def tensor_name_not_utf8(dec, tmp):
    def raw_byte_in_name(header):
        name = next(k for k in header if k != "__metadata__")
        quoted = json.dumps(name).encode()
        return json.dumps(header).encode().replace(quoted, quoted[:-1] + b'\xff"')

    rewrite_header(pass_path(dec, 1), raw_byte_in_name)
    return dec


def tensor_name_lone_surrogate(dec, tmp):
    def rename_alias(meta):  # an alias is named only in the metadata JSON, where "\udcff" is legal
        for call in meta["calls"]:
            for name, tmeta in list(call["tensors"].items()):
                if tmeta.get("alias"):
                    call["tensors"][name + "\udcff"] = call["tensors"].pop(name)
                    return

    edit_pass_meta(pass_path(dec, 1), rename_alias)
    return dec


def missing_dir_not_utf8(dec, tmp):
    return os.path.join(tmp, "gone-\udcff\udcfe")


def missing_dir_with_newline(dec, tmp):
    return os.path.join(tmp, "two\nlines")


ERRORS = [
    (missing_dir, ["no such directory", "<DUMPER_DIR>/<exp_name>"]),
    (file_not_dir, ["not a directory", "give the experiment folder"]),
    (empty_dir, ["empty directory, not a dump"]),
    (not_a_dump, ["not a dumpdiff dump (no run.json)"]),
    (dumper_dir, ["this is a DUMPER_DIR holding experiments (dec)", "give one of them, e.g. ", "/dec"]),
    (header_length_corrupt, ["pass-000001.safetensors: corrupt pass file", "re-copy or re-dump"]),
    (header_json_corrupt, ["pass-000001.safetensors: corrupt pass file"]),
    (truncated, ["pass-000002.safetensors: truncated or changed", "manifest says"]),
    (truncated_manifest_edited, ["pass-000002.safetensors: corrupt pass file", "not fully covered"]),
    (manifest_names_missing_file, ["names pass-000001.safetensors but that file is missing"]),
    (manifest_names_outside_file, ["not a pass file in this folder"]),
    (manifest_size_infinity, ["line 1 is not a manifest entry", "dump again"]),
    (future_format, ["newer than this dumpdiff reads", "upgrade dumpdiff"]),
    (run_json_garbage, ["run.json: not valid JSON"]),
    (tensor_name_not_utf8, ["pass-000001.safetensors: corrupt pass file", "invalid UTF-8"]),
    (tensor_name_lone_surrogate, ["pass-000001.safetensors: pass metadata is not valid JSON or holds invalid text"]),
    (missing_dir_not_utf8, ["gone-\\udcff\\udcfe: no such directory"]),
    (missing_dir_with_newline, ["two\\x0alines: no such directory"]),
]


@pytest.mark.parametrize("damage,needles", ERRORS, ids=[d.__name__ for d, _ in ERRORS])
def test_bad_input_is_one_line_and_exit_2(dumps, tmp_path, damage, needles):
    ref, dec = dumps
    target = damage(copy_dump(dec, tmp_path / "dec"), str(tmp_path))
    index_run, diverge_run = both_commands(ref, target)
    one_line_error(index_run, *needles)
    one_line_error(diverge_run, *needles)


def test_torn_last_manifest_line_is_a_warning_not_an_error(dumps, tmp_path):
    """A writer cut off mid-append: the torn line is ignored, whole passes are compared."""
    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    manifest = os.path.join(dec, "rank0", "manifest.jsonl")
    data = open(manifest, "rb").read()
    open(manifest, "wb").write(data[:-40])  # the last line loses its end, newline included
    (code_i, out_i, err_i), (code, out, err) = both_commands(ref, dec)
    assert code_i == 0 and "15 token rows" not in out_i and "14 token rows" in out_i, err_i
    assert "1 torn manifest line(s) ignored" in err_i
    assert code in (0, 1), err
    assert "1 torn manifest line(s) ignored" in out and "1 torn manifest line(s) ignored" in err
    # the pass the torn line named is whole on disk but uncommitted: ignored, and said so
    assert "uncommitted pass file(s) ignored" in out and "pass-000003.safetensors" in out
    assert "4 passes" not in out and "3 passes" in out


def test_nan_and_inf_are_reported_and_the_comparison_goes_on(tmp_path):
    model = load_model(make_tiny_llama(tmp_path / "model"))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, :] = float("inf")  # inf, then NaN downstream
    ref, dec, _ = dump_pair(model, tmp_path / "d", PROMPT, new_tokens=4, min_free_bytes=0)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert code in (0, 1), err
    assert "non-finite values (NaN/Inf)" in out and "model.layers.1.mlp.down_proj#0.out.0" in out
    code_j, out_j, _ = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    result = json.loads(out_j)
    assert code_j == code and result["ranks"]["0"]["nonfinite"]
    assert all(n["nonfinite_a"] > 0 and n["nonfinite_b"] > 0 for n in result["ranks"]["0"]["nonfinite"])


def test_folder_names_with_non_utf8_bytes_work(dumps, tmp_path):
    ref, dec = dumps
    odd = os.fsencode(str(tmp_path)) + b"/dec-\xff\xfe"
    copy_dump(dec, os.fsdecode(odd))
    for command in (["index", odd], ["first-divergence", os.fsencode(ref), odd]):
        # bytes in, bytes out: the index command echoes the folder name as the file system has it
        proc = subprocess.run(
            [sys.executable, "-m", "dumpdiff.analyzer.cli", *command, "--no-progress"],
            capture_output=True,
            cwd=ROOT,
            timeout=300,
        )
        assert proc.returncode in (0, 1) and b"Traceback" not in proc.stderr, proc.stderr
    assert b"B (under test): dec-\\udcff\\udcfe" in proc.stdout  # the report escapes them
    assert os.path.isdir(odd + b"/index")


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """A 3-layer model and a 2-layer model cut from it: same embedding and first two layers."""
    root = tmp_path_factory.mktemp("three")
    big = load_model(make_tiny_llama(root / "l3", num_hidden_layers=3))
    small = load_model(root / "l3")
    small.model.layers = small.model.layers[:2]
    small.config.num_hidden_layers = 2
    ref3, dec3, _ = dump_pair(big, root / "d3", PROMPT, new_tokens=4, min_free_bytes=0)
    ref2, _, _ = dump_pair(small, root / "d2", PROMPT, new_tokens=4, min_free_bytes=0)
    return ref2, dec3


def test_dumps_of_different_num_layers_are_refused_unless_allowed(three_layers):
    ref2, dec3 = three_layers
    one_line_error(
        dumpdiff("first-divergence", ref2, dec3, "--no-progress"),
        "the dumps differ in num_layers (2 vs 3)",
        "--allow-mismatch",
    )
    code, out, err = dumpdiff("first-divergence", ref2, dec3, "--no-progress", "--allow-mismatch")
    assert code in (0, 1) and "alignment proof: OK" in out, err


def test_an_error_right_after_the_indexes_open_exits_2_every_time(dumps, tmp_path):
    """A command that fails just after opening both saved indexes (here: a reference of another
    prompt, so no decode row has a partner) exits 2 every time. Threads of pyarrow that were
    still finishing a read while the interpreter exited made it die of SIGABRT ("terminate
    called without an active exception"): 1 to 4 of these 12 runs, in each of 3 tries. Saved
    tables are now parsed from memory, on dumpdiff's own threads only."""
    model = load_model(make_tiny_llama(tmp_path / "model"))
    other, _, _ = dump_pair(model, tmp_path / "d", prompt_ids(12, seed=1), new_tokens=4, min_free_bytes=0)
    assert dumpdiff("index", other, dumps[1], "--no-progress")[0] == 0  # the failing runs read saved indexes
    runs = [dumpdiff("first-divergence", other, dumps[1], "--strict-only", "--no-progress") for _ in range(12)]
    assert [code for code, _, _ in runs] == [2] * 12, [err[-300:] for code, _, err in runs if code != 2]
    one_line_error(runs[0], "same token ids from position 0")


def test_dumps_of_different_dtypes_are_refused(dumps, tmp_path):
    ref, _ = dumps
    model = load_model(make_tiny_llama(tmp_path / "model"), torch.bfloat16)
    _, dec_bf16, _ = dump_pair(model, tmp_path / "d", PROMPT, new_tokens=4, min_free_bytes=0)
    one_line_error(
        dumpdiff("first-divergence", ref, dec_bf16, "--no-progress"),
        "the dumps differ in dtype ('float32' vs 'bfloat16')",
        "--allow-mismatch",
    )


def test_damaged_index_is_one_line_and_rebuild_index_recovers(dumps, tmp_path):
    """The index is read a column at a time; a damaged rows table says so and how to recover."""
    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    code, _, err = dumpdiff("index", dec, "--no-progress")
    assert code == 0, err
    rows = os.path.join(dec, "index", "rows.parquet")
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(rows).metadata.row_group(0).column(1)  # the fingerprints, which every verdict reads
    assert chunk.path_in_schema == "fp"
    with open(rows, "r+b") as handle:  # the column data, not the footer: the damage shows when read
        handle.seek(chunk.data_page_offset)
        handle.write(b"\xff" * min(256, chunk.total_compressed_size))
    one_line_error(
        dumpdiff("first-divergence", ref, dec, "--strict-only", "--no-progress"),
        "rows.parquet: cannot be read",
        "rerun with --rebuild-index",
    )
    code, out, err = dumpdiff("first-divergence", ref, dec, "--strict-only", "--no-progress", "--rebuild-index")
    assert code in (0, 1) and "alignment proof: OK" in out, err


@pytest.mark.parametrize("table", ["tokens", "calls", "rows"])
def test_a_damaged_index_table_is_rebuilt_and_no_file_stays_open(dumps, tmp_path, table):
    """The five tables of a saved index are opened at once; when one is damaged (its footer
    zeroed) the index is rebuilt, and the tables opened beside it are closed then, not when the
    garbage collector gets to them (the rebuild renames new files over them)."""
    import gc

    from dumpdiff.analyzer.dump.load import open_dump
    from dumpdiff.analyzer.index.store import load_index

    dec = copy_dump(dumps[1], tmp_path / "dec")
    load_index(open_dump(dec), progress=False)
    path = os.path.join(dec, "index", f"{table}.parquet")
    with open(path, "r+b") as handle:
        handle.seek(-8, 2)
        handle.write(b"\0" * 8)

    def open_tables():  # open files and memory mappings (saved tables are mapped)
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        with open("/proc/self/maps") as maps:
            found += [line.split()[-1] for line in maps if line.strip()]
        return [f for f in found if ".parquet" in f and str(tmp_path) in f]

    gc.disable()
    try:
        index = load_index(open_dump(dec), progress=False)
        assert open_tables() == []  # the rebuilt index is used from memory
    finally:
        gc.enable()
    assert len(index.cols("tokens")) and len(index.cols("rows"))


@pytest.mark.parametrize(
    "where",
    [
        "beside the tables",
        "in place of the rows table",
        "in place of a table, stamp kept",
        "in place of the stamp",
        "in place of the lock file",
    ],
)
def test_a_named_pipe_in_the_index_folder_does_not_hang_the_comparison(dumps, tmp_path, where):
    """first-divergence asks the kernel to read the saved index ahead; opening a named pipe for
    that would wait for a writer forever. Beside the tables it is ignored; in place of a table
    or of the stamp, the index is rebuilt over it; in place of the lock file, the index is used
    from memory, with a warning (opening a pipe in place of a table whose stamp was kept, of the
    stamp or of the lock would hang: index files that are not regular files are damage)."""
    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    assert dumpdiff("index", dec, "--no-progress")[0] == 0
    folder = os.path.join(dec, "index")
    replaced = {
        "beside the tables": [],
        "in place of the rows table": ["stamp.json", "rows.parquet"],
        "in place of a table, stamp kept": ["tokens.parquet"],
        "in place of the stamp": ["stamp.json"],
        "in place of the lock file": [".lock"],
    }[where]
    for name in replaced:
        os.unlink(os.path.join(folder, name))
    for name in replaced[-1:] or ["notes"]:
        os.mkfifo(os.path.join(folder, name))
    code, out, err = dumpdiff("first-divergence", ref, dec, "--strict-only", "--no-progress", timeout=60)
    assert code in (0, 1) and "alignment proof: OK" in out, err
    assert ("lock is not a regular file" in err) == (where == "in place of the lock file"), err


def test_a_table_footer_pyarrow_cannot_read_is_rebuilt(dumps, tmp_path):
    """Some damaged footers make pyarrow raise ArrowNotImplementedError, neither an OSError nor
    a ValueError: that table, too, is damaged, and the index is rebuilt."""
    import io
    import random
    import struct

    import pyarrow as pa
    import pyarrow.parquet as pq

    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    assert dumpdiff("index", dec, "--no-progress")[0] == 0
    path = os.path.join(dec, "index", "tokens.parquet")
    data = open(path, "rb").read()
    footer = len(data) - 8 - struct.unpack("<I", data[-8:-4])[0]
    rng = random.Random(1)
    for _ in range(20000):  # byte edits of the footer until pyarrow says "not implemented"
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(footer, len(data) - 8)] = rng.randrange(256)
        try:
            pq.ParquetFile(io.BytesIO(bytes(damaged)))
        except pa.ArrowNotImplementedError:
            break
        except Exception:  # noqa: BLE001 - other damage: try another edit
            continue
    else:
        pytest.skip("no footer edit made pyarrow raise ArrowNotImplementedError")
    with open(path, "wb") as handle:
        handle.write(bytes(damaged))
    code, out, err = dumpdiff("first-divergence", ref, dec, "--strict-only", "--no-progress")
    assert code in (0, 1) and "alignment proof: OK" in out, err


@pytest.mark.parametrize("every", [False, True], ids=["one decode step", "every decode step"])
def test_a_tensor_given_other_token_dims_is_compared_without_crashing(dumps, tmp_path, every):
    """A hand-edited or damaged metadata gives the culprit's output other token dims, so its rows
    have another shape in some passes (found by the fuzzer: error figures joined rows of two
    shapes). The verdict still names the call; the error figures come from the rows held alike,
    or, where none is, say so instead of a number. Every report format renders it."""
    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")

    def edit(meta):
        call = next(c for c in meta["calls"] if c["call"] == "model.layers.0.self_attn.q_proj#0")
        call["tensors"]["model.layers.0.self_attn.q_proj#0.out.0"]["token_dims"] = [0]  # rows of [1, 64]

    decode_steps = [entry["pass"] for entry in read_manifest(dec)][1:]
    for pass_id in decode_steps if every else decode_steps[:1]:
        edit_pass_meta(pass_path(dec, pass_id), edit)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    assert code == 1 and "Traceback" not in err, err
    culprit = json.loads(out)["ranks"]["0"]["culprit"]
    assert culprit["call"] == "model.layers.0.self_attn.q_proj#0"
    if not every:  # figures from the steps left alike, saying so
        assert culprit["max_abs"] > 0 and "held in other shapes" in culprit["error_note"]
    else:
        assert culprit["max_abs"] is None and "other shapes" in culprit["error_note"]
    for fmt in ("text", "md", "html"):
        code_f, out_f, err_f = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", fmt)
        assert code_f == 1 and "q_proj" in out_f and "Traceback" not in err_f, err_f


@pytest.mark.parametrize("where", ["past the end", "near 2**63"])
def test_an_index_placing_rows_outside_their_files_is_refused(dumps, tmp_path, where):
    """A damaged (or hand-made) index whose row offsets point past the end of a pass file, even
    by so much that offset + width wraps around in int64, is refused in one line that says to
    rebuild the index: exit 2, no traceback, for the strict and the default verdict."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    assert dumpdiff("index", dec, "--no-progress")[0] == 0
    path = os.path.join(dec, "index", "rows.parquet")
    table = pq.read_table(path)
    offsets = table.column("offset").to_numpy().copy()
    placed = offsets >= 0
    offsets[placed] = offsets[placed] + 10**7 if where == "past the end" else 2**63 - 8
    pq.write_table(
        table.set_column(table.schema.get_field_index("offset"), "offset", pa.array(offsets, pa.int64())), path
    )
    for extra in (["--strict-only"], []):
        one_line_error(
            dumpdiff("first-divergence", ref, dec, "--no-progress", *extra), "past the end", "dumpdiff index --rebuild"
        )


def test_an_index_of_an_older_version_is_rebuilt_with_the_same_verdict(dumps, tmp_path):
    """An index saved by an earlier dumpdiff (here: version 5, whose rows table had no offset
    column) is not read as if it were current: the next command rebuilds it, saves the current
    version, and gives the verdict a fresh index gives."""
    import pyarrow.parquet as pq

    from dumpdiff.analyzer.index.store import INDEX_VERSION

    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    code, fresh = first_divergence_of(ref, dec)
    folder = os.path.join(dec, "index")
    rows = os.path.join(folder, "rows.parquet")
    pq.write_table(pq.read_table(rows).drop(["offset"]), rows)
    with open(os.path.join(folder, "stamp.json")) as handle:
        stamp = json.load(handle)
    stamp["index_version"] = 5
    with open(os.path.join(folder, "stamp.json"), "w") as handle:
        json.dump(stamp, handle)
    assert first_divergence_of(ref, dec) == (code, fresh)
    with open(os.path.join(folder, "stamp.json")) as handle:
        assert json.load(handle)["index_version"] == INDEX_VERSION
    assert "offset" in pq.read_table(rows).column_names


def first_divergence_of(ref, dec):
    """(exit code, the verdict JSON without bytes read)."""
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    assert code in (0, 1), err
    verdict = json.loads(out)
    for rank in verdict["ranks"].values():
        rank.get("noise", {}).pop("bytes_read", None)
    return code, verdict


# --- the JSON and JSONL files the KL commands read ------------------------------------------
NO_SERVER = "http://127.0.0.1:9"  # nothing listens: each error below must come before any connection


def test_a_kl_result_that_is_not_a_kl_checks_json_is_one_line(tmp_path):
    """A JSONL prompts file given as --kl-result was "internal error JSONDecodeError: Extra data"."""
    expected = "give the file `dumpdiff kl --format json -o FILE` wrote"
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("[1, 2, 3]\n[4, 5, 6]\n")
    one_line_error(
        dumpdiff("localize", "--url", NO_SERVER, "--kl-result", jsonl, timeout=60),
        f"--kl-result {jsonl}: not one JSON document (Extra data",
        expected,
    )
    binary = tmp_path / "kl.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    one_line_error(dumpdiff("localize", "--url", NO_SERVER, "--kl-result", binary, timeout=60), "not one JSON document")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"kind": "dumpdiff-kl-calibration", "proposal": {}}))
    one_line_error(
        dumpdiff("localize", "--url", NO_SERVER, "--kl-result", calibration, timeout=60),
        "not the JSON of a KL check (it is dumpdiff-kl-calibration)",
        expected,
    )
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"kind": "dumpdiff-kl", "verdict": {}}))
    one_line_error(
        dumpdiff("localize", "--url", NO_SERVER, "--kl-result", bare, timeout=60),
        "without its verdict, helpers or settings",
    )


@pytest.mark.parametrize("command", ["kl", "localize", "kl calibrate"])
def test_a_thresholds_file_that_is_not_one_json_document_is_said_before_the_server(tmp_path, command):
    """It was read only after the server answered (after every calibration run, for calibrate)."""
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "dumpdiff-kl-thresholds", "entries": {}}\n{"again": 1}\n')
    one_line_error(
        dumpdiff(*command.split(), "--url", NO_SERVER, "--thresholds", bad, timeout=60),
        f"{bad}: not one JSON document (Extra data",
        "dumpdiff kl calibrate",
    )
    bad.write_text(json.dumps({"format": "dumpdiff-kl-thresholds", "entries": {"m tp=x": {"kl_div": 1e-3, "tp": "x"}}}))
    one_line_error(
        dumpdiff(*command.split(), "--url", NO_SERVER, "--thresholds", bad, timeout=60),
        "entry 'm tp=x' needs a whole number tp",
    )


@pytest.mark.parametrize("command", ["kl", "localize", "kl calibrate"])
def test_a_prompts_file_that_is_not_jsonl_is_said_before_the_server(tmp_path, command):
    binary = tmp_path / "p.jsonl"
    binary.write_bytes(b"[1, 2]\n\xff\xfe\n")
    one_line_error(
        dumpdiff(*command.split(), "--url", NO_SERVER, "--prompts", binary, timeout=60),
        f"{binary}: not UTF-8 text",
        "one prompt per line",
    )
    pretty = tmp_path / "p.json"
    pretty.write_text(json.dumps([[1, 2, 3], [4, 5]], indent=2))
    one_line_error(
        dumpdiff(*command.split(), "--url", NO_SERVER, "--prompts", pretty, timeout=60),
        f"{pretty}:1: not JSON",
        "one prompt per line",
    )


def test_a_negative_token_position_is_a_damaged_file(dumps, tmp_path):
    """A position below 0 on a real token row (a flipped sign bit; found by the fuzzer) crashed the
    alignment with an IndexError: it indexed the sequence's tokens from the end. It is a damaged
    pass, named in one line, exit 2."""
    ref, dec = dumps
    dec = copy_dump(dec, tmp_path / "dec")
    edit_pass_meta(pass_path(dec, 0), lambda meta: meta["tokens"]["pos"].__setitem__(0, -7))
    for args in (("first-divergence", ref, dec), ("index", dec)):
        code, out, err = dumpdiff(*args, "--no-progress")
        assert code == 2 and err.count("\n") == 1 and "tokens.pos" in err and "Traceback" not in err, (args, err)
