"""DUMPER_* configuration: parse, validate, explain.

Names and meanings follow sglang's built-in dumper where they overlap (DUMPER_ENABLE, DUMPER_DIR,
DUMPER_EXP_NAME, DUMPER_FILTER, DUMPER_NON_INTRUSIVE_MODE, DUMPER_CLEANUP_PREVIOUS,
DUMPER_SERVER_PORT), so a user's existing command lines keep working. env.example documents
every variable; ``VARIABLES`` below is the single source of that list.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import time
from typing import Mapping, Optional

log = logging.getLogger("dumper")

MODES = ("off", "core", "all", "fingerprint")
HOOKED_MODES = ("fingerprint", "all")  # modes that hook modules (core writes pass metadata only)
FINGERPRINT_CHOICES = ("auto", "1", "0")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

# name -> (default as written in env.example, one line of meaning)
VARIABLES = {
    "DUMPER_ENABLE": (
        "0",
        "1 dumps from the first forward pass; 0 installs hooks that stay idle until enabled over HTTP or configure()",
    ),
    "DUMPER_DIR": ("/tmp/dumper", "root folder of all dumps; each experiment is a subfolder"),
    "DUMPER_EXP_NAME": ("", "experiment (subfolder) name; empty means dump_<date>_<time>"),
    "DUMPER_FILTER": (
        "",
        "which modules to hook: a regex searched in the module path, or key=regex with key name|layer_id|cls",
    ),
    "DUMPER_NON_INTRUSIVE_MODE": (
        "all",
        "off = nothing, core = pass metadata only (token ids, positions, sequences), "
        "fingerprint = per token row of every selected tensor a fingerprint and its largest |x| and "
        "NaN/inf count, computed on its device (a few bytes per row), all = inputs and outputs of every selected module",
    ),
    "DUMPER_FINGERPRINTS": (
        "0",
        "mode all: also store each tensor's row fingerprints computed on its device, so the index "
        "reads them instead of hashing; auto = for tensors on a GPU, 1 = always, 0 = never",
    ),
    "DUMPER_CLEANUP_PREVIOUS": ("0", "1 deletes an existing experiment folder of the same name before the first write"),
    "DUMPER_SERVER_PORT": (
        "-1",
        "-1 no control endpoint; reuse = the engine's HTTP port (/dumper/*, sglang); a number = own "
        "endpoint on 127.0.0.1, rank r on port + r (vLLM, which has no /dumper route)",
    ),
    "DUMPER_MAX_BYTES": (
        "0",
        "stop dumping once this many bytes are written (0 = no limit); the dump is marked incomplete",
    ),
    "DUMPER_MIN_FREE_BYTES": ("1073741824", "stop dumping when the disk would keep less free space than this"),
    "DUMPER_QUEUE_BYTES": (
        "2147483648",
        "host memory the background writer may hold; forward passes wait (back-pressure) beyond it",
    ),
    "DUMPER_POSITIONS": (
        "",
        "keep only these token positions, e.g. '96:' or '0,5,10:20' (python slice syntax, per sequence)",
    ),
    "DUMPER_GRAPH_BUFFER_BYTES": (
        "0",
        "bytes of static device buffers per device that forwards captured into a CUDA graph copy their "
        "selected tensors into, written after each replay (0 = a captured forward is not dumped)",
    ),
    "DUMPER_LAST_ROWS": (
        "0",
        "keep only the last k token rows of each sequence in a pass (0 = all rows); "
        "for a reference prefill of prompt+output, at least the number of new tokens",
    ),
}

# Variables of sglang's built-in dumper (sglang 0.5.23 DumperConfig) that ours does not read: set
# for that dumper, not misspelt, so never warned about.
SGLANG_ONLY_VARIABLES = frozenset(
    "DUMPER_" + name.upper()
    for name in (
        "enable_output_file",
        "enable_output_console",
        "enable_value",
        "enable_grad",
        "enable_model_value",
        "enable_model_grad",
        "collective_timeout",
        "source_patcher_config",
        "include_parallel_rank_in_filename",
        "grafter_enable",
        "grafter_role",
        "grafter_b2t_filter",
        "grafter_t2b_filter",
        "grafter_master_address",
        "grafter_master_port",
        "grafter_baseline_world_size",
        "grafter_target_world_size",
        "grafter_backend",
        "grafter_group_name",
        "grafter_timeout",
        "grafter_transform_path",
    )
)
_warned_unknown: set = set()  # unknown variables already warned about in this process


class ConfigError(ValueError):
    """A DUMPER_* value that cannot be used; the message is one line naming the variable."""


@dataclasses.dataclass(frozen=True)
class DumperConfig:
    enable: bool = False
    dir: str = "/tmp/dumper"
    exp_name: str = ""
    filter: str = ""
    non_intrusive_mode: str = "all"
    cleanup_previous: bool = False
    server_port: str = "-1"
    max_bytes: int = 0
    min_free_bytes: int = 1 << 30
    queue_bytes: int = 2 << 30
    positions: str = ""
    last_rows: int = 0
    fingerprints: str = "0"  # docs/performance.md says why not auto
    graph_buffer_bytes: int = 0

    def __post_init__(self):
        if self.non_intrusive_mode not in MODES:
            raise ConfigError(_bad("DUMPER_NON_INTRUSIVE_MODE", self.non_intrusive_mode, "one of " + "|".join(MODES)))
        if self.fingerprints not in FINGERPRINT_CHOICES:
            raise ConfigError(_bad("DUMPER_FINGERPRINTS", self.fingerprints, "one of " + "|".join(FINGERPRINT_CHOICES)))
        for name in ("max_bytes", "min_free_bytes", "queue_bytes", "last_rows", "graph_buffer_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(_bad(env_name(name), getattr(self, name), "a whole number >= 0"))
        port = self.server_port
        if port != "reuse" and not (re.fullmatch(r"-1|\d{1,5}", port) and int(port) <= 65535):
            raise ConfigError(_bad("DUMPER_SERVER_PORT", port, "-1, reuse, or a port number up to 65535"))
        if not self.dir.strip():
            raise ConfigError(_bad("DUMPER_DIR", self.dir, "a folder path (empty would write into the current folder)"))
        check_exp_name(self.exp_name, variable="DUMPER_EXP_NAME", allow_empty=True)
        compile_filter(self.filter)
        parse_positions(self.positions)

    @property
    def server_port_parsed(self):
        """None (no endpoint), "reuse", or an int port."""
        if self.server_port == "reuse":
            return "reuse"
        port = int(self.server_port)
        return port if port > 0 else None

    def row_prints(self) -> tuple:
        """(whether a pass computes row prints on the device, whether of host tensors too)."""
        every = self.non_intrusive_mode == "fingerprint" or self.fingerprints == "1"
        return every or (self.non_intrusive_mode == "all" and self.fingerprints == "auto"), every

    def resolved_exp_name(self) -> str:
        return self.exp_name or time.strftime("dump_%Y%m%d_%H%M%S")

    def replace(self, **changes) -> "DumperConfig":
        """A validated copy; strings are parsed as their DUMPER_* variable would be."""
        fields = {f.name: f.default for f in dataclasses.fields(self)}
        unknown = set(changes) - set(fields)
        if unknown:
            raise ConfigError(f"unknown dumper setting(s) {sorted(unknown)}; known: {sorted(fields)}")
        typed = {}
        for name, value in changes.items():
            default = fields[name]
            if isinstance(value, str) and not isinstance(default, str):
                value = parse_value(env_name(name), value, default)
            elif isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, type(default)):
                raise ConfigError(_bad(env_name(name), value, f"a {type(default).__name__}"))
            typed[name] = value
        return dataclasses.replace(self, **typed)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "DumperConfig":
        environ = os.environ if environ is None else environ
        warn_unknown_variables(environ)
        values = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(env_name(field.name))
            if raw is None:
                continue
            values[field.name] = parse_value(env_name(field.name), raw, field.default)
        return cls(**values)


def env_name(field_name: str) -> str:
    return "DUMPER_" + field_name.upper()


def any_dumper_variable(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    warn_unknown_variables(environ)  # DUMPER_ENABLED=1 alone would otherwise leave the plugin silent
    return any(name in environ for name in VARIABLES)


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """One warning line per misspelt DUMPER_* variable (once per process): it would be ignored."""
    for name in sorted(environ):
        if (
            name.startswith("DUMPER_")
            and name not in VARIABLES
            and name not in SGLANG_ONLY_VARIABLES
            and name not in _warned_unknown
        ):
            _warned_unknown.add(name)
            closest = difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.6)
            log.warning(
                "dumper: %s is not a dumper variable and is ignored%s",
                name,
                f"; did you mean {closest[0]}?" if closest else " (env.example lists them)",
            )


def parse_value(variable: str, raw: str, default):
    text = raw.strip()
    if isinstance(default, bool):
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ConfigError(_bad(variable, raw, "1 or 0 (also true/false, yes/no, on/off)"))
    if isinstance(default, int):
        try:
            value = float(text) if re.fullmatch(r"\d+(\.\d*)?(e\d+)?", text, re.I) else int(text)
            if value != int(value):  # 1.9 is not a number of bytes or rows
                raise ValueError(text)
            return int(value)
        except (ValueError, OverflowError):  # OverflowError: 1e400 is inf
            raise ConfigError(_bad(variable, raw, "a whole number of bytes/rows, e.g. 1000000000 or 1e9")) from None
    return text


def _bad(variable: str, value, allowed: str) -> str:
    return f"{variable}={value!r} is not valid: expected {allowed}"


EXP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_exp_name(name: str, variable: str = "exp_name", allow_empty: bool = False) -> str:
    """An experiment name is one plain folder name: it can never lead out of DUMPER_DIR."""
    if allow_empty and name == "":
        return name
    if not isinstance(name, str) or not EXP_NAME_RE.match(name) or name in (".", ".."):
        raise ConfigError(
            _bad(variable, name, "a folder name of letters, digits, '.', '_' or '-' (no '/', max 128 chars)")
        )
    return name


FILTER_KEYS = ("name", "layer_id", "cls")
LAYER_ID_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def compile_filter(text: str):
    """Return a predicate over (module path, class name); '' selects every module."""
    if not text:
        return lambda path, cls: True
    key, sep, pattern = text.partition("=")
    if sep and re.fullmatch(r"\w+", key) and key not in FILTER_KEYS:
        # a regex never needs "word=" (module paths hold no '='): this is a misspelt key
        raise ConfigError(_bad("DUMPER_FILTER", text, f"a regex, or key=regex with key one of {'|'.join(FILTER_KEYS)}"))
    if not sep or key not in FILTER_KEYS:
        key, pattern = "name", text
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(_bad("DUMPER_FILTER", text, f"a valid regular expression ({exc})")) from None
    if key == "cls":
        return lambda path, cls: bool(regex.search(cls))
    if key == "layer_id":

        def by_layer(path, cls):
            match = LAYER_ID_RE.search(path)
            return match is not None and bool(regex.fullmatch(match.group(1)))

        return by_layer
    return lambda path, cls: bool(regex.search(path))


def parse_positions(text: str):
    """'96:' or '0,5,10:20' -> predicate over a position; '' keeps every position."""
    if not text.strip():
        return None
    parts = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d*)(?::(\d*))?", part)
        if not part or not match:
            raise ConfigError(_bad("DUMPER_POSITIONS", text, "positions or ranges like '96:' or '0,5,10:20'"))
        start = int(match.group(1) or 0)
        if match.group(2) is None and ":" not in part:
            parts.append((start, start + 1))
        else:
            end = int(match.group(2)) if match.group(2) else None
            if end is not None and end <= start:  # would keep nothing
                raise ConfigError(_bad("DUMPER_POSITIONS", text, f"ranges whose end is past their start ({part!r})"))
            parts.append((start, end))
    return lambda pos: any(pos >= lo and (hi is None or pos < hi) for lo, hi in parts)
