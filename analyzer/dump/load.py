"""Open a dump folder and read its passes, trusting only what the manifest committed.

Every problem with the files becomes a ``DumpError`` whose message names the file, says what
is wrong and what to do. Nothing here unpickles: tensors come from safetensors, metadata from
JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
from safetensors import SafetensorError, safe_open

from dumpdiff.dumper import format as fmt

from ..errors import DumpError, show
from .dtypes import BY_CODE, DType
from .header import read_header
from .meta import parse_meta
from .metacheck import is_int, is_str

LOCK_FILE = ".lock"  # dumper/writer.py's lock file; its text says whether the writer closed the dump


@dataclasses.dataclass
class PassRef:
    rank: int
    pass_id: int
    path: str
    nbytes: int
    mode: Optional[str] = None


@dataclasses.dataclass
class RankDump:
    rank: int
    dir: str
    passes: List[PassRef]
    torn_lines: int = 0  # manifest lines cut short by a crash (ignored)
    orphans: List[str] = dataclasses.field(default_factory=list)  # files never committed
    unclosed: Optional[str] = None  # the writer that never closed this folder (killed), if any
    sessions: List[str] = dataclasses.field(default_factory=list)  # the writers that committed its passes, in order


@dataclasses.dataclass
class Dump:
    path: str
    run: dict
    ranks: Dict[int, RankDump]
    incomplete: Optional[str] = None  # why dumping stopped early, if it did

    @property
    def label(self) -> str:
        return os.path.basename(os.path.normpath(self.path)) or self.path

    def setting(self, key: str):
        """A DUMPER_* setting the dump was made with (run.json's config), or None."""
        config = self.run.get("config")
        return config.get(key) if isinstance(config, dict) else None  # a hand-edited run.json may hold anything

    def warnings(self) -> List[str]:
        notes = []
        if self.incomplete:
            notes.append(
                f"{self.label}: dump marked INCOMPLETE ({self.incomplete}); passes after that were not written"
            )
        for rank in self.ranks.values():
            if rank.torn_lines:
                notes.append(
                    f"{self.label} rank{rank.rank}: {rank.torn_lines} torn manifest line(s) ignored (writer was killed)"
                )
            if rank.unclosed:
                last = rank.passes[-1].pass_id if rank.passes else None
                notes.append(
                    f"{self.label} rank{rank.rank}: the writer ({rank.unclosed}) never closed the dump "
                    f"(killed, crashed or still running); passes after pass {last} may be missing"
                )
            if len(rank.sessions) > 1:
                notes.append(
                    f"{self.label} rank{rank.rank}: passes from {len(rank.sessions)} writer sessions "
                    f"({'; '.join(rank.sessions[:3])}): a rerun was appended to this experiment, and "
                    "the dump holds both runs; dump each run into a fresh experiment (cleanup_previous)"
                )
            if rank.orphans:
                notes.append(
                    f"{self.label} rank{rank.rank}: {len(rank.orphans)} uncommitted pass file(s) ignored "
                    f"(a writer killed mid-write, or one still writing): {', '.join(rank.orphans[:3])}"
                )
        return notes


def open_dump(path: str) -> Dump:
    if not os.path.exists(path):
        raise DumpError(f"{show(path)}: no such directory; give the experiment folder <DUMPER_DIR>/<exp_name>")
    if not os.path.isdir(path):
        raise DumpError(f"{show(path)}: not a directory; give the experiment folder <DUMPER_DIR>/<exp_name>")
    run_path = os.path.join(path, fmt.RUN_FILE)
    if not os.path.exists(run_path):
        raise DumpError(_not_a_dump_message(path))
    run = _read_run(run_path)
    ranks = {}
    for entry in sorted(os.listdir(path)):
        match = fmt.RANK_DIR_RE.match(entry)
        if match and os.path.isdir(os.path.join(path, entry)):
            ranks[int(match.group(1))] = _read_rank(int(match.group(1)), os.path.join(path, entry))
    ranks = {r: d for r, d in ranks.items() if d.passes}
    incomplete = None
    marker = os.path.join(path, fmt.INCOMPLETE_FILE)
    if os.path.exists(marker):
        with open(marker, "rb") as handle:
            incomplete = handle.read(2000).decode("utf-8", "replace").strip().splitlines()[0:1] or ["reason unknown"]
            incomplete = incomplete[0]
    if not ranks:
        why = f"dumping stopped: {incomplete}" if incomplete else "was dumping enabled while the model ran?"
        raise DumpError(f"{show(path)}: the dump holds no committed pass ({why})")
    return Dump(path=path, run=run, ranks=ranks, incomplete=incomplete)


def _not_a_dump_message(path: str) -> str:
    entries = os.listdir(path)
    if not entries:
        return f"{show(path)}: empty directory, not a dump; give the experiment folder <DUMPER_DIR>/<exp_name>"
    inner = [e for e in entries if os.path.exists(os.path.join(path, e, fmt.RUN_FILE))]
    if inner:
        return (
            f"{show(path)}: this is a DUMPER_DIR holding experiments ({', '.join(sorted(inner)[:5])}); "
            f"give one of them, e.g. {show(os.path.join(path, sorted(inner)[0]))}"
        )
    if any(e.endswith(".pt") for e in entries):
        return f"{show(path)}: holds .pt files but no run.json; for sglang's built-in dumper output use 'dumpdiff import-sglang'"
    if fmt.INCOMPLETE_FILE in entries:  # stopped before its first pass was written (the run file comes with it)
        with open(os.path.join(path, fmt.INCOMPLETE_FILE), "rb") as handle:
            reason = (handle.read(2000).decode("utf-8", "replace").strip().splitlines() or ["reason unknown"])[0]
        return f"{show(path)}: the dump holds no committed pass (dumping stopped before the first: {reason})"
    return f"{show(path)}: not a dumpdiff dump (no {fmt.RUN_FILE}); give the experiment folder <DUMPER_DIR>/<exp_name>"


def _read_run(run_path: str) -> dict:
    try:
        with open(run_path, "rb") as handle:
            run = json.loads(handle.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DumpError(f"{show(run_path)}: not valid JSON ({exc}); the dump is damaged, dump again") from None
    if not isinstance(run, dict) or run.get("format") != fmt.FORMAT_NAME:
        raise DumpError(
            f"{show(run_path)}: not a dumpdiff run file; give the experiment folder <DUMPER_DIR>/<exp_name>"
        )
    version = run.get("version")
    if not isinstance(version, int) or version < 1:
        raise DumpError(f"{show(run_path)}: format version {version!r} is not valid; the dump is damaged")
    if version > fmt.FORMAT_VERSION:
        raise DumpError(
            f"{show(run_path)}: written in dump format {version}, newer than this dumpdiff reads "
            f"({fmt.FORMAT_VERSION}); upgrade dumpdiff (pip install -U dumpdiff)"
        )
    return run


def _read_rank(rank: int, rank_dir: str) -> RankDump:
    manifest = os.path.join(rank_dir, fmt.MANIFEST_FILE)
    passes: List[PassRef] = []
    torn = 0
    committed = set()
    sessions: List[str] = []
    if os.path.exists(manifest):
        with open(manifest, "rb") as handle:
            lines = handle.read().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line.decode("utf-8"))
                pass_id, name, nbytes = entry["pass"], entry["file"], entry["bytes"]
                if not (is_int(pass_id) and is_str(name) and is_int(nbytes)):  # json reads Infinity, 1e999, 1.5 too
                    raise ValueError("not a manifest entry")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
                if number >= len(lines) - 1:  # only the last line can be torn by a crash
                    torn += 1
                    continue
                raise DumpError(
                    f"{show(manifest)}: line {number} is not a manifest entry; the dump is damaged, dump again"
                ) from None
            if os.path.basename(name) != name or not name.endswith(".safetensors"):
                raise DumpError(
                    f"{show(manifest)}: line {number} names {name!r}, not a pass file in this folder; the dump is damaged"
                )
            path = os.path.join(rank_dir, name)
            if not os.path.exists(path):
                raise DumpError(
                    f"{show(manifest)}: names {name} but that file is missing; copy the whole dump folder again"
                )
            size = os.path.getsize(path)
            if size != nbytes:
                raise DumpError(
                    f"{show(path)}: truncated or changed ({size} bytes, manifest says {nbytes}); copy the dump again"
                )
            committed.add(name)
            passes.append(PassRef(rank, pass_id, path, nbytes, entry.get("mode")))
            session = entry.get("session")
            if is_str(session) and session not in sessions:
                sessions.append(session)
    # Uncommitted: our ".pass-N.safetensors.tmp", safetensors' own ".tmpXXXXXX" (it writes through a
    # temp file too), and a pass file renamed into place whose manifest line never came.
    orphans = sorted(n for n in os.listdir(rank_dir) if n.endswith((".safetensors", ".tmp")) or n.startswith(".tmp"))
    orphans = [n for n in orphans if n not in committed]
    passes.sort(key=lambda p: p.pass_id)
    return RankDump(rank, rank_dir, passes, torn, orphans, _unclosed_writer(rank_dir), sessions)


def _unclosed_writer(rank_dir: str) -> Optional[str]:
    """The writer keeps "writing pid=N" in its lock file until it closes the dump ("closed")."""
    try:
        with open(os.path.join(rank_dir, LOCK_FILE), "rb") as handle:
            state = handle.read(200).decode("utf-8", "replace").strip()
    except OSError:
        return None  # no lock file: a dump from before this was recorded, or copied without it
    return state if state.startswith("writing") else None


def _safe_open(path: str, framework: str = "numpy"):
    """safe_open, also for a path with bytes that are not UTF-8 (safetensors accepts only UTF-8
    paths): such a file is opened by us and handed over as /dev/fd/N, which needs no name.
    numpy by default: the "pt" framework imports torch (a second of start-up) at open."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        fd = os.open(path, os.O_RDONLY)
        try:
            return safe_open(f"/dev/fd/{fd}", framework=framework)  # safetensors opens and maps its own copy
        finally:
            os.close(fd)
    return safe_open(path, framework=framework)


class PassFile:
    """One committed pass: its metadata and lazy access to its tensors."""

    def __init__(self, ref: PassRef, whole: bool = False, buffer_for=None) -> None:
        """``whole``: read the whole file now and keep its bytes as ``data`` (a small pass), in a
        buffer from ``buffer_for(n)`` when given (the caller's to reuse once done with this pass)."""
        self.ref = ref
        self._file = self._torch_file = None
        header, self.data = read_header(ref.path, whole, buffer_for)
        if self.data is not None and len(self.data) != ref.nbytes:
            raise DumpError(f"{show(ref.path)}: changed while being read; copy the dump again")
        if header is not None:  # checked by us as safetensors would: no need to open it yet
            self.layout, self.names, raw = header.layout, header.names, header.meta_text
        else:  # safetensors opens it, and names what is wrong
            self.layout = None
            raw = self._safetensors().metadata() or {}
            raw = raw.get(fmt.PASS_META_KEY)
            if raw is None:
                raise DumpError(
                    f"{show(ref.path)}: no dumpdiff metadata in the safetensors header; not a dumpdiff pass file"
                )
            self.names = set(self._file.keys())
        self.meta = parse_meta(raw, ref.path)

    def _safetensors(self):
        if self._file is None:
            try:
                self._file = _safe_open(self.ref.path)
            except (SafetensorError, OSError, ValueError) as exc:
                raise DumpError(f"{show(self.ref.path)}: corrupt pass file ({exc}); re-copy or re-dump it") from None
        return self._file

    def tensor(self, name: str):
        """The tensor as torch (imported here, not before)."""
        self._check(name)
        try:
            if self._torch_file is None:
                self._torch_file = _safe_open(self.ref.path, "pt")
            return self._torch_file.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DumpError(
                f"{show(self.ref.path)}: cannot read tensor {name!r} ({exc}); the file is damaged"
            ) from None

    def bits(self, name: str) -> Tuple[np.ndarray, DType]:
        """The tensor's elements as unsigned-int bits in numpy, and its element type (no torch
        unless numpy cannot read the type)."""
        self._check(name)
        try:
            opened = self._safetensors()
            dtype = BY_CODE.get(opened.get_slice(name).get_dtype())
            if dtype is not None and dtype.native is not None:
                return np.ascontiguousarray(opened.get_tensor(name)).view(dtype.bits), dtype
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
            raise DumpError(
                f"{show(self.ref.path)}: cannot read tensor {name!r} ({exc}); the file is damaged"
            ) from None
        from .torchbits import from_torch  # bfloat16, float8: numpy has no such type

        return from_torch(self.tensor(name))

    def _check(self, name: str) -> None:
        if name not in self.names:
            raise DumpError(
                f"{show(self.ref.path)}: tensor {name!r} listed in metadata is not in the file; the file is damaged"
            )
