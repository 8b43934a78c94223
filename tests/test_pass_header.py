"""dumpdiff reads pass headers with its own parser (analyzer/dump/header.py, meta.py), which
recalls text repeated from earlier passes (a decode step's calls and tensor entries) instead of
parsing it again. Whatever it accepts must read exactly as safetensors and json.loads read the
same bytes; what it cannot vouch for is left to them. Checked on real pass files, damaged at
random and by hand in the ways that could fool a text cache."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from safetensors import safe_open

from dump_surgery import match_manifest_size, pass_path, split_header, with_header
from dumpdiff.analyzer.dump import header as passheader
from dumpdiff.analyzer.dump import meta as metaparse
from dumpdiff.analyzer.dump.load import PassFile, open_dump
from dumpdiff.analyzer.dump.metacheck import meta_problem
from dumpdiff.analyzer.errors import DumpError
from dumpdiff.dumper.format import PASS_META_KEY
from helpers import dump_pair, load_model, make_tiny_llama, prompt_ids


@pytest.fixture(scope="module")
def decode_dump(tmp_path_factory):
    model = load_model(make_tiny_llama(tmp_path_factory.mktemp("llama")))
    model.generation_config.eos_token_id = None
    _, dec, _ = dump_pair(model, tmp_path_factory.mktemp("pair"), prompt_ids(9), new_tokens=5)
    return dec


def forget():
    """Both caches empty: the next read parses everything (as the first pass of a run does)."""
    metaparse._calls_by_text.clear()
    metaparse._last_array = ("", (), [])
    passheader._by_text.clear()


def safetensors_view(path: str):
    """(metadata text, {name: bytes}) as safetensors reads the file, or None when it refuses it
    (bytes None: a tensor numpy cannot hold, such as a zero-size one of 2**62 columns)."""
    try:
        opened = safe_open(path, "numpy")
        meta_text, names = opened.metadata()[PASS_META_KEY], list(opened.keys())
    except Exception:  # noqa: BLE001 - any refusal counts
        return None
    tensors = {}
    for name in names:
        try:
            tensors[name] = opened.get_tensor(name).tobytes()
        except ValueError:
            tensors[name] = None
    return meta_text, tensors


def entry_edits(header: bytes):
    """Hand-made damage to the tensor entries, written compactly as safetensors writes them."""
    parsed = json.loads(header)
    names = [k for k in parsed if k != "__metadata__"]
    first, last = names[0], names[-1]
    compact = lambda h: json.dumps(h, separators=(",", ":")).encode()  # noqa: E731
    at = header.index(b'"},"') + 3  # the first tensor entry

    def put_first(member: dict) -> bytes:
        return header[:at] + compact(member)[1:-1] + b"," + header[at:]

    def edited(change):
        h = json.loads(header)
        change(h)
        return compact(h)

    yield "as written", header
    yield "extra field", edited(lambda h: h[first].update(extra=1))
    yield "float offset", edited(lambda h: h[first].update(data_offsets=[float(v) for v in h[first]["data_offsets"]]))
    yield (
        "gap",
        edited(lambda h: h[last].update(data_offsets=[h[last]["data_offsets"][0] + 1, h[last]["data_offsets"][1] + 1])),
    )
    yield "overlap", edited(lambda h: h[first].update(data_offsets=[0, h[first]["data_offsets"][1] + 4]))
    yield (
        "short data",
        edited(
            lambda h: h[last].update(
                data_offsets=[h[last]["data_offsets"][0], h[last]["data_offsets"][1] - 4], shape=[0]
            )
        ),
    )
    sizes = {}
    for name in names:
        begin, end = parsed[name]["data_offsets"]
        sizes.setdefault(end - begin, []).append(name)
    twins = next(group for size, group in sizes.items() if len(group) >= 2 and size)
    yield (
        "two tensors on the same bytes",
        edited(lambda h: h[twins[1]].update(data_offsets=h[twins[0]]["data_offsets"])),
    )
    yield "minus zero", header.replace(b'"data_offsets":[0,', b'"data_offsets":[-0,', 1)
    yield "exponent", header.replace(b'"data_offsets":[0,', b'"data_offsets":[0e0,', 1)
    yield (
        "zero-size tensor whose dims overflow",
        put_first({"huge": {"dtype": "F32", "shape": [2**62, 4, 0], "data_offsets": [0, 0]}}),
    )
    yield "a field twice", header.replace(b'":{"dtype":"', b'":{"dtype":"U8","dtype":"', 1)
    yield (
        "a field twice, once spelt with an escape",
        header.replace(b'":{"dtype":"', b'":{"d\\u0074ype":"U8","dtype":"', 1),
    )
    yield "a dim of 2**64 after a 0", put_first({"z": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}})
    yield "zero-size tensor", put_first({"empty": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}})
    yield "bool dim", edited(lambda h: h[first].update(shape=[True] + h[first]["shape"][1:]))
    yield (
        "dtype of other width",
        edited(lambda h: h[first].update(dtype="F16" if h[first]["dtype"] != "F16" else "F32")),
    )
    yield (
        "dtype of same width",
        edited(lambda h: h[first].update(dtype={"F32": "I32", "I64": "F64"}.get(h[first]["dtype"], "U8"))),
    )
    yield "unknown dtype", edited(lambda h: h[first].update(dtype="Q7"))
    yield (
        "name with surrogate",
        compact(json.loads(header)).replace(
            json.dumps(first).encode(), b'"\\udcff' + json.dumps(first).encode()[1:], 1
        ),
    )
    yield "name twice, the first bogus", put_first({first: dict(parsed[first], data_offsets=[0, 0], shape=[0])})
    yield "metadata twice", header.rstrip(b" ")[:-1] + b',"__metadata__":{"x":"y"}}'
    yield (
        "metadata twice, as a tensor",
        header.rstrip(b" ")[:-1]
        + b',"__metadata__":'
        + compact({"dtype": "U8", "shape": [0], "data_offsets": [0, 0]})
        + b"}",
    )
    yield "trailing comma", header.rstrip(b" ")[:-1] + b",}"
    metadata_only = compact({"__metadata__": parsed["__metadata__"]})
    yield "no tensors", metadata_only
    yield "no tensors, no data", metadata_only, b""
    yield "no tensors, a comma, no data", metadata_only[:-1] + b",}", b""
    yield "space after the metadata", metadata_only[:-1] + b", " + header[header.index(b'"},"') + 3 :]


def test_vouched_headers_read_as_safetensors_reads_them(decode_dump, tmp_path):
    """Never vouch for a file safetensors refuses; a vouched file's metadata, tensor names and
    tensor bytes are the ones safetensors reads. Recalled entries (a second file with the same
    entries text) obey the same rule."""
    original = open(pass_path(decode_dump, 3), "rb").read()
    header, body = split_header(original)
    meta_end = header.index(b'"},"') + 2
    rng = random.Random(7)
    variants = list(entry_edits(header))
    for trial in range(1200):  # random bytes, half of them in the tensor entries
        at = rng.randrange(8, meta_end) if trial % 2 else rng.randrange(meta_end, len(header))
        damaged = bytearray(header)
        damaged[at : at + 1] = rng.choice(
            [b"", b"0", b"9", b'"', b"\\", b"}", b",", b"]", b" ", b"\xff", b"e", b"\x01"]
        )
        variants.append((f"byte {at}", bytes(damaged)))
    vouched = refused = 0
    path = str(tmp_path / "pass.safetensors")
    for label, text, *data in variants:
        file_bytes = with_header(text, data[0] if data else body)
        for attempt in ("first read", "recalled"):
            with open(path, "wb") as handle:
                handle.write(file_bytes)
            got, _ = passheader.read_header(path)
            truth = safetensors_view(path)
            if got is None:
                refused += 1
                continue
            vouched += 1
            assert truth is not None, f"{label} ({attempt}): vouched for a file safetensors refuses"
            meta_text, tensors = truth
            assert got.meta_text == meta_text and got.names == set(tensors), label
            for name, data in tensors.items():
                dtype, shape, begin, end = got.layout.get(name)
                assert data is None or file_bytes[begin:end] == data, (
                    f"{label}: {name} placed elsewhere than safetensors reads it"
                )
    assert vouched > 100 and refused > 100  # the damage exercised both sides
    forget()


def test_a_header_it_does_not_vouch_for_is_read_by_safetensors(decode_dump, tmp_path):
    """A field safetensors ignores (unknown to this reader): the pass still opens, through
    safetensors, with the same metadata and tensors."""
    path = pass_path(decode_dump, 2)
    whole = PassFile(open_dump(decode_dump).ranks[0].passes[2])
    header, body = split_header(open(path, "rb").read())
    parsed = json.loads(header)
    name = next(k for k in parsed if k != "__metadata__")
    parsed[name]["extra"] = 1
    copy = tmp_path / "dec"
    shutil.copytree(decode_dump, copy)
    with open(pass_path(str(copy), 2), "wb") as handle:
        handle.write(with_header(json.dumps(parsed, separators=(",", ":")).encode(), body))
    match_manifest_size(pass_path(str(copy), 2))
    assert passheader.read_header(pass_path(str(copy), 2))[0] is None
    ref = open_dump(str(copy)).ranks[0].passes[2]
    edited = PassFile(ref)
    assert edited.layout is None and edited.meta == whole.meta and edited.names == whole.names
    assert np.array_equal(edited.bits(name)[0], whole.bits(name)[0])


def meta_edits(meta_text: str):
    """Metadata texts that could fool the calls cache: another "calls" key (nested, repeated,
    spelt with an escape), a NaN elsewhere, a string holding '"calls":[', spacing, damage."""
    meta = json.loads(meta_text)
    calls = meta["calls"]
    compact = lambda m: json.dumps(m, separators=(",", ":"))  # noqa: E731
    at = meta_text.index('"calls":[')
    yield meta_text
    yield meta_text.replace('"calls":[', '"calls": [', 1)
    yield meta_text[:at] + '"calls":[' + meta_text[at + 9 :].replace("},{", "} ,{", 1)
    yield meta_text[:-1] + ',"calls":[]}'  # a second top-level "calls": the last one counts
    yield meta_text[:-1] + ',"calls":' + json.dumps(calls[:1], separators=(",", ":")) + "}"
    yield (
        '{"calls":' + json.dumps(calls, separators=(",", ":")) + "," + meta_text[1:].replace('"calls":[', '"old":[', 1)
    )
    yield meta_text.replace('"calls":[', '"c\\u0061lls":[', 1)  # the same key, spelt with an escape
    yield meta_text.replace('"calls":[', '"nested":{"calls":[', 1).replace("]", "]}", 1)
    yield meta_text[:-1] + ',"nested":{"calls":' + compact(calls) + "}}"
    yield meta_text[:-1] + ',"c\\u0061lls":0}'
    yield meta_text[:-1] + ',"x":NaN}'
    yield meta_text[:-1] + ',"s":"\\"calls\\":[' + "x" + '"}'
    yield meta_text.replace('"pre":', '"pre":1.0,"pre0":', 1)
    yield meta_text.replace('"pre":0', '"pre":true', 1)
    yield meta_text.replace('"calls":[', '"calls":[[],', 1)
    yield meta_text.replace("]}", "],}", 1)
    yield meta_text.replace('"call":', '"call":"\\udcff","c":', 1)
    yield meta_text.replace('"mode":"', '"mode":"\\ud83d\\ude00', 1)  # an emoji, as the dumper escapes it
    yield meta_text.replace('"mode":"', '"mode":"\\ud83d', 1)  # half of one
    yield compact(dict(meta, calls=calls[::-1]))
    yield compact(dict(meta, calls=calls + calls[:2]))
    rng = random.Random(11)
    for _ in range(600):
        at = rng.randrange(len(meta_text))
        yield (
            meta_text[:at]
            + rng.choice(["", '"', ",", "]", "}", "[", "0", "1.0", " ", "\\", "NaN", '"calls":['])
            + meta_text[at + rng.choice([0, 1]) :]
        )


def whole_parse(text: str):
    """What json.loads and the metadata checks make of the text: the metadata, or "refused"."""
    try:
        meta = json.loads(text)
        json.dumps(meta, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):
        return "refused"
    if (
        not isinstance(meta, dict)
        or any(k not in meta for k in ("tokens", "calls", "token_shape"))
        or meta_problem(meta)
    ):
        return "refused"
    return meta


def cached_parse(text: str):
    try:
        return metaparse.parse_meta(text, "pass")
    except DumpError:
        return "refused"


def test_metadata_reads_as_json_loads_reads_it(decode_dump):
    """With nothing remembered and with the calls of an earlier step remembered, every text
    reads as json.loads reads it (same values, types and key order) or is refused by both."""
    raw = [
        json.loads(split_header(open(pass_path(decode_dump, p), "rb").read())[0])["__metadata__"][PASS_META_KEY]
        for p in (1, 2)
    ]
    checked = 0
    for text in meta_edits(raw[1]):
        expected = whole_parse(text)
        for state in ("nothing remembered", "an earlier step remembered"):
            forget()
            if state != "nothing remembered":
                metaparse.parse_meta(raw[0], "earlier")
            got = cached_parse(text)
            assert (got == "refused") == (expected == "refused"), (state, text[:300])
            if got != "refused":
                assert json.dumps(got) == json.dumps(expected), (state, text[:300])
                checked += 1
    assert checked > 100
    forget()


def test_steps_share_their_calls(decode_dump):
    """Decode steps whose calls are written alike get the very same call objects (the index
    recognises a step's structure by them) and equal metadata to a fresh parse."""
    forget()
    refs = open_dump(decode_dump).ranks[0].passes[1:]
    opened = [PassFile(ref, whole=True) for ref in refs]
    assert all(pf.layout is not None for pf in opened)  # the dumper's headers are vouched for
    first, later = opened[0].meta["calls"], opened[-1].meta["calls"]
    assert len(first) == len(later) and sum(a is b for a, b in zip(first, later)) >= len(first) - 2
    for pf in opened:
        raw = json.loads(split_header(pf.data.tobytes())[0])["__metadata__"][PASS_META_KEY]
        assert json.dumps(pf.meta) == json.dumps(json.loads(raw))
    forget()
