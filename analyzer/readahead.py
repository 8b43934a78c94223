"""Asking the kernel to read files ahead (posix_fadvise WILLNEED): it fetches them from storage
while this process does other work (imports numpy and pyarrow, indexes another pass), and the
later reads find them in the page cache. Hints only: a file that cannot be opened, or a system
without the call, is simply read when asked for. Imports nothing heavy."""

from __future__ import annotations

import os
from typing import Iterable


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
