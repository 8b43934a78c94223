"""Faults a dump must survive, each made real: kill -9 mid-write, a script that never calls
remove(), a disk that fills up (a real tmpfs), a manifest append the kernel cuts short, two
processes on one folder, two analyzers on one index, paths that try to leave DUMPER_DIR.

The promise each test checks: whole passes or none, a manifest that always reads, one loud log
line when dumping stops, a model that keeps computing the right thing, and an analyzer that works
on what was committed and says what is missing.
(The sglang-server variant of the kill test belongs with the sglang tests: same checks, the
server process killed instead of this HF script.)
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dump_surgery import one_line_error, read_manifest
from dumpdiff import dumper
from dumpdiff.analyzer.dump.load import PassFile, open_dump
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.config import ConfigError
from helpers import ROOT, dumpdiff, load_model, make_tiny_llama, prompt_ids

TESTS = os.path.dirname(os.path.abspath(__file__))

# A dumping process: the real dumper on a real HF model, configured by DUMPER_* alone.
CHILD = textwrap.dedent("""
    import json, os, resource, sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import load_model, prompt_ids
    from dumpdiff import dumper
    model_dir, prompt_len, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = load_model(model_dir)
    handle = dumper.install(model)
    if os.environ.get("CHILD_FSIZE"):  # the kernel refuses to grow any file past this size
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["CHILD_FSIZE"]),) * 2)
    with torch.no_grad():
        if os.environ.get("CHILD_FORWARDS"):  # many big passes, as fast as the model runs
            for i in range(new):
                model(prompt_ids(prompt_len, seed=i))
            writer = handle._writer
            print(json.dumps({{"submitted": handle.passes_dumped,
                              "queued_at_exit": handle.passes_dumped - writer.passes_written}}), flush=True)
            os._exit(0) if os.environ.get("CHILD_HARD_EXIT") else sys.exit(0)  # no remove()
        out = model.generate(prompt_ids(prompt_len), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    handle.flush()  # the writer is a background thread: let it reach the limit before asking
    print(json.dumps({{"ids": out[0].tolist(), "stopped": handle.state()["stopped"]}}), flush=True)
    handle.remove()
""").format(tests=TESTS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


@pytest.fixture(scope="module")
def child_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("child") / "child.py"
    path.write_text(CHILD)
    return str(path)


def start_child(child_script, model_dir, root, exp, prompt_len=24, new=60, **extra_env):
    env = dict(
        os.environ,
        DUMPER_ENABLE="1",
        DUMPER_DIR=str(root),
        DUMPER_EXP_NAME=exp,
        DUMPER_MIN_FREE_BYTES="0",
        PYTHONDONTWRITEBYTECODE="1",
        **extra_env,
    )
    return subprocess.Popen(
        [sys.executable, child_script, str(model_dir), str(prompt_len), str(new)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def expected_ids(model_dir, prompt_len=24, new=60):
    model = load_model(model_dir)
    with torch.no_grad():
        return model.generate(prompt_ids(prompt_len), max_new_tokens=new, min_new_tokens=new, do_sample=False)


def committed(rank_dir) -> int:
    try:
        with open(os.path.join(rank_dir, fmt.MANIFEST_FILE), "rb") as handle:
            return handle.read().count(b"\n")
    except FileNotFoundError:
        return 0


def tmp_files(rank_dir):
    """Pass files being written: ours (".pass-N.safetensors.tmp") and safetensors' own (".tmpXXXXXX")."""
    try:
        return sorted(n for n in os.listdir(rank_dir) if n.endswith(".tmp") or n.startswith(".tmp"))
    except FileNotFoundError:
        return []


def stop(proc):
    """SIGSTOP, and wait until the kernel says every thread is stopped."""
    os.kill(proc.pid, signal.SIGSTOP)
    while open(f"/proc/{proc.pid}/stat").read().split(")")[-1].split()[0] not in "Tt":
        time.sleep(0.001)


def assert_whole(dump) -> int:
    """Every committed pass opens and every tensor reads; no file but committed ones remains."""
    total = 0
    for rank in open_dump(str(dump)).ranks.values():
        for ref in rank.passes:
            pf = PassFile(ref)
            for name in pf.names:
                pf.tensor(name)
            total += 1
    return total


def rank_files(rank_dir):
    return sorted(n for n in os.listdir(rank_dir) if n != ".lock")


def assert_manifest_consistent(rank_dir):
    """Manifest lines are whole, name exactly the pass files present, with their sizes."""
    raw = open(os.path.join(rank_dir, fmt.MANIFEST_FILE), "rb").read()
    assert raw == b"" or raw.endswith(b"\n")
    entries = [json.loads(line) for line in raw.splitlines()]
    assert [e["pass"] for e in entries] == list(range(len(entries)))
    for entry in entries:
        assert os.path.getsize(os.path.join(rank_dir, entry["file"])) == entry["bytes"]
    assert rank_files(rank_dir) == sorted([fmt.MANIFEST_FILE] + [e["file"] for e in entries])
    return entries


# --- 1. crash safety -------------------------------------------------------------------------
def kill_mid_write(proc, rank_dir, min_committed=2, timeout=120):
    """SIGKILL the dumping process while it writes a pass file, after >= min_committed passes.
    SIGSTOP first freezes all its threads, so we know the kill lands mid-write (a .tmp exists)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the dumping process ended before it could be killed: " + proc.stderr.read()[-2000:]
        if committed(rank_dir) >= min_committed and tmp_files(rank_dir):
            stop(proc)
            if tmp_files(rank_dir):
                proc.kill()
                proc.wait()
                return tmp_files(rank_dir)
            os.kill(proc.pid, signal.SIGCONT)  # the file was renamed just now; catch the next one
        time.sleep(0.001)
    raise AssertionError("never caught the writer mid-write")


def test_kill_9_mid_write_leaves_whole_passes_and_the_analyzer_says_what_is_missing(model_dir, child_script, tmp_path):
    rank_dir = tmp_path / "dec" / "rank0"
    proc = start_child(child_script, model_dir, tmp_path, "dec")
    leftover = kill_mid_write(proc, rank_dir)
    assert proc.returncode == -signal.SIGKILL and len(leftover) == 1
    entries = read_manifest(tmp_path / "dec")
    n = len(entries)
    assert n >= 2 and assert_whole(tmp_path / "dec") == n  # every pass in the manifest loads
    assert leftover[0] in (f".pass-{n:06d}.safetensors.tmp",) or leftover[0].startswith(".tmp")  # pass n, mid-write

    code, out, err = dumpdiff("index", tmp_path / "dec", "--no-progress")
    assert code == 0, err
    rows = 24 + (n - 1)  # the prefill's 24 rows and one row per committed decode pass
    assert f"{rows} token rows" in out
    assert f"1 uncommitted pass file(s) ignored (a writer killed mid-write, or one still writing): {leftover[0]}" in err
    assert f"never closed the dump (killed, crashed or still running); passes after pass {n - 1} may be missing" in err

    # the reference: one prefill of prompt + everything the run would have generated
    full = expected_ids(model_dir)
    handle = dumper.install(
        load_model(model_dir), dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name="ref", min_free_bytes=0)
    )
    with torch.no_grad():
        handle.model(full)
    handle.remove()
    code, out, err = dumpdiff(
        "first-divergence", tmp_path / "ref", tmp_path / "dec", "--no-progress", "--format", "json"
    )
    assert code in (0, 1), err
    result = json.loads(out)
    align = result["ranks"]["0"]["alignment"]
    assert align["rows_b"] == rows and align["unaligned_b"] == 0  # all committed rows compared
    assert any("never closed" in w for w in result["warnings"]) and any(leftover[0] in w for w in result["warnings"])
    assert result["b"]["passes"] == n


def test_a_new_writer_after_a_kill_cleans_up_and_continues(model_dir, child_script, tmp_path):
    """Dumping again into the folder of a killed run: the killed run's .tmp is removed, a torn
    last manifest line (as a power cut leaves one) is cut, numbering continues, nothing is lost."""
    rank_dir = tmp_path / "dec" / "rank0"
    proc = start_child(child_script, model_dir, tmp_path, "dec")
    kill_mid_write(proc, rank_dir)
    before = read_manifest(tmp_path / "dec")
    manifest = rank_dir / fmt.MANIFEST_FILE
    manifest.write_bytes(manifest.read_bytes() + b'{"pass": 99, "file": "pass-0000')  # torn, no newline
    result, err = finish(start_child(child_script, model_dir, tmp_path, "dec", prompt_len=8, new=3))
    assert "cut a torn last line" in err and result["stopped"] is None
    entries = assert_manifest_consistent(rank_dir)  # no .tmp, no orphan, whole lines only
    assert entries[: len(before)] == before and len(entries) == len(before) + 3
    assert assert_whole(tmp_path / "dec") == len(entries)
    code, out, err = dumpdiff("index", tmp_path / "dec", "--no-progress")
    # nothing torn, nothing orphaned, the last writer closed; the two runs' passes are said to be two runs'
    assert code == 0 and err.count("\n") == 1 and "passes from 2 writer sessions" in err, err


def test_a_script_that_never_calls_remove_loses_nothing(model_dir, child_script, tmp_path):
    """The writer thread is a daemon; at interpreter exit it must still finish the queue."""
    result, _ = finish(start_child(child_script, model_dir, tmp_path, "x", prompt_len=200, new=12, CHILD_FORWARDS="1"))
    entries = assert_manifest_consistent(tmp_path / "x" / "rank0")
    assert len(entries) == result["submitted"] == 12, result  # queued_at_exit: how many the exit handler saved
    assert (tmp_path / "x" / "rank0" / ".lock").read_text() == "closed\n"


def test_os_exit_is_a_crash_and_is_reported(model_dir, child_script, tmp_path):
    """os._exit skips every exit handler, like a kill: the analyzer must say passes may be missing."""
    proc = start_child(
        child_script, model_dir, tmp_path, "x", prompt_len=200, new=12, CHILD_FORWARDS="1", CHILD_HARD_EXIT="1"
    )
    proc.communicate(timeout=300)
    n = len(read_manifest(tmp_path / "x"))
    assert assert_whole(tmp_path / "x") == n  # every committed pass whole (the queued ones are lost)
    code, out, err = dumpdiff("index", tmp_path / "x", "--no-progress")
    assert code == 0 and "never closed the dump" in err and f"passes after pass {n - 1} may be missing" in err, err


# --- 2. disk guard ----------------------------------------------------------------------------
def dump_generate(model, root, new, caplog, **config):
    """generate with dumping on; returns (output ids, dumper state) and the dumper's log records."""
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="dec", **config))
    with caplog.at_level(logging.INFO, logger="dumper"), torch.no_grad():
        out = model.generate(prompt_ids(24), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        logits = model(out).logits  # a forward pass after the stop still computes the right thing
    handle.flush()  # the stop happens on the writer thread: wait for it before reading the state
    state = handle.state()
    handle.remove()
    return out, logits, state


def assert_stopped_cleanly(model, root, out, logits, state, caplog, reason):
    with torch.no_grad():
        clean = model.generate(
            prompt_ids(24), max_new_tokens=out.shape[1] - 24, min_new_tokens=out.shape[1] - 24, do_sample=False
        )
        assert torch.equal(out, clean) and torch.equal(logits, model(clean).logits)  # the model kept running, right
    assert reason in state["stopped"]
    stops = [r for r in caplog.records if "DUMPING STOPPED" in r.getMessage()]
    assert len(stops) == 1 and stops[0].levelno == logging.ERROR and reason in stops[0].getMessage()
    exp = root / "dec"
    entries = assert_manifest_consistent(exp / "rank0")  # no partial pass file, manifest whole
    assert 0 < len(entries) < out.shape[1] - 24 and assert_whole(exp) == len(entries)
    assert reason in (exp / fmt.INCOMPLETE_FILE).read_text()
    code, _, err = dumpdiff("index", exp, "--no-progress")
    assert code == 0 and "dump marked INCOMPLETE" in err and reason in err, err
    return entries


def test_max_bytes_stops_dumping_and_the_model_keeps_running(model_dir, tmp_path, caplog):
    model = load_model(model_dir)
    limit = 300_000  # the prefill pass and a few decode passes
    out, logits, state = dump_generate(model, tmp_path, 20, caplog, max_bytes=limit, min_free_bytes=0)
    entries = assert_stopped_cleanly(model, tmp_path, out, logits, state, caplog, f"DUMPER_MAX_BYTES={limit} reached")
    assert sum(e["bytes"] for e in entries) <= limit  # a limit on real file sizes, headers included


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB file system: a tmpfs, else an ext4 image on a loop device, else skip."""
    mount = tmp_path / "disk"
    mount.mkdir()
    tried = []
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        tried.append(f"tmpfs: {proc.stderr.strip()}")
        image = tmp_path / "disk.img"
        proc = subprocess.run(
            f"truncate -s 2M {image} && mkfs.ext4 -q -F {image} && mount -o loop {image} {mount}",
            shell=True,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tried.append(f"loop device: {proc.stderr.strip()}")
            pytest.skip("cannot mount a small file system to fill (" + "; ".join(tried) + ")")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_free_space_floor_stops_dumping_on_a_real_small_disk(model_dir, small_disk, caplog):
    model = load_model(model_dir)
    floor = 1 << 20
    out, logits, state = dump_generate(model, small_disk, 60, caplog, min_free_bytes=floor)
    assert shutil.disk_usage(small_disk).free >= floor  # the floor held (before the analyzer adds its index)
    assert_stopped_cleanly(model, small_disk, out, logits, state, caplog, f"DUMPER_MIN_FREE_BYTES={floor}")


def test_disk_full_mid_write_leaves_no_partial_pass(model_dir, small_disk, caplog):
    """No floor: the disk really fills and a pass file write fails with ENOSPC."""
    model = load_model(model_dir)
    out, logits, state = dump_generate(model, small_disk, 80, caplog, min_free_bytes=0)
    assert_stopped_cleanly(model, small_disk, out, logits, state, caplog, "No space left on device")


def test_index_on_a_full_disk_is_used_from_memory(model_dir, small_disk, tmp_path):
    """Dumps analysed where the disk is full (the index cannot be saved): every run warns, builds the
    index in memory and answers. Run a few times: writing the index files from several threads
    once crashed pyarrow (SIGSEGV) on a full disk, one run in three."""
    from helpers import dump_pair

    _, dec, _ = dump_pair(load_model(model_dir), tmp_path / "d", prompt_ids(8), new_tokens=3, min_free_bytes=0)
    shutil.copytree(dec, small_disk / "dec", ignore=shutil.ignore_patterns("index"))
    with open(small_disk / "fill", "wb") as handle:  # the rest of the disk
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    for _ in range(5):
        code, out, err = dumpdiff("index", small_disk / "dec", "--no-progress")
        assert code == 0 and "could not save the index" in err and "tensor rows" in out, (code, err)


def test_manifest_append_cut_short_is_undone(model_dir, child_script, tmp_path):
    """The kernel refuses to grow the manifest past RLIMIT_FSIZE mid-line (a short write, then
    an error), as a full disk does: the line is truncated away and its pass file removed."""
    result, err = finish(
        start_child(
            child_script,
            model_dir,
            tmp_path,
            "m",
            prompt_len=12,
            new=60,
            DUMPER_NON_INTRUSIVE_MODE="core",
            CHILD_FSIZE="4000",
        )
    )
    assert "File too large" in result["stopped"] and err.count("DUMPING STOPPED") == 1
    assert result["ids"] == expected_ids(model_dir, 12, 60)[0].tolist()  # the model kept running, right
    entries = assert_manifest_consistent(tmp_path / "m" / "rank0")
    assert 10 < len(entries) < 60 and assert_whole(tmp_path / "m") == len(entries)
    assert os.path.getsize(tmp_path / "m" / "rank0" / fmt.MANIFEST_FILE) < 4000
    assert "File too large" in (tmp_path / "m" / fmt.INCOMPLETE_FILE).read_text()


# --- 4. security --------------------------------------------------------------------------------
UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def test_nothing_unpickles():
    """No torch.load without weights_only=True, no pickle-family import, no allow_pickle=True."""
    found = []
    for package in ("dumper", "analyzer"):
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in (n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', '?')}"
                    if isinstance(node, ast.Import):
                        found += [where for a in node.names if a.name.split(".")[0] in UNPICKLERS]
                    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLERS:
                        found.append(where)
                    elif isinstance(node, ast.Call):
                        func = ast.unparse(node.func)
                        kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
                        if func.endswith("torch.load") and kwargs.get("weights_only") != "True":
                            found.append(where)
                        if (
                            func.endswith(("read_pickle", "pickle.load", "pickle.loads"))
                            or kwargs.get("allow_pickle") == "True"
                        ):
                            found.append(where)
    assert found == []


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/b", "..", ".", "a\\b", "x" * 200, "a\nb", ""])
def test_exp_names_that_leave_dumper_dir_are_refused(model_dir, tmp_path, bad):
    root = tmp_path / "outside" / "dumps"
    root.mkdir(parents=True)
    model = load_model(model_dir)
    before = sorted(p for p in (tmp_path).rglob("*"))
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="good", min_free_bytes=0))
    with pytest.raises(ConfigError) as err:
        handle.configure(exp_name=bad)
    message = str(err.value)
    assert "\n" not in message and "is not valid" in message and "no '/'" in message
    with pytest.raises(ConfigError):
        dumper.DumperConfig(dir=str(root), exp_name=bad or "/")
    with torch.no_grad():
        model(prompt_ids(6))  # still dumping, into the experiment it had
    handle.remove()
    after = sorted(p for p in tmp_path.rglob("*"))
    assert [p for p in after if p not in before and root not in p.parents] == []  # nothing outside DUMPER_DIR
    assert os.listdir(root) == ["good"] and assert_whole(root / "good") == 1


# --- 5. concurrency -----------------------------------------------------------------------------
def test_two_processes_two_experiments_one_dumper_dir(model_dir, child_script, tmp_path):
    procs = [start_child(child_script, model_dir, tmp_path, exp, new=10) for exp in ("a", "b")]
    results = [finish(p) for p in procs]
    assert results[0][0]["ids"] == results[1][0]["ids"]
    for exp in ("a", "b"):
        entries = assert_manifest_consistent(tmp_path / exp / "rank0")
        assert len(entries) == 10 and assert_whole(tmp_path / exp) == 10
    code, out, err = dumpdiff("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress")
    assert code == 0 and "NO DIVERGENCE" in out and err == "", err  # the same run twice: bit-identical


def test_second_writer_of_the_same_experiment_leaves_the_first_alone(model_dir, child_script, tmp_path):
    rank_dir = tmp_path / "x" / "rank0"
    first = start_child(child_script, model_dir, tmp_path, "x", new=30)
    while committed(rank_dir) < 2:
        assert first.poll() is None, first.stderr.read()[-2000:]
        time.sleep(0.01)
    stop(first)  # it holds the folder's lock; freeze it there
    try:
        snapshot = {n: (rank_dir.parent / n).read_bytes() for n in ("run.json",)}
        snapshot.update({n: (rank_dir / n).read_bytes() for n in os.listdir(rank_dir) if not n.startswith(".")})
        result, err = finish(start_child(child_script, model_dir, tmp_path, "x", prompt_len=8, new=5))
        assert result["ids"] == expected_ids(model_dir, 8, 5)[0].tolist()  # the second model ran, correctly
        stops = [line for line in err.splitlines() if "DUMPING STOPPED" in line]
        assert len(stops) == 1 and f"another process (writing pid={first.pid}) is writing" in stops[0]
        assert "give this run its own DUMPER_EXP_NAME" in stops[0]
        # nothing of the first changed: no INCOMPLETE mark, same run.json, same passes
        assert not (rank_dir.parent / fmt.INCOMPLETE_FILE).exists()
        assert {n: (rank_dir.parent / n).read_bytes() for n in ("run.json",)} == {"run.json": snapshot["run.json"]}
        for name, data in snapshot.items():
            if name != "run.json":
                assert (rank_dir / name).read_bytes() == data, name
    finally:
        os.kill(first.pid, signal.SIGCONT)
    finish(first)
    entries = assert_manifest_consistent(rank_dir)
    assert len(entries) == 30 and assert_whole(tmp_path / "x") == 30
    code, out, err = dumpdiff("index", tmp_path / "x", "--no-progress")
    assert code == 0 and err == "", err


def test_second_writer_with_cleanup_previous_leaves_the_first_alone(model_dir, child_script, tmp_path):
    rank_dir = tmp_path / "x" / "rank0"
    first = start_child(child_script, model_dir, tmp_path, "x", new=30)
    while committed(rank_dir) < 2:
        assert first.poll() is None, first.stderr.read()[-2000:]
        time.sleep(0.01)
    stop(first)
    try:
        finish(start_child(child_script, model_dir, tmp_path, "x", prompt_len=8, new=5, DUMPER_CLEANUP_PREVIOUS="1"))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    finish(first)
    assert len(assert_manifest_consistent(rank_dir)) == 30


def test_two_analyzers_on_the_same_dumps_at_once(model_dir, child_script, tmp_path):
    for exp in ("a", "b"):
        finish(start_child(child_script, model_dir, tmp_path, exp, new=8))
    # --rebuild-index makes every run rewrite both indexes while the others read them; the runs
    # given the dumps the other way round take the two index locks too (in one order: no deadlock)
    runs = [("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress", "--format", "json")] * 2
    runs += [
        ("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress", "--format", "json", "--rebuild-index")
    ] * 3
    runs += [
        ("first-divergence", tmp_path / "b", tmp_path / "a", "--no-progress", "--format", "json", "--rebuild-index")
    ] * 2
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda args: dumpdiff(*args, process=True), runs))
    assert all(code == 0 and err == "" for code, _, err in results), [r[2] for r in results]
    for way in ("ab", "ba"):
        reports = {
            json.dumps(json.loads(out), sort_keys=True)
            for args, (_, out, _) in zip(runs, results)
            if str(args[1]).endswith(way[0])
        }
        assert len(reports) == 1  # every run saw the same whole index
    assert sorted(os.listdir(tmp_path / "a" / "index")) == [
        ".lock",
        "calls.parquet",
        "rows.parquet",
        "seqs.parquet",
        "stamp.json",
        "tensors.parquet",
        "tokens.parquet",
    ]


def test_one_dump_named_two_ways_and_two_commands_in_other_orders_never_deadlock(model_dir, tmp_path):
    """Index folders are locked by identity, not by name: one dump given twice (relative and
    absolute, or through a link) is locked and built once, and two commands naming a pair with
    other spellings and orders take the locks in the same order (a third process holding one
    lock for a moment makes them wait on each other)."""
    from helpers import dump_pair

    ref, dec, _ = dump_pair(load_model(model_dir), tmp_path / "d", prompt_ids(8), new_tokens=3, min_free_bytes=0)
    os.symlink(dec, tmp_path / "link")
    relative = lambda path: os.path.relpath(path, ROOT)  # noqa: E731 - dumpdiff runs in ROOT
    code, out, err = dumpdiff("index", dec, relative(dec), tmp_path / "link", "--no-progress", timeout=60, process=True)
    assert code == 0 and out.count("tensor rows") == 3, err
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(2)",
            os.path.join(dec, "index", ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    runs = [
        ("index", dec, relative(ref), "--no-progress", "--rebuild"),
        ("index", relative(dec), ref, "--no-progress", "--rebuild"),
        ("index", ref, tmp_path / "link", "--no-progress", "--rebuild"),
    ]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda args: dumpdiff(*args, timeout=60, process=True), runs))
    holder.wait()
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]


def test_a_redump_into_the_same_folder_never_reuses_a_stale_index(tmp_path):
    """DUMPER_CLEANUP_PREVIOUS rewrites pass files with the same ids and sizes; the index must notice."""
    prompt = prompt_ids(12)

    def dump(model_path, exp):
        handle = dumper.install(
            load_model(model_path),
            dumper.DumperConfig(dir=str(tmp_path), enable=True, exp_name=exp, cleanup_previous=True, min_free_bytes=0),
        )
        with torch.no_grad():
            handle.model(prompt)
        handle.remove()

    same, other = make_tiny_llama(tmp_path / "m0", seed=0), make_tiny_llama(tmp_path / "m1", seed=1)
    dump(same, "a")
    dump(same, "b")
    code, out, err = dumpdiff("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress")
    assert code == 0, err
    sizes = [e["bytes"] for e in read_manifest(tmp_path / "b")]
    dump(other, "b")  # other weights, same shapes
    assert [e["bytes"] for e in read_manifest(tmp_path / "b")] == sizes
    one_line_error(
        dumpdiff("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress"),
        "alignment proof failed: embedding output (model.embed_tokens) differs",
    )
