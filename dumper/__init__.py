"""dumpdiff's dumper: hooks that write every selected module's inputs and outputs, per pass.

    from dumpdiff import dumper
    handle = dumper.install(model)          # DUMPER_* variables decide; or pass a DumperConfig
    handle.configure(enable=True, exp_name="decode")
    model.generate(...)                     # every forward pass becomes one safetensors file
    handle.remove()

The dumper never imports the analyzer; the analyzer uses only ``format`` and ``rowprint`` (the
row fingerprint both sides must compute alike) from it.
"""

from .config import ConfigError, DumperConfig


def __getattr__(name):
    # The hooks need torch; dumper.format (shared with the analyzer) must not pull it in.
    if name in ("Dumper", "install"):
        from . import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module 'dumpdiff.dumper' has no attribute {name!r}")


__all__ = ["ConfigError", "Dumper", "DumperConfig", "install"]
