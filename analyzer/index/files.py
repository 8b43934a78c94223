"""Where a dump's saved index lives and the files it is made of. Imports nothing heavy: the
command line names the files (to have them read ahead) before numpy and pyarrow load."""

from __future__ import annotations

import os
from typing import Iterable, List

INDEX_DIR = "index"
TABLES = ("tokens", "seqs", "calls", "tensors", "rows")
STAMP_FILE = "stamp.json"


def index_folder(dump_path: str) -> str:
    """Inside the dump when writable; else a per-dump folder in the user's cache."""
    if os.access(dump_path, os.W_OK):
        return os.path.join(dump_path, INDEX_DIR)
    import hashlib  # (OpenSSL: only for a read-only dump)

    digest = hashlib.sha256(os.path.abspath(dump_path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~/.cache/dumpdiff/index"), digest)


def table_path(folder: str, table: str) -> str:
    return os.path.join(folder, f"{table}.parquet")


def saved_index_files(dump_paths: Iterable[str]) -> List[str]:
    """The stamp and tables of each dump's saved index that exist as regular files (not a
    named pipe or anything else put in their place)."""
    found = []
    for dump_path in dump_paths:
        folder = index_folder(os.fspath(dump_path))
        for path in (os.path.join(folder, STAMP_FILE), *(table_path(folder, table) for table in TABLES)):
            if os.path.isfile(path):
                found.append(path)
    return found
