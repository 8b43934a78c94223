"""Asking the kernel to read files ahead (posix_fadvise WILLNEED): it fetches them from storage
while this process does other work (imports numpy and pyarrow, indexes another pass), and the
later reads find them in the page cache. Hints only: a file that cannot be opened, or a system
without the call, is simply read when asked for. Imports nothing heavy."""

from __future__ import annotations

import os
import threading
from typing import Iterable


def will_need(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a named pipe put there must not block
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no such hint here: the read itself fetches the file
            pass


class RangeAdvisor:
    """Asks the kernel to read one file ``ahead`` bytes beyond the reads that several threads make
    in it, in file order: each thread says where its next read starts and ends, and a new window
    is asked for once the reads come within half a window of the last one. The reads then find
    their bytes in the page cache while the threads hash the previous ones."""

    def __init__(self, path: str, ahead: int) -> None:
        self._ahead, self._asked, self._lock = ahead, 0, threading.Lock()
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:  # the reads themselves say what is wrong with the file
            self._fd = None

    def reach(self, start: int, end: int) -> None:
        with self._lock:  # the hint itself is given outside: it can wait on the device's queue
            if self._fd is None or self._asked >= end + self._ahead // 2:
                return
            fd, begin, self._asked = self._fd, max(self._asked, start), end + self._ahead
            length = self._asked - begin
        try:
            os.posix_fadvise(fd, begin, length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # no such hint here (or closed): the reads fetch the bytes
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
