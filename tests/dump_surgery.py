"""Damage real dump files on purpose, the way disks, copies and crashes do (reliability tests).

Every helper edits real files of a real dump; nothing here imitates the code under test.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List

from helpers import dumpdiff


def copy_dump(src, dst) -> str:
    """A copy of an experiment folder without its parquet index (so the copy is indexed afresh)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("index"))
    return str(dst)


def rank0(dump) -> str:
    return os.path.join(str(dump), "rank0")


def pass_path(dump, pass_id: int) -> str:
    return os.path.join(rank0(dump), f"pass-{pass_id:06d}.safetensors")


def read_manifest(dump) -> List[dict]:
    with open(os.path.join(rank0(dump), "manifest.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_manifest(dump, entries: List[dict]):
    with open(os.path.join(rank0(dump), "manifest.jsonl"), "w") as handle:
        handle.write("".join(json.dumps(e) + "\n" for e in entries))


def match_manifest_size(path: str):
    """Edit the manifest so that it agrees with the file's (changed) size, as a forger would."""
    dump = os.path.dirname(os.path.dirname(path))
    entries = read_manifest(dump)
    for entry in entries:
        if entry["file"] == os.path.basename(path):
            entry["bytes"] = os.path.getsize(path)
    write_manifest(dump, entries)


def split_header(data: bytes):
    """(JSON header, tensor bytes) of a safetensors file's bytes."""
    length = struct.unpack("<Q", data[:8])[0]
    return data[8 : 8 + length], data[8 + length :]


def with_header(header: bytes, body: bytes) -> bytes:
    """A safetensors file's bytes: the header padded as safetensors pads it (to 8 bytes), then ``body``."""
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body


def rewrite_header(path: str, edit: Callable[[dict], object]):
    """Rewrite a safetensors file's JSON header; ``edit`` returns the new header (dict or raw bytes).
    The tensor bytes are kept and the manifest is updated to the new size."""
    with open(path, "rb") as handle:
        header, body = split_header(handle.read())
    header = edit(json.loads(header))
    raw = (
        header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    )  # as safetensors writes
    with open(path, "wb") as handle:
        handle.write(with_header(raw, body))
    match_manifest_size(path)


def edit_pass_meta(path: str, edit: Callable[[dict], None]):
    """Change the dumpdiff pass metadata (JSON inside the safetensors header) in place."""

    def change(header):
        meta = json.loads(header["__metadata__"]["dumpdiff.pass"])
        edit(meta)
        header["__metadata__"]["dumpdiff.pass"] = json.dumps(meta, separators=(",", ":"))  # as the dumper writes
        return header

    rewrite_header(path, change)


def one_line_error(result, *needles) -> str:
    """The error standard: exit 2, nothing on stdout, exactly one line on stderr, no traceback."""
    code, out, err = result
    assert code == 2, f"exit {code}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert out == "", f"partial result on stdout: {out[:500]}"
    assert err.count("\n") == 1 and err.startswith("dumpdiff: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def both_commands(reference, dump, *extra):
    """`dumpdiff index DUMP` and `dumpdiff first-divergence REFERENCE DUMP`, as a user runs them
    (both at once, in processes of their own: it halves the wait, and the two share the dump's index
    folder as users do)."""
    with ThreadPoolExecutor(2) as pool:
        index = pool.submit(dumpdiff, "index", dump, "--no-progress", process=True)
        diverge = pool.submit(dumpdiff, "first-divergence", reference, dump, "--no-progress", *extra, process=True)
        return index.result(), diverge.result()
