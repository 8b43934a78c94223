"""Asking the kernel to read files ahead (posix_fadvise WILLNEED): it fetches them from storage
while this process does other work (imports numpy and pyarrow, indexes another pass), and the
later reads find them in the page cache. Hints only: a file that cannot be opened, or a system
without the call, is simply read when asked for. Imports nothing heavy."""

from __future__ import annotations

import os
from typing import Iterable, List


def will_need(paths: Iterable[str]):
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a named pipe put there must not block
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no such hint here: the read itself fetches the file
            pass


def saved_index_files(dumps: Iterable[str]) -> List[str]:
    """The regular files of each dump's index saved inside it (where a writable dump keeps it):
    its stamp and tables, not temporary files of a build or anything else put there."""
    found = []
    for dump in dumps:
        folder = os.path.join(os.fspath(dump), "index")
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if (name == "stamp.json" or name.endswith(".parquet")) and os.path.isfile(path):
                found.append(path)
    return found
