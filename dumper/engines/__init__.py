"""Engine adapters: how to read one forward pass's token rows from an engine's own arguments.

An adapter has ``engine`` (a name), ``pass_info(model, args, kwargs) -> PassInfo``,
``after_pass(model, info, output)`` and ``run_info(model) -> dict``.
"""


def pick_adapter(model):
    """HF transformers models get the HF adapter; any other module the generic one."""
    from .generic import GenericAdapter
    from .hf import HFAdapter, is_hf_model

    return HFAdapter(model) if is_hf_model(model) else GenericAdapter(model)
