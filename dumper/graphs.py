"""Dumping CUDA graph replays: record at capture, write after each replay.

With DUMPER_GRAPH_BUFFER_BYTES > 0, a forward of the root module that runs while a CUDA graph is
being captured is recorded: the hooks run as in an eager pass, and each selected tensor (or, in
mode fingerprint, each row's fingerprint, computed by kernels that are captured too) is copied
into a static device slot (arena.py) by a kernel the graph holds. Nothing syncs, nothing goes to
the host, nothing is allocated outside the graph's pool. After each replay, ``after_replay``
copies the slots to the host and writes a pass file from the replay's own pass metadata (its
real inputs) and real batch, padding rows trimmed (recording.py).

Recording happens whether or not dumping is enabled at capture (an engine captures its graphs at
start-up, before anyone switches dumping on); a replay is written only while dumping is enabled.

    g = torch.cuda.CUDAGraph()
    with handle.capture(g):                 # torch.cuda.graph(g), the recording bound to g
        static_out = model(**static_inputs)
    ...                                     # fill the static inputs for a step
    handle.replay(g, batch_rows=n)          # before_replay, g.replay(), after_replay

An engine that captures and replays by itself binds its recordings with ``graph_recording(key)``
around its capture and calls ``before_replay(key, ...)`` / ``after_replay(key, ...)`` around
its replay (docs/models-and-engines.md: the sglang and vLLM graph runners).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import Dict, List, Optional

import torch

from . import format as fmt
from . import passprints, rowprint
from .arena import Arenas
from .config import HOOKED_MODES, ConfigError, parse_positions
from .passinfo import PassInfo, UndescribedPass, WarmupPass
from .passprints import PassPrints
from .passstate import PassState
from .recording import Recording, ReplayMismatch

log = logging.getLogger("dumper")


class GraphBufferError(ConfigError):
    """A captured graph's selection does not fit DUMPER_GRAPH_BUFFER_BYTES (one line)."""


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (False before CUDA starts:
    no capture can be under way, and asking would start it)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _load_print_kernel(model) -> None:
    """Load the one-launch print kernel (rowkernel.py) for the model's element types and the
    usual index and mask types before a capture, which cannot load it: else the graph holds the
    torch form's two dozen kernels per block of rows."""
    kernel = passprints._rowkernel()
    if kernel is None or not torch.cuda.is_initialized():
        return
    devices, dtypes = set(), {torch.int64, torch.int32, torch.float32, torch.bool}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dtypes.add(tensor.dtype)
        if tensor.is_cuda:
            devices.add(tensor.device)
    for device in devices or {torch.device("cuda")}:
        kernel.load(device, dtypes)


class GraphDumps:
    """The recordings of one dumper, keyed by the graph (or engine key) they were captured for."""

    def __init__(self, dumper, budget: int) -> None:
        self.dumper = dumper
        self.arenas = Arenas(budget)
        self._binding: List[object] = []  # keys of the open graph_recording contexts
        self._recordings: Dict[object, List[Recording]] = {}

    # --- capture ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def graph_recording(self, key):
        """Bind the recordings made inside to ``key``; a new capture for a key replaces its
        recordings. The writer is emptied first: a capture in CUDA's default (global) mode fails
        if another thread syncs meanwhile, as the writer does before each file."""
        self.dumper.flush()
        if self.dumper.config.row_prints()[0] and not capturing():
            _load_print_kernel(self.dumper.model)
        self._recordings[key] = []
        self._binding.append(key)
        try:
            yield self._recordings[key]
        finally:
            self._binding.pop()

    @contextlib.contextmanager
    def capture(self, graph, **graph_kwargs):
        """``torch.cuda.graph(graph, **graph_kwargs)`` with the recordings bound to ``graph``. The
        capture is thread-local unless asked otherwise: the dump writer may wait on an event of an
        earlier pass meanwhile, which a global capture forbids to every thread."""
        graph_kwargs.setdefault("capture_error_mode", "thread_local")
        with self.graph_recording(graph) as recordings, torch.cuda.graph(graph, **graph_kwargs):
            yield recordings

    def recordings(self, key) -> List[Recording]:
        return self._recordings.get(key, [])

    def captured_forward(self, original, args, kwargs):
        """The root forward run while a graph is captured: recorded into static slots."""
        dumper = self.dumper
        cfg = dumper.config
        if cfg.non_intrusive_mode not in HOOKED_MODES:
            return original(*args, **kwargs)
        with dumper._claim:  # the pass is this thread's, as an eager one's is
            mine = dumper._pass_thread is None
            if mine:
                dumper._pass_thread = threading.get_ident()
        if not mine:
            return original(*args, **kwargs)
        try:
            shape = token_shape(dumper.adapter, dumper.model, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the dumper never makes a model call fail
            dumper._pass_thread = None
            dumper._warn_once("graph-shape", f"dumper: a graph capture not recorded: {exc}")
            return original(*args, **kwargs)
        carried, every = cfg.row_prints()
        current = PassState(
            placeholder_info(shape),
            None,
            "",
            cfg.non_intrusive_mode,
            PassPrints(raw_copies=False) if carried else None,  # the capture records copy_'s nodes
            every,
        )
        key = self._binding[-1] if self._binding else None
        layout = current.recording = self.arenas.layout([r.layout for r in self._recordings.get(key, [])])
        dumper._pass = current
        try:
            if dumper._hooked_filter != cfg.filter:
                dumper._detach_hooks()
                dumper._attach_hooks(cfg.filter)
            if dumper._selected(fmt.ROOT_PATH, type(dumper.model).__name__):
                dumper._pre(dumper.model, args, kwargs)
            output = original(*args, **kwargs)
            if any(c.module == "" for c in current.nesting):
                dumper._post(dumper.model, (), {}, output)
            if current.prints is not None:
                table = current.prints.finish(host=False)
                if table is not None:
                    layout.record(fmt.ROWPRINTS_TENSOR, table)
        finally:
            dumper._pass = dumper._pass_thread = None
        message = layout.overflow_message(shape)
        if message:
            raise GraphBufferError(message)
        recording = Recording(
            shape, cfg.non_intrusive_mode, cfg.filter, layout, [c.to_meta() for c in current.calls], args, dict(kwargs)
        )
        self._recordings.setdefault(key, []).append(recording)
        return output

    # --- replay -----------------------------------------------------------------------------
    def before_replay(self, key, args=(), kwargs=None, info: Optional[PassInfo] = None) -> None:
        """Read each recording's pass metadata before the replay changes state (a KV cache's
        length): from ``info``, else the adapter reading ``args``/``kwargs``, else the captured
        arguments (a graph's static inputs, holding this replay's values)."""
        if not self.dumper._active():
            return
        for recording in self.recordings(key):
            recording.pending = info or self._read(recording, args, kwargs)

    def after_replay(self, key, batch_rows: Optional[int] = None, info: Optional[PassInfo] = None) -> int:
        """Write one pass per recording of ``key`` from the replay that just ran (queued on the
        current stream); returns the passes submitted."""
        dumper = self.dumper
        found = self.recordings(key)
        if not dumper._active():
            for recording in found:
                recording.pending = None
            return 0
        if not found:
            dumper._warn_once(
                ("graph-none", id(key)),
                "dumper: a replayed graph recorded nothing at capture (captured before the dumper was "
                "installed, outside handle.capture/graph_recording, or with DUMPER_NON_INTRUSIVE_MODE "
                "off or core): capture it again to dump its replays",
            )
            return 0
        written = 0
        for recording in found:
            replay_info = info or recording.pending or self._read(recording, (), None)
            recording.pending = None
            if replay_info is not None and self._write(recording, replay_info, batch_rows):
                written += 1
        return written

    def replay(self, graph, batch_rows: Optional[int] = None) -> None:
        """``graph.replay()`` between before_replay and after_replay (metadata from the captured
        static inputs): the helper for a model whose graph's inputs are its forward's arguments."""
        self.before_replay(graph)
        graph.replay()
        self.after_replay(graph, batch_rows)

    def _read(self, recording: Recording, args, kwargs) -> Optional[PassInfo]:
        dumper = self.dumper
        args, kwargs = (args, kwargs or {}) if args or kwargs else (recording.args, recording.kwargs)
        try:
            return dumper.adapter.pass_info(dumper.model, args, kwargs)
        except WarmupPass:
            return None
        except (UndescribedPass, Exception) as exc:  # noqa: BLE001 - never the model's failure
            dumper._warn_once("graph-undescribed", f"dumper: a graph replay not dumped: {exc}")
            return None

    def _write(self, recording: Recording, info: PassInfo, batch_rows: Optional[int]) -> bool:
        from .writer import PassRecord

        dumper = self.dumper
        cfg = dumper.config
        if (cfg.non_intrusive_mode, cfg.filter) != (recording.mode, recording.filter):
            dumper._warn_once(
                "graph-settings",
                f"dumper: graph replays are dumped as captured (mode={recording.mode}, "
                f"filter='{recording.filter}'); capture the graph again to apply the new settings",
            )
        positions = parse_positions(cfg.positions)
        try:
            info, calls, kept, tensors, prepare, graph = recording.replay_pass(
                info, batch_rows, lambda real: real.kept_rows(positions, cfg.last_rows)
            )
        except ReplayMismatch as exc:
            dumper._warn_once("graph-mismatch", f"dumper: a graph replay not dumped: {exc}")
            return False
        dumper.step += 1
        exp_dir = dumper._exp_dir()
        dumper._fill_prefixes(info, exp_dir)
        meta = info.to_meta()
        meta.update(step=dumper.step, rank=dumper.rank, calls=calls, kept_rows=kept, dump_mode=recording.mode)
        meta["graph"] = graph
        if fmt.ROWPRINTS_TENSOR in tensors:
            meta["rowprint"] = rowprint.VERSION
        ready = None
        if any(device.type == "cuda" for device in recording.layout.used):
            ready = torch.cuda.Event()
            ready.record()
        dumper._writer.write_run_info(exp_dir, dumper._run_info)
        cleanup = exp_dir in dumper._cleanup_pending
        dumper._cleanup_pending.discard(exp_dir)
        record = PassRecord(exp_dir, dumper.rank, meta, tensors, ready, cleanup=cleanup, prepare=prepare)
        if not dumper._writer.submit(record):
            return False
        dumper.passes_dumped += 1
        return True


def token_shape(adapter, model, args, kwargs) -> List[int]:
    """The captured forward's token layout, read from shapes alone (no sync, no host copy): the
    adapter's ``capture_shape`` where it has one, else the shape of its token-id argument."""
    own = getattr(adapter, "capture_shape", None)
    if own is not None:
        return list(own(model, args, kwargs))
    from .engines.generic import first_token_tensor

    ids = first_token_tensor(args, kwargs)
    if ids is None:
        raise ValueError("no token-id argument in the captured forward")
    return list(ids.shape)


def placeholder_info(shape: List[int]) -> PassInfo:
    """The pass metadata of a captured forward: its layout only (the graph's inputs hold no real
    tokens at capture). Each first-dim entry is one sequence, as in a decode graph."""
    rows = 1
    for size in shape:
        rows *= size
    per_entry = rows // shape[0] if shape and shape[0] else 0
    return PassInfo(
        mode="unknown",
        token_shape=list(shape),
        ids=[-1] * rows,
        pos=[0] * rows,
        seq=[""] * rows,
        valid=[False] * rows,
        last_rows=[(b + 1) * per_entry - 1 for b in range(shape[0] if shape else 0)],
    )
