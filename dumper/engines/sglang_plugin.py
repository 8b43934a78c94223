"""sglang plugin (entry point group ``sglang.srt.plugins``): activation by environment alone.

sglang calls ``load_plugin`` early in every process it starts. With no DUMPER_* variable set it
returns at once: nothing is installed and nothing costs. Otherwise it registers hooks with
sglang's HookRegistry:

- after ``ModelRunner.load_model``: install our dumper on the loaded model (refusing to start on
  CUDA while CUDA graphs would hide the forward passes from Python hooks);
- after ``ForwardBatch.init_new``: remember the batch's requests, so prefix-cache hits can
  record the token ids of the prefix they skipped;
- instead of ``Scheduler.handle_dumper_control``: route sglang's own ``/dumper/{method}`` HTTP
  route (DUMPER_SERVER_PORT=reuse) to our dumper, on every rank.

sglang's built-in dumper reads the same variables; it is switched off here so that nothing is
dumped twice.
"""

from __future__ import annotations

import logging

log = logging.getLogger("dumper")

_dumpers = []  # the dumpers installed in this process (one per ModelRunner)


def load_plugin() -> None:
    from ..config import DumperConfig, any_dumper_variable

    if not any_dumper_variable():
        return
    config = DumperConfig.from_env()  # a bad value fails start-up with its one-line message
    if config.non_intrusive_mode == "off":
        return
    _silence_builtin_dumper()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model", _after_load_model, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", _after_init_new, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_dumper_control", _handle_dumper_control, HookType.REPLACE
    )


def _silence_builtin_dumper() -> None:
    try:
        from sglang.srt.debug_utils.dumper import dumper as builtin
    except ImportError:
        return
    builtin.configure(enable=False, server_port="-1", non_intrusive_mode="off")


def _after_load_model(result, model_runner, *args, **kwargs):
    from ..config import DumperConfig
    from ..hooks import install
    from .sglang import SglangAdapter, cuda_graph_problem

    problem = cuda_graph_problem(model_runner.server_args, getattr(model_runner, "device", "cpu"))
    if problem:
        raise RuntimeError(problem)
    dumper = install(model_runner.model, DumperConfig.from_env(), adapter=SglangAdapter(model_runner))
    _dumpers.append(dumper)
    log.warning(
        "dumpdiff: dumper installed on %s (tp rank %s), %s",
        type(model_runner.model).__name__,
        getattr(model_runner, "tp_rank", 0),
        "enabled"
        if dumper.config.enable
        else "idle until /dumper/configure"
        if dumper.config.server_port_parsed
        else "idle, and with no DUMPER_SERVER_PORT nothing can enable it (set DUMPER_SERVER_PORT=reuse)",
    )
    return result


def _after_init_new(result, *args, **kwargs):
    batch = args[1] if len(args) > 1 else kwargs.get("batch")  # (cls, batch, model_runner)
    reqs = getattr(batch, "reqs", None)
    if reqs is not None and _dumpers and _dumpers[0].config.enable:
        # The model may see a copy of this ForwardBatch, so the requests are kept by request
        # id (only the latest batch's: no request outlives its batch here).
        from .sglang import remember_requests

        remember_requests(reqs)
    return result


def _handle_dumper_control(scheduler, recv_req) -> None:
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    from ..control import handle

    try:
        responses = [handle(d, recv_req.method, recv_req.body or {}) for d in _dumpers]
        rank0 = not _distributed() or _rank() == 0
        output = DumperControlReqOutput(success=True, response=responses if rank0 else [])
    except Exception as exc:  # noqa: BLE001 - reported to the HTTP caller, the server keeps serving
        output = DumperControlReqOutput(success=False, response=[], error=str(exc))
    scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)


def _distributed() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    import torch

    return torch.distributed.get_rank()
