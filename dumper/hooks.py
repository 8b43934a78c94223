"""Install dump hooks on any torch.nn.Module; one forward of the root module is one pass.

The root's ``forward`` is wrapped (engines such as sglang call ``model.forward`` directly, so
root hooks would never fire); the wrapper marks pass boundaries and asks the engine adapter for
the pass's token rows. Per-module pre/post hooks are attached only while dumping is enabled:
disabled, a forward pass costs one flag check.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
import weakref
from typing import Dict, Optional

import torch

from . import capture, passplan, rowprint
from . import format as fmt
from .config import HOOKED_MODES, ConfigError, DumperConfig, check_exp_name, compile_filter, parse_positions
from .graphs import GraphDumps, capturing
from .passinfo import PassInfo, UndescribedPass, WarmupPass
from .passprints import PassPrints
from .passstate import Call, PassState
from .writer import PassRecord, PassWriter

log = logging.getLogger("dumper")
# the element types a dump stores -> their names in metadata: one dict lookup per tensor
_STORED = {getattr(torch, name): name for name in fmt.STORED_DTYPES if hasattr(torch, name)}


def _names_under(path: str) -> Dict[str, str]:
    """{each ancestor's path: path}: 'a.b.c' -> {'a.b': 'a.b.c', 'a': 'a.b.c'} (a filter may
    leave the direct parent unhooked, so any open ancestor places the call)."""
    parts = path.split(".")
    return {".".join(parts[:i]): path for i in range(len(parts) - 1, 0, -1)}


class Dumper:
    """Handle returned by ``install``: ``configure``, ``flush``, ``remove``, ``state``."""

    def __init__(self, model: torch.nn.Module, config: DumperConfig, adapter) -> None:
        self.model = model
        self.config = config
        self.adapter = adapter
        self.rank = _rank()
        self.step = 0
        self.passes_dumped = 0
        self._lock = threading.RLock()
        self._pass: Optional[PassState] = None
        self._hook_handles: list = []
        self._hooked_filter: Optional[str] = None
        self._selected = compile_filter("")  # the hooked filter's predicate over (path, class name)
        self._paths = {module: path for path, module in model.named_modules()}
        # A module object registered under several parents (sglang builds one rotary_emb per
        # shape and gives it to every layer) is named after the parent whose call it runs in.
        # module -> ({the path of each of its parents and their ancestors: its name under it}, its names)
        self._shared: Dict[torch.nn.Module, tuple] = {}
        try:
            every_path = list(model.named_modules(remove_duplicate=False))
        except RecursionError:  # a module that contains itself: each keeps its first name
            every_path = []
        for path, module in every_path:
            if path != self._paths.get(module):
                under, names = self._shared.setdefault(
                    module, (_names_under(self._paths[module]), {self._paths[module]})
                )
                names.add(path)
                for prefix, name in _names_under(path).items():
                    under.setdefault(prefix, name)
        # The modules whose open call places a shared module's call: hooked whatever the filter
        # selects, so a filter that leaves layer k out still names (and leaves out) its call.
        modules_at = dict(every_path)
        self._holders = {
            modules_at[prefix] for under, _ in self._shared.values() for prefix in under if prefix in modules_at
        }
        self._cleaned: set = set()
        self._cleanup_pending: set = set()  # experiments whose next pass empties the rank folder first
        self._writer = PassWriter(config.queue_bytes, config.max_bytes, config.min_free_bytes)
        # DUMPER_GRAPH_BUFFER_BYTES: forwards captured into a CUDA graph are recorded (graphs.py)
        self._graphs = GraphDumps(self, config.graph_buffer_bytes) if config.graph_buffer_bytes else None
        self._seq_next: Dict[tuple, int] = {}  # (exp dir, seq) -> next position the dump lacks
        self._endpoint = None
        self._original_forward = model.forward
        self._own_forward = model.__dict__.get("forward")  # the user's own patch of this instance, kept on remove
        self._pass_thread: Optional[int] = None  # the thread whose forward is being dumped
        self._claim = threading.Lock()  # taken to claim a pass for a thread
        self._removed = False
        self._warned: set = set()  # warnings given once
        # an engine's outputs whose rows are not its token rows though their count is (None: none known)
        self._rows_not_aligned = getattr(adapter, "rows_not_aligned", None)
        # (module path, call index) -> (call name, its first input's name, its first output's):
        # the same few hundred names every step, formatted once
        self._call_names: Dict[tuple, tuple] = {}
        self._plans = passplan.Plans()  # fingerprint passes that repeat a traced one's calls
        self._wrap_root()
        self._announce()

    def start_endpoint(self, world_size: int = 1) -> None:
        """Serve run-time control on 127.0.0.1 for a numeric DUMPER_SERVER_PORT."""
        port = self.config.server_port_parsed
        if isinstance(port, int) and self._endpoint is None:
            from .control import start_endpoint

            self._endpoint = start_endpoint(self, port, self.rank, world_size)

    # --- public API -----------------------------------------------------------------------
    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def _check_installed(self) -> None:
        if self._removed:
            raise RuntimeError("dumper: this handle was removed; install the dumper again to dump")

    def configure(self, **changes) -> dict:
        """Change settings at run time (e.g. enable=True, exp_name="decode"); next pass on."""
        self._check_installed()
        if "exp_name" in changes and changes["exp_name"] is not None:
            check_exp_name(changes["exp_name"])
        if changes.get("graph_buffer_bytes") not in (None, self.config.graph_buffer_bytes):
            raise ConfigError(
                "graph_buffer_bytes is fixed at install (DUMPER_GRAPH_BUFFER_BYTES); install again to change it"
            )
        with self._lock:
            new = self.config.replace(**{k: v for k, v in changes.items() if v is not None})
            if (
                new.queue_bytes != self.config.queue_bytes
                or new.max_bytes != self.config.max_bytes
                or new.min_free_bytes != self.config.min_free_bytes
            ):
                self._writer.queue_bytes = max(new.queue_bytes, 1)
                self._writer.max_bytes = new.max_bytes
                self._writer.min_free_bytes = new.min_free_bytes
            if new.exp_name != self.config.exp_name or (new.enable and not self.config.enable):
                # A new experiment may be written even after an earlier one hit a limit.
                self._writer.stopped_reason = None
            old, self.config = self.config, new
        if old.exp_name and (new.exp_name != old.exp_name or (old.enable and not new.enable)):
            # The user is done with that experiment (the sglang workflow switches exp_name, then
            # disables): finish it, so the analyzer sees a closed, whole dump.
            self._writer.finish(os.path.join(old.dir, old.exp_name))
        self._announce()
        return self.state()

    def reset(self) -> dict:
        """Flush, disable, and forget the pass counters (sglang's /dumper/reset)."""
        self._check_installed()
        if self.config.exp_name:
            self._writer.finish(os.path.join(self.config.dir, self.config.exp_name))
        with self._lock:
            self.config = self.config.replace(enable=False)
            self.step = 0
            self.passes_dumped = 0
            self._cleaned.clear()
            self._seq_next.clear()
        return self.state()

    def state(self) -> dict:
        cfg = self.config
        return {
            "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            "rank": self.rank,
            "step": self.step,
            "passes_dumped": self.passes_dumped,
            "bytes_written": self._writer.bytes_written,
            "passes_written": self._writer.passes_written,
            "passes_planned": self._plans.followed,  # fingerprint passes that followed a plan (passplan.py)
            "stopped": self._writer.stopped_reason,
            "engine": self.adapter.engine,
        }

    # --- CUDA graphs (graphs.py) -------------------------------------------------------------
    def _graph_dumps(self) -> GraphDumps:
        self._check_installed()
        if self._graphs is None:
            raise ConfigError(
                "dumping CUDA graph replays needs DUMPER_GRAPH_BUFFER_BYTES > 0 at install (the static "
                "buffers the graph copies into)"
            )
        return self._graphs

    def capture(self, graph, **graph_kwargs):
        """``with handle.capture(g): out = model(...)``: torch.cuda.graph(g, **graph_kwargs), the
        forwards it captures recorded into static buffers bound to ``g``."""
        return self._graph_dumps().capture(graph, **graph_kwargs)

    def graph_recording(self, key):
        """Bind the forwards captured inside (by an engine's own capture) to ``key``."""
        return self._graph_dumps().graph_recording(key)

    def replay(self, graph, batch_rows: Optional[int] = None) -> None:
        """``graph.replay()``, then a pass file per recorded forward, with ``batch_rows`` real
        batch entries (the rest are padding, trimmed); metadata from the graph's static inputs."""
        self._graph_dumps().replay(graph, batch_rows)

    def before_replay(self, key, *args, info=None, **kwargs) -> None:
        """Read a replay's pass metadata before it runs: from ``info`` (a PassInfo), else the
        adapter reading these forward arguments, else the captured static inputs."""
        self._graph_dumps().before_replay(key, args, kwargs, info)

    def after_replay(self, key, batch_rows: Optional[int] = None, info=None) -> int:
        """Write the replay that just ran (one pass per recorded forward); returns passes queued."""
        return self._graph_dumps().after_replay(key, batch_rows, info)

    def flush(self) -> None:
        """Wait until every dumped pass is on disk."""
        self._writer.flush()

    def remove(self) -> None:
        """Detach every hook, restore the root forward, and finish writing. Once: a second call
        must not take down a dumper installed on the model since."""
        if self._removed:
            return
        if self._endpoint is not None:
            self._endpoint.shutdown()
            self._endpoint.server_close()
            self._endpoint = None
        self._detach_hooks()
        getattr(self.adapter, "detach", lambda model: None)(self.model)
        self.model.__dict__.pop("_dumpdiff_dumper", None)
        if self._own_forward is not None:
            self.model.forward = self._own_forward
        elif self.model.__dict__.get("forward") is not None:
            del self.model.forward
        self._removed = True
        self._writer.close()
        self._report_sizes()

    # --- root wrapper: pass boundaries ----------------------------------------------------
    def _wrap_root(self) -> None:
        original = self._original_forward

        def dumped(args, kwargs):
            if capturing():  # hooks may not copy to the host inside a capture: graphs.py records instead
                self._warn_once(
                    "capture",
                    "dumper: a forward captured into a CUDA graph runs undumped, and so do its replays; "
                    "set DUMPER_GRAPH_BUFFER_BYTES to record it (docs/configuration.md)",
                )
                return original(*args, **kwargs)
            me = threading.get_ident()
            with self._claim:  # the pass is this thread's before the adapter runs (it may let go of the GIL)
                mine = self._pass_thread is None
                if mine:
                    self._pass_thread = me
            if not mine:
                return undumped(args, kwargs)
            try:
                if not self._begin_pass(args, kwargs):
                    self._pass_thread = None
                    return original(*args, **kwargs)
            except BaseException:
                self._pass = self._pass_thread = None
                raise
            # The pass's metadata (thousands of small containers) lives until the pass ends; the
            # collector, run every 700 new containers, would push it into the oldest generation,
            # whose collections walk every object of the process (hundreds of thousands with
            # torch imported). Paused for the pass, it runs once after it, when the metadata is
            # a generation younger and mostly written and freed before it could get older.
            collecting = gc.isenabled()
            if collecting:
                gc.disable()
            try:
                try:
                    output = original(*args, **kwargs)
                except BaseException:
                    self._pass = self._pass_thread = None
                    raise
                self._end_pass(output)
            finally:
                if collecting:
                    gc.enable()
            return output

        def undumped(args, kwargs):
            self._warn_once(
                "threads",
                "dumper: a forward from a second thread while another thread's pass is "
                "dumped runs undumped (one pass at a time)",
            )
            return original(*args, **kwargs)

        @functools.wraps(original)
        def forward(*args, **kwargs):
            owner = self._pass_thread
            if owner is None:
                if self._graphs is not None and capturing():
                    return self._graphs.captured_forward(original, args, kwargs)
                self.step += 1  # the engine step, counted even while idle
            elif owner != threading.get_ident():
                return undumped(args, kwargs)
            if not self._active() or owner is not None:  # owner: this thread's pass calls the root again
                if self._hook_handles and owner is None:
                    self._detach_hooks()  # disabled again after a dump: back to one flag check
                return original(*args, **kwargs)
            return eager(args, kwargs) if _compiling() else dumped(args, kwargs)

        eager = _outside_compile(dumped)
        self.model.forward = forward

    def _active(self) -> bool:
        cfg = self.config
        return cfg.enable and cfg.non_intrusive_mode != "off" and not self._writer.stopped_reason

    def _begin_pass(self, args, kwargs) -> bool:
        """Open a pass; False when the adapter cannot describe this forward (it then runs undumped:
        the dumper never makes a model call fail)."""
        cfg = self.config
        try:
            info = self.adapter.pass_info(self.model, args, kwargs)
        except WarmupPass:
            return False
        except UndescribedPass as exc:
            self._warn_once("undescribed", f"dumper: forward not dumped: {exc}")
            return False
        except Exception as exc:  # the adapter's own failure on a forward it did not expect: never the model's
            self._warn_once(
                "adapter-failed",
                f"dumper: forward not dumped: the {type(self.adapter).__name__} could "
                f"not describe this call ({type(exc).__name__}: {exc}); pass an adapter that can "
                "(docs/models-and-engines.md: any other torch.nn.Module)",
            )
            return False
        exp_dir = self._exp_dir()  # fixed for the whole pass, whatever a control thread changes
        self._fill_prefixes(info, exp_dir)
        kept = info.kept_rows(parse_positions(cfg.positions), cfg.last_rows)
        carried, every = cfg.row_prints()
        current = self._pass = PassState(
            info, kept, exp_dir, cfg.non_intrusive_mode, PassPrints() if carried else None, every
        )
        if cfg.non_intrusive_mode in HOOKED_MODES:
            if self._hooked_filter != cfg.filter:
                self._detach_hooks()
                self._attach_hooks(cfg.filter)
            if cfg.non_intrusive_mode == "fingerprint" and kept is None:
                self._plan_pass(current, (cfg.filter, every))
            if compile_filter(cfg.filter)(fmt.ROOT_PATH, type(self.model).__name__):
                self._pre(self.model, args, kwargs)
        else:
            self._detach_hooks()
        return True

    def _plan_pass(self, current: PassState, settings: tuple) -> None:
        """Have the pass follow the plan of its structure (passplan.py), or be traced to make one:
        the settings and the token layout a tensor's metadata depends on beside its shape."""
        info = current.info
        key = current.plan_key = settings + (tuple(info.token_shape), len(info.ids), len(info.last_rows))
        plan = self._plans.find(key)
        if plan is not None:
            plan.start(current, self._describe)
        elif self._plans.tracing(key):
            current.trace = passplan.Trace()

    def _fill_prefixes(self, info: PassInfo, exp_dir: str) -> None:
        """Record a sequence's earlier token ids when this dump does not hold them already
        (a prefix-cache hit, or dumping enabled mid-request), so rows stay alignable."""
        for seq, (first, end) in info.first_positions().items():
            key = (exp_dir, seq)
            if first > 0 and self._seq_next.get(key) != first and seq in info.history:
                ids = list(info.history[seq]())[:first]
                if len(ids) == first:
                    info.prefix_ids[seq] = ids
            self._seq_next[key] = end

    def _end_pass(self, output) -> None:
        current = self._pass
        plan = current.plan
        if plan is not None:
            if plan.next_is_post_of(current, self.model):
                self._post(self.model, (), {}, output)
            if current.plan is not None and current.plan_at < plan.count:  # calls the plan has left
                self._leave_plan(current)
        if current.mode in HOOKED_MODES and current.plan is None and any(c.module == "" for c in current.nesting):
            self._post(self.model, (), {}, output)
        self.adapter.after_pass(self.model, current.info, output)
        self._pass = self._pass_thread = None
        exp_dir = current.exp_dir
        meta = current.info.to_meta()
        calls = (
            current.plan.calls_meta_of(current) if current.plan is not None else [c.to_meta() for c in current.calls]
        )
        meta.update(step=self.step, rank=self.rank, calls=calls, kept_rows=current.kept_rows, dump_mode=current.mode)
        trace = current.trace
        if current.prints is not None:
            if current.plan is not None:
                current.plan.finish(current)
                self._plans.followed_to_the_end(current.plan_key)
            elif trace is not None and current.prints.worked:  # rows printed mid-pass: too large a pass to plan
                trace = None
            table = current.prints.finish()
            if table is not None:
                current.tensors[fmt.ROWPRINTS_TENSOR] = table
                current.cuda_used |= current.prints.on_cuda
                meta["rowprint"] = rowprint.VERSION
        if trace is not None and trace.ok:
            self._plans.add(current.plan_key, trace, calls)
        if current.plan_pool is not None:  # its print kernels, queued by now, read the pool
            current.plan_pool.read()
        ready = None
        if current.cuda_used:
            ready = torch.cuda.Event()
            ready.record()
        self._writer.write_run_info(exp_dir, self._run_info)
        cleanup = exp_dir in self._cleanup_pending
        self._cleanup_pending.discard(exp_dir)
        if self._writer.submit(PassRecord(exp_dir, self.rank, meta, current.tensors, ready, cleanup=cleanup)):
            self.passes_dumped += 1
        if self.config.non_intrusive_mode == "core":
            self._warn_once(
                "core",
                "dumper: DUMPER_NON_INTRUSIVE_MODE=core writes pass metadata only (token ids, "
                "positions, sequences), no module tensors; set it to 'all' to localize a divergence",
            )

    def _exp_dir(self) -> str:
        cfg = self.config
        if not cfg.exp_name:
            self.config = cfg = cfg.replace(exp_name=cfg.resolved_exp_name())
        exp_dir = os.path.join(cfg.dir, cfg.exp_name)
        if cfg.cleanup_previous and exp_dir not in self._cleaned:
            # The rank folder is emptied by the writer once it holds the folder's lock (a live
            # writer's dump is never wiped); the experiment's own files by rank 0.
            self._cleaned.add(exp_dir)
            self._cleanup_pending.add(exp_dir)
            if self.rank == 0 and os.path.exists(os.path.join(exp_dir, fmt.INCOMPLETE_FILE)):
                os.unlink(os.path.join(exp_dir, fmt.INCOMPLETE_FILE))
            self._writer._run_written.discard(exp_dir)
        return exp_dir

    def _run_info(self) -> dict:
        info = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "engine": self.adapter.engine,
            "model_class": type(self.model).__name__,
            "config": {
                k: getattr(self.config, k)
                for k in ("filter", "non_intrusive_mode", "positions", "last_rows", "fingerprints")
            },
            "versions": _versions(),
        }
        parts = fused_parts(self.model)
        if parts:
            info["parts"] = parts
        info.update(self.adapter.run_info(self.model))
        return info

    # --- module hooks ---------------------------------------------------------------------
    def _attach_hooks(self, filter_text: str) -> None:
        selected = self._selected = compile_filter(filter_text)
        for module in self._paths:
            if module is self.model or not any(selected(name, type(module).__name__) for name in self._names(module)):
                continue
            self._hook_handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._hook_handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        for module in self._holders:
            self._hook_handles.append(module.register_forward_pre_hook(self._enter_holder))
            self._hook_handles.append(module.register_forward_hook(self._leave_holder, always_call=True))
        self._hooked_filter = filter_text

    def _enter_holder(self, module, args) -> None:
        current = self._pass
        if current is not None and self._pass_thread == threading.get_ident():
            current.holders.append((module, self._name_of(current, module)))

    def _leave_holder(self, module, args, output) -> None:
        current = self._pass
        if current is not None and self._pass_thread == threading.get_ident():
            for at in range(len(current.holders) - 1, -1, -1):  # the last one: opened by this call
                if current.holders[at][0] is module:
                    del current.holders[at]
                    break

    def _names(self, module):
        """Every path the module is registered under (a shared module has several)."""
        return self._shared[module][1] if module in self._shared else (self._paths.get(module, ""),)

    def _name_of(self, current: PassState, module) -> str:
        """The module's path in this call: a shared module's, under the innermost open holder
        that has one of its paths (a shared block's child then follows the block's layer)."""
        path = self._paths.get(module, "")
        if module in self._shared:
            under = self._shared[module][0]
            path = next((under[name] for _, name in reversed(current.holders) if name in under), path)
        return path

    def _detach_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._hooked_filter = None
        self._plans.clear()

    def _leave_plan(self, current: PassState) -> None:
        """The pass differs from its plan at the plan's next event: on with the general hooks."""
        current.plan.leave(current)
        self._plans.missed(current.plan_key)

    def _pre(self, module, args, kwargs) -> None:
        current = self._pass
        if current is None or self._pass_thread != threading.get_ident():
            return
        path = None
        if module in self._shared:
            path = self._name_of(current, module)  # under the innermost open holder
            if not self._selected(path, type(module).__name__):  # hooked for another of its names
                if current.plan is not None:  # its post-hook must not take it for the plan's next event
                    current.plan_unopened[module] = current.plan_unopened.get(module, 0) + 1
                return
        if current.plan is not None:
            if current.plan.pre(current, module, path, args, kwargs):
                return
            self._leave_plan(current)
        if path is None:
            path = self._paths.get(module, "")
        index = current.counts.get(path, 0)
        current.counts[path] = index + 1
        names = self._call_names.get((path, index))
        if names is None:
            name = fmt.call_name(path, index)
            names = self._call_names[(path, index)] = (
                name,
                fmt.tensor_name(name, "in", "0"),
                fmt.tensor_name(name, "out", "0"),
            )
        call = Call(names, path, type(module).__name__, current.order, module)
        current.order += 1
        current.calls.append(call)
        current.nesting.append(call)
        if not kwargs and len(args) == 1 and type(args[0]) in capture.PLAIN_TENSORS:  # most calls: one tensor
            if current.trace is not None:
                current.trace.event(False, module, path, call)
            self._capture_tensor(current, call, names[1], args[0])
        else:
            leaves = capture.call_inputs(args, kwargs)
            if current.trace is not None:
                current.trace.event(False, module, path, call, leaves)
            self._capture(current, call, "in", leaves)

    def _post(self, module, args, kwargs, output) -> None:
        current = self._pass
        if current is None or self._pass_thread != threading.get_ident():
            return
        if current.plan is not None:
            if current.plan.post(current, module, output):
                return
            if current.plan_unopened.get(module):  # a call its pre-hook did not open
                current.plan_unopened[module] -= 1
                return
            self._leave_plan(current)
        # its innermost open call, under whichever of its names its pre-hook chose: the last one
        # open, unless a call inside it ended without its post-hook
        nesting = current.nesting
        if nesting and nesting[-1].obj is module:  # the usual case: the call just opened
            call = nesting.pop()
        else:
            names = self._names(module)
            call = next((c for c in reversed(nesting) if c.module in names), None)
            if call is None:
                return
            nesting.remove(call)
        call.post = current.order
        current.order += 1
        if type(output) in capture.PLAIN_TENSORS:  # most calls: one tensor
            if current.trace is not None:
                current.trace.event(True, module, None, call)
            self._capture_tensor(current, call, call.names[2], output)
        else:
            leaves = capture.call_outputs(output)
            if current.trace is not None:
                current.trace.event(True, module, None, call, leaves)
            self._capture(current, call, "out", leaves)

    def _capture(self, current: PassState, call: Call, io: str, leaves) -> None:
        trace = current.trace
        for slot, value in leaves:
            if isinstance(value, torch.Tensor):
                self._capture_tensor(current, call, fmt.tensor_name(call.name, io, slot), value)
            elif isinstance(value, capture.JSON_SCALARS):
                key = f"{io}.{slot}"
                stored = call.values[key] = value if not isinstance(value, float) or value == value else str(value)
                if trace is not None:
                    trace.value(key, value, stored)
            else:
                key = f"{io}.{slot}"
                said = call.skipped[key] = type(value).__name__
                if trace is not None:
                    trace.other(key, value, said)

    def _capture_tensor(self, current: PassState, call: Call, name: str, tensor: torch.Tensor) -> None:
        # Runs for every tensor of every hooked call (hundreds a decode step, on the model's
        # thread): what depends on the shape alone is worked out once per pass (capture.Layout).
        trace = current.trace  # passplan.py: how each tensor is handled, when this pass is traced
        seen_object = current.seen_objects.get(id(tensor))
        if seen_object is not None:  # half a step's tensors: the very object an earlier call passed on
            ref, key, meta = seen_object
            if ref() is tensor and key == capture.storage_key(tensor):  # unchanged since
                call.tensors[name] = meta  # an alias of its first capture
                if trace is not None:
                    trace.alias(name, meta, tensor, True, None)
                return
        if type(tensor) not in capture.PLAIN_TENSORS:  # a wrapper (DTensor, torchao): no plain storage
            said = call.skipped[name] = f"tensor subclass {type(tensor).__name__}"
            if trace is not None:
                trace.other(name, tensor, said)
            return
        dtype = tensor.dtype
        stored = _STORED.get(dtype)
        if stored is None or tensor.layout != torch.strided or tensor.is_meta:
            said = call.skipped[name] = f"tensor layout={tensor.layout} dtype={dtype} device={tensor.device}"
            if trace is not None:
                trace.other(name, tensor, said, (dtype, tensor.layout, tensor.device))
            return
        if current.recording is not None and not tensor.is_cuda and capturing():
            # a graph replays device work only: a slot would keep the capture's values forever
            call.skipped[name] = "host tensor in a CUDA graph capture (a replay does not recompute it)"
            return
        given = tensor
        meta, layout, tensor, per_token, by_object = self._describe(current, call.cls, name, tensor, stored)
        key = capture.storage_key(tensor)  # None: not known to be unchanged (an inference tensor)
        alias, ref = current.seen.get(key, (None, None))  # None is never stored: no alias then
        if alias is not None and ref() is not None:
            meta["alias"] = alias
            call.tensors[name] = meta
            if trace is not None:
                trace.alias(name, meta, given, False, per_token)
            return
        # The weak reference proves the first tensor is still alive: a freed tensor's memory can
        # be handed to a new tensor of the same shape, which must not pass for the old one.
        if key is not None:
            ref = weakref.ref(tensor)
            current.seen[key] = (name, ref)
            if by_object:  # its later captures as this same object, unchanged, are told by identity
                current.seen_objects[id(tensor)] = (ref, key, dict(meta, alias=name))
        data, fresh = tensor, False
        if current.kept_index is not None and layout.dims is not None and layout.rows == "all":
            data, fresh = capture.select_rows(tensor, layout.dims, _kept_index_on(current, tensor.device)), True
            meta["selected"] = True
        elif current.kept_index is not None and layout.dims is not None:
            meta["selected"] = False  # one row per sequence: small, kept whole
        call.tensors[name] = meta
        staged = None
        if current.prints is not None and (current.print_host_tensors or data.is_cuda):
            staged = self._stage_print(current, meta, data, layout)
        if trace is not None:
            trace.new(name, meta, given, per_token, layout, staged, by_object)
        if current.mode != "fingerprint":
            if current.recording is not None:  # captured into a CUDA graph: a static slot, no host copy
                current.recording.record(name, data)
            else:
                current.tensors[name] = self._copy_off(current, data, fresh)

    def _describe(self, current: PassState, cls: str, name: str, tensor: torch.Tensor, stored: str) -> tuple:
        """A plain tensor's metadata in this pass (before any alias, row selection or print
        range), its Layout, the tensor as stored (a norm's per-head rows as a [T, k, ...] view),
        the k of that view (None: none), and whether a later capture of the same object may be
        told by its identity (not a norm's per-head view, nor where the engine's adapter decides
        a tensor's rows by its name)."""
        shape = tensor.shape
        layout = current.layouts.get(shape)  # a pass meets few shapes, each many times
        if layout is None:
            layout = current.layouts[shape] = current.layout(shape)
        if layout.dims is not None and self._rows_not_aligned is not None:
            shifted = self._rows_not_aligned(cls, name)
            if shifted:
                layout = capture.Layout(shape, None, None, shifted)
        held_as = per_token = None
        if layout.dims is None:
            per_token = capture.rows_per_token(shape, current.info.token_shape, cls)
            if per_token:  # stored as [T, k, ...] (a view): one row per token row, like any other tensor
                held_as, tensor = layout.shape, tensor.unflatten(0, (-1, per_token))
                layout = current.layout(tensor.shape, ([0], "all", ""))
            per_token = per_token or None
        meta = {"shape": layout.shape, "dtype": stored, "token_dims": layout.token_dims, "rows": layout.rows}
        if layout.dims is None:
            meta["why"] = layout.why
        if held_as is not None:
            meta["held_as"] = held_as
        by_object = layout.dims is not None and held_as is None and self._rows_not_aligned is None
        return meta, layout, tensor, per_token, by_object

    def _stage_print(self, current: PassState, meta: dict, data: torch.Tensor, layout: capture.Layout):
        """Stage the tensor's rows for their fingerprints, laid out as the analyzer reads a stored
        tensor's rows (analyzer/index/rowplan.py): selected rows as they are, token dims flattened to the
        front, or the whole tensor as one row where it has none or their count is not the pass's."""
        if meta.get("selected"):
            return current.prints.add(meta, rowprint.as_rows(data, [0]))
        if layout.print_shape is None:
            return current.prints.add(meta, rowprint.as_rows(data, layout.print_dims))
        return current.prints.add(meta, data, layout.print_shape)  # token dims leading: data.reshape(print_shape)

    def _copy_off(self, current: PassState, tensor: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """A private host copy of ``tensor``; ``fresh``: it is already a private copy (selected rows)."""
        # Back-pressure before the host memory is taken: waits while earlier passes still queued
        # and this pass's copies would exceed DUMPER_QUEUE_BYTES (one pass is always admitted).
        self._writer.reserve(tensor.numel() * tensor.element_size(), current)
        if tensor.is_cuda:
            # An async copy into pinned host memory on the producing stream: ordered after the
            # kernel that wrote it and before any in-place kernel that runs later. The pinned
            # block comes from torch's caching host allocator, reused pass after pass.
            current.cuda_used = True
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return host
        if fresh and tensor.is_contiguous():
            return tensor  # index_select already copied the kept rows: no second copy
        return capture.snapshot(tensor)

    # --- logging --------------------------------------------------------------------------
    def _announce(self) -> None:
        cfg = self.config
        where = os.path.join(cfg.dir, cfg.exp_name or "<dump_date_time>")
        log.info(
            "dumper: %s, mode=%s, filter='%s' -> %s",
            "ENABLED" if cfg.enable else "installed, idle",
            cfg.non_intrusive_mode,
            cfg.filter or "(all modules)",
            where,
        )
        if cfg.filter and cfg.non_intrusive_mode in HOOKED_MODES:
            self._check_filter(cfg.filter)

    def _check_filter(self, filter_text: str) -> None:
        """Warn, at install or when the filter changes (before any hook runs), about a filter whose
        dump cannot be localized: one selecting no module, or one leaving out the embedding."""
        if ("filter", filter_text) in self._warned:
            return
        self._warned.add(("filter", filter_text))
        selected = compile_filter(filter_text)
        chosen = {
            module
            for module, path in self._paths.items()
            if selected(path if module is not self.model else fmt.ROOT_PATH, type(module).__name__)
        }
        model_class = type(self.model).__name__
        if not chosen:
            log.warning(
                "dumper: DUMPER_FILTER='%s' matches no module of %s; nothing but pass metadata will be dumped",
                filter_text,
                model_class,
            )
            return
        embeddings = _embedding_modules(self.model)
        if embeddings and not chosen & embeddings:
            names = ", ".join(sorted(self._paths[module] for module in embeddings))
            log.warning(
                "dumper: DUMPER_FILTER='%s' leaves out the embedding (%s) of %s; the analyzer needs its output "
                "to prove the alignment",
                filter_text,
                names,
                model_class,
            )

    def _report_sizes(self) -> None:
        if self._writer.passes_written:
            log.info("dumper: wrote %d passes, %.1f MB", self._writer.passes_written, self._writer.bytes_written / 1e6)


def _embedding_modules(model: torch.nn.Module) -> set:
    """The modules that turn token ids into vectors: the model's input embedding where it names
    one (HF and sglang models do), else every nn.Embedding."""
    try:
        named = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except Exception:  # noqa: BLE001 - HF raises NotImplementedError where a model names none
        named = None
    if isinstance(named, torch.nn.Module) and any(named is module for module in model.modules()):
        return {named}
    return {module for module in model.modules() if isinstance(module, torch.nn.Embedding)}


def _kept_index_on(current: PassState, device: torch.device) -> torch.Tensor:
    """The pass's kept-row index on ``device``, copied there once per pass: a pageable
    host-to-device copy per captured tensor would make the host wait for the GPU each time."""
    index = current.kept_index
    if index.device == device:
        return index
    cache = current.kept_index_by_device
    if device not in cache:
        cache[device] = index.to(device)
    return cache[device]


def _outside_compile(func):
    """``func`` made to run eagerly when torch.compile traces it: hooks, copies and file writes
    are not traced (a compiled model is dumped as it runs eagerly; an idle dumper stays in the
    graph). torch._disable_dynamo imports dynamo only when first called, which only tracing does:
    torch.compiler.disable imported it at install (0.7 s in every engine process)."""
    disable = getattr(torch, "_disable_dynamo", None)
    return disable(func) if disable is not None else func


def _compiling() -> bool:
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check and check())


def install(model: torch.nn.Module, config: Optional[DumperConfig] = None, adapter=None) -> Dumper:
    """Install dump hooks on ``model``; with no config, DUMPER_* variables decide everything."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "dumper: a TorchScript module takes no Python hooks; install the dumper on the "
            "nn.Module before torch.jit.script"
        )
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise TypeError(
            "dumper: the model is already torch.compile'd; install the dumper on the module first "
            "and compile after (dumped passes then run eagerly), or install it on model._orig_mod"
        )
    if config is None:
        config = DumperConfig.from_env()
    if not isinstance(config, DumperConfig):
        raise ConfigError(f"config must be a dumper.DumperConfig, not {type(config).__name__}")
    if getattr(model, "_dumpdiff_dumper", None) is not None:
        raise RuntimeError("dumper already installed on this model; call .remove() on the first handle")
    if adapter is None:
        from .engines import pick_adapter

        adapter = pick_adapter(model)
    dumper = Dumper(model, config, adapter)
    model._dumpdiff_dumper = dumper
    getattr(adapter, "attach", lambda model: None)(model)
    try:
        dumper.start_endpoint(_world_size())
    except BaseException:
        dumper.remove()  # the model as it was: a failed install leaves nothing behind
        raise
    return dumper


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    import importlib.metadata as md

    found = {}
    for name in ("torch", "transformers", "sglang", "dumpdiff"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def fused_parts(model) -> dict:
    """Module path -> the widths, on this rank, of the parts a fused projection's output holds
    side by side (sglang's and vLLM's qkv_proj: q, k, v; gate_up_proj: gate, up), read from
    the ``output_partition_sizes`` both engines keep on their column-parallel linears. An
    analyzer cuts the output into the unfused modules' outputs with them, per rank."""
    parts = {}
    for name, module in model.named_modules():
        sizes = getattr(module, "output_partition_sizes", None)
        if isinstance(sizes, (list, tuple)) and len(sizes) > 1 and all(isinstance(s, int) for s in sizes):
            parts[name] = [int(s) for s in sizes]
    return parts
