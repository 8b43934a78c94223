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


PASSES_AHEAD_BYTES = 512 << 20  # about what a 2-3 GB/s disk reads while the index build's imports load


def passes_ahead(dump_paths: Iterable[str], rebuild: bool = False, budget: int = PASSES_AHEAD_BYTES):
    """Ask the kernel, on a background thread, for the first ``budget`` bytes of the pass files
    of each dump whose index is about to be built (none saved yet, or ``rebuild``), in the order
    the build reads them: the disk works while this process imports numpy and pyarrow instead
    of idling until the first read. A dump with a saved index is not touched (a fresh one is
    read, not rebuilt; a stale one is only slower to rebuild). Returns the thread, if any."""
    from .indexfiles import STAMP_FILE, index_folder
    dumps = [os.fspath(p) for p in dump_paths]
    todo = [p for p in dumps if rebuild or not os.path.isfile(os.path.join(index_folder(p), STAMP_FILE))]
    if not todo:
        return None
    import threading
    thread = threading.Thread(target=_ask_in_order, args=(todo, budget), name="dumpdiff-passes-ahead", daemon=True)
    thread.start()
    return thread


def _ask_in_order(dumps: List[str], budget: int):
    for path in (f for dump in dumps for f in _pass_files(dump)):
        if budget <= 0:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                size = os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, min(size, budget), os.POSIX_FADV_WILLNEED)
                budget -= size
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass


def _pass_files(dump: str) -> List[str]:
    """rank<R>/pass-<N>.safetensors under a dump, ranks and passes in number order (the format
    of dumper/format.py; anything else there is ignored: the loader judges the dump)."""
    def numbered(folder: str, prefix: str, suffix: str = ""):
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        found = [(name[len(prefix):len(name) - len(suffix)], name) for name in names
                 if name.startswith(prefix) and name.endswith(suffix)]
        return [os.path.join(folder, name) for _, name in sorted((int(n), name) for n, name in found if n.isdigit())]
    return [f for rank in numbered(dump, "rank") for f in numbered(rank, "pass-", ".safetensors")]
