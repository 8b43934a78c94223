"""Fuzz the loaders with damaged copies of a real dump: random bytes in pass files, manifest and
run.json, and random values put into their JSON. The analyzer's entry point
(``dumpdiff.analyzer.verdict.diverge.first_divergence``, what the CLI runs) must either give a result or raise
``DumpError`` (the CLI's one-line exit 2); any other exception is a crash.

The test prints how many inputs it tried and how many crashes it found (docs/reliability.md
gives those figures).
Budget: about 45 s of fuzzing; set DUMPDIFF_FUZZ_SECONDS to fuzz longer.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import time
import traceback
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dump_surgery import match_manifest_size
from dumpdiff.analyzer.errors import DumpError
from dumpdiff.analyzer.verdict.diverge import first_divergence
from helpers import dump_pair, load_model, make_tiny_llama, prompt_ids

pytestmark = pytest.mark.slow  # minutes of CPU: left out of make test-fast

SECONDS = float(os.environ.get("DUMPDIFF_FUZZ_SECONDS", "45"))
TARGETS = ("rank0/pass-000000.safetensors", "rank0/pass-000001.safetensors", "rank0/manifest.jsonl", "run.json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = load_model(make_tiny_llama(root / "model"))
    ref, dec, _ = dump_pair(model, root / "d", prompt_ids(8), new_tokens=3, min_free_bytes=0)
    first_divergence(ref, dec, progress=False)  # both indexed once; the reference index is reused
    return ref, dec


def header_span(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


def json_paths(value, path=()):
    """Every place in a JSON document where a value can be swapped."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from json_paths(child, path + (key,))


def swap(document, path, new):
    if not path:
        return new
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return document


def mutate_json(data, text: bytes, into, jsonl: bool = False) -> bytes:
    """Put a random JSON value somewhere in a JSON text (in one line of a JSON-lines text)."""
    lines = text.split(b"\n") if jsonl else [text]
    line_no = data.draw(st.integers(0, max(0, len(lines) - 2)), label="line") if jsonl else 0
    document = json.loads(lines[line_no])
    paths = list(json_paths(document))
    path = paths[data.draw(st.integers(0, len(paths) - 1), label="path")]
    lines[line_no] = json.dumps(swap(document, path, data.draw(json_values, label="value"))).encode()
    into.append(f"json {'/'.join(map(str, path))}")
    return b"\n".join(lines)


def mutate(data, path: str, into: list):
    raw = open(path, "rb").read()
    is_pass = path.endswith(".safetensors")
    kind = data.draw(st.sampled_from(["bytes", "truncate", "insert", "json"]), label="kind")
    into.append(kind)
    if kind == "json":
        if is_pass:  # the pass metadata: JSON inside the safetensors JSON header
            end = header_span(raw)
            header = json.loads(raw[8:end])
            meta = json.dumps(json.loads(header["__metadata__"]["dumpdiff.pass"])).encode()
            header["__metadata__"]["dumpdiff.pass"] = mutate_json(data, meta, into).decode()
            body = json.dumps(header).encode()
            body += b" " * (-len(body) % 8)
            raw = struct.pack("<Q", len(body)) + body + raw[end:]
        else:
            raw = mutate_json(data, raw, into, jsonl=path.endswith(".jsonl"))
    elif kind == "bytes":
        # mostly the part that is parsed (a pass file's header), sometimes anywhere
        span = header_span(raw) if is_pass and data.draw(st.booleans(), label="in header") else len(raw)
        for _ in range(data.draw(st.integers(1, 8), label="count")):
            at = data.draw(st.integers(0, max(0, span - 1)), label="at")
            raw = raw[:at] + bytes([data.draw(st.integers(0, 255), label="byte")]) + raw[at + 1 :]
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="keep")]
    else:
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=16), label="inserted") + raw[at:]
    open(path, "wb").write(raw)
    # a careful forger also fixes the manifest's size, so the damage reaches the parser
    if is_pass and kind != "bytes" and data.draw(st.booleans(), label="manifest matches"):
        match_manifest_size(path)
        into.append("manifest matched")


def test_fuzz_loaders(dumps, tmp_path, capsys):
    ref, dec = dumps
    stats = Counter()
    crashes = []
    cases = itertools.count()

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def some_inputs(data):
        work = tmp_path / f"case{next(cases)}"
        shutil.copytree(dec, work, ignore=shutil.ignore_patterns("index"))
        done = []
        targets = data.draw(st.lists(st.sampled_from(TARGETS), min_size=1, max_size=2, unique=True), label="targets")
        for target in sorted(targets, key=TARGETS.index):  # pass files first: they may edit the manifest
            done.append(target)
            mutate(data, str(work / target), done)
        stats["inputs"] += 1
        try:
            first_divergence(ref, str(work), progress=False)
            stats["results"] += 1
        except DumpError:
            stats["dump errors"] += 1
        except Exception as exc:  # noqa: BLE001 - the very thing counted
            where = traceback.extract_tb(exc.__traceback__)[-1]
            crashes.append(
                f"{type(exc).__name__}: {exc} at {os.path.basename(where.filename)}:{where.lineno} "
                f"after {', '.join(done)}"
            )
        finally:
            shutil.rmtree(work)

    start = time.time()
    while time.time() - start < SECONDS:
        some_inputs()  # a fresh random batch each round, until the time budget is spent
    summary = (
        f"fuzz_loaders: {stats['inputs']} damaged dumps tried in {time.time() - start:.0f} s: "
        f"{stats['dump errors']} DumpError (exit 2), {stats['results']} results, {len(crashes)} crashes"
    )
    with capsys.disabled():
        print("\n" + summary)
        for crash in sorted(set(crashes)):
            print("  crash:", crash)
    assert stats["inputs"] >= 50, summary
    assert crashes == [], summary
