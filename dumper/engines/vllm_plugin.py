"""vLLM plugin (entry point group ``vllm.general_plugins``): activation by environment alone.

vLLM calls ``load_plugin`` in every process it starts (API server, engine core, workers). With
no DUMPER_* variable set it returns at once: nothing is installed and nothing costs.

vLLM gives general plugins no call after the model is loaded, so the model is found through
torch's own module-registration hook: the first module with ``compute_logits`` (vLLM's causal
LM classes) that registers a child is the model being built. There, under vLLM's current
config, a compiled or graph-captured model fails start-up with the flag to add; otherwise our
dumper is installed once its weights are loaded (the model runner loading it, found up the
stack, holds each pass's requests) and the hook is removed. No vLLM code is patched: only this
model instance's own methods are shadowed until then. The control endpoint is our own (numeric
DUMPER_SERVER_PORT on 127.0.0.1, rank r on port + r): vLLM's API server has no /dumper route.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("dumper")

_state = {"hook": None, "model": None}


def load_plugin():
    from ..config import ConfigError, DumperConfig, any_dumper_variable

    if not any_dumper_variable():
        return
    config = DumperConfig.from_env()  # a bad value fails start-up with its one-line message
    if config.non_intrusive_mode == "off" or _state["hook"] is not None:
        return
    if config.server_port_parsed == "reuse":
        raise ConfigError(
            "DUMPER_SERVER_PORT=reuse needs a /dumper route on the engine's own port, which vLLM's "
            "API server does not have: set DUMPER_SERVER_PORT to a free port number (e.g. 40000)"
        )
    import torch

    _state["hook"] = torch.nn.modules.module.register_module_module_registration_hook(_on_child_registered)


def _on_child_registered(parent, name, child):
    if _state["model"] is not None or not hasattr(type(parent), "compute_logits"):
        return None
    _state["model"] = parent  # the hook is removed later: torch is iterating over the hooks now
    _refuse_compiled()
    # Instance attributes shadow the class's methods until the model is whole: after its
    # weights load (start-up, so the control endpoint is up before any request), or at its
    # first forward where no loader calls load_weights.
    if hasattr(type(parent), "load_weights"):
        parent.load_weights = _after_load_weights(parent)
    parent.forward = _first_forward(parent)
    return None


def _refuse_compiled():
    from vllm.config.vllm import get_current_vllm_config_or_none

    from .vllm import compile_problem

    problem = compile_problem(get_current_vllm_config_or_none())
    if problem:
        log.error(problem)
        raise RuntimeError(problem)


def _after_load_weights(model):
    def load_weights(*args, **kwargs):
        loaded = type(model).load_weights(model, *args, **kwargs)
        _install_once(model)
        return loaded

    return load_weights


def _first_forward(model):
    def forward(*args, **kwargs):
        _install_once(model)
        return model.forward(*args, **kwargs)

    return forward


def _install_once(model):
    from ..config import DumperConfig
    from ..hooks import install
    from .vllm import VllmAdapter

    if _state["hook"] is not None:
        _state["hook"].remove()
    for shadow in ("load_weights", "forward"):  # back to the class's methods; the dumper wraps forward
        model.__dict__.pop(shadow, None)
    if getattr(model, "_dumpdiff_dumper", None) is not None:
        return
    runner = _calling_runner()
    if runner is None:
        log.warning("dumpdiff: %s was loaded outside a vLLM model runner; not dumped", type(model).__name__)
        return
    dumper = install(model, DumperConfig.from_env(), adapter=VllmAdapter(runner))
    port = dumper.config.server_port_parsed
    log.warning(
        "dumpdiff: dumper installed on %s (rank %s), %s",
        type(model).__name__,
        dumper.rank,
        "enabled"
        if dumper.config.enable
        else f"idle until http://127.0.0.1:{port + dumper.rank}/dumper/configure"
        if port
        else "idle, and with no DUMPER_SERVER_PORT nothing can enable it (set DUMPER_SERVER_PORT=<port>)",
    )


def _calling_runner(depth: int = 32):
    """The model runner up the stack (loading or calling the model): it holds ``input_batch``."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "input_batch") and hasattr(owner, "execute_model"):
            return owner
        frame = frame.f_back
    return None
