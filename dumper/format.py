"""The dump format: file names, version and metadata keys, shared by writer and reader.

This is the one module the analyzer imports from the dumper package; it holds no torch code.

Layout of one experiment (one dump)::

    <DUMPER_DIR>/<exp_name>/run.json                 RUN_FILE: format version, engine, model, config
    <DUMPER_DIR>/<exp_name>/rank<R>/manifest.jsonl   MANIFEST_FILE: one JSON line per committed pass
    <DUMPER_DIR>/<exp_name>/rank<R>/pass-<N>.safetensors

A pass file holds the tensors of one forward pass; its safetensors header metadata holds one
key, PASS_META_KEY, whose value is the pass metadata as JSON (see ``PassMeta`` keys below).
A pass file not named in the manifest does not exist for readers: the writer renames it into
place only once complete and appends the manifest line after the rename.
"""

from __future__ import annotations

import re

FORMAT_NAME = "dumpdiff"
FORMAT_VERSION = 1

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
INCOMPLETE_FILE = "INCOMPLETE"  # written when dumping stopped early (disk guard, error)
PASS_META_KEY = "dumpdiff.pass"
# A pass's row fingerprints (dumper/rowprint.py), when the dumper computed them: one [3, rows]
# int64 tensor (fingerprint; largest finite |x| as float64 bits, NaN for integer rows; NaN/inf
# count). A tensor's entry "print": [first, count] places its stored rows in it. In a dump of
# mode "fingerprint" it is the only tensor of a pass file; the pass metadata's "rowprint" is the
# fingerprint's version.
ROWPRINTS_TENSOR = "~rowprints"
RANK_DIR_RE = re.compile(r"^rank(\d+)$")


def rank_dir_name(rank: int) -> str:
    return f"rank{rank}"


def pass_file_name(pass_id: int) -> str:
    return f"pass-{pass_id:06d}.safetensors"


# --- tensor names -------------------------------------------------------------------------
# "<module path>#<call index>.<in|out>.<slot>", e.g. "model.layers.0.mlp#0.in.0".
# The module path of the root module is "" and is written as "<root>".
ROOT_PATH = "<root>"
TENSOR_NAME_RE = re.compile(
    r"^(?P<call>(?P<module>.+)#(?P<index>\d+))\.(?P<io>in|out)(?:\.(?P<slot>.*))?\Z", re.S
)  # re.S, \Z: a module name may hold a newline


def call_name(module_path: str, call_index: int) -> str:
    return f"{module_path or ROOT_PATH}#{call_index}"


def tensor_name(call: str, io: str, slot: str) -> str:
    return f"{call}.{io}.{slot}" if slot else f"{call}.{io}"


# --- pass metadata keys (JSON object stored under PASS_META_KEY) ----------------------------
# pass        int    pass id, unique within a rank of a dump
# step        int    engine step / forward counter of the process
# rank        int
# mode        str    "prefill" | "extend" | "decode" | "mixed" | "unknown"
# tokens      dict   one list per key, one entry per token row of the pass, in row order:
#                      ids (int), pos (int), seq (str, "" for padding rows), valid (bool)
# seqs        list   per sequence in the pass: {"seq", "rows": [first, last+1], "prefix_ids"?}
#                    prefix_ids: token ids before the pass's first row of that sequence, when
#                    the engine knows them (a prefix-cache hit) and the dump may lack them.
# token_shape list   how token rows are laid out in activations: [B, S] (HF) or [T] (flat)
# calls      list    one per hooked call: {"call", "module", "cls", "pre", "post",
#                      "tensors": {tensor name: TensorMeta}, "values": {slot: JSON scalar},
#                      "skipped": {slot: type name}}
# TensorMeta: {"shape", "dtype", "token_dims": [dims] | None, "rows": "all" | "last" | None,
#              "alias": tensor name | None, "why": reason when token_dims is None}
#   token_dims: the dims that, moved to the front and flattened, give one row per token row.
#   rows "last": the tensor has one row per sequence, its last token row (e.g. logits kept
#   only for the last position).  alias: identical to an earlier captured tensor of the same
#   pass (same storage, same version), stored once under that name.  held_as: the shape the
#   module saw, when it is not "shape": a flat engine's per-head norm gets [T*k, D], k rows
#   per token row in token order, and is stored as the view [T, k, D] (token_dims [0]).
PASS_KEYS = ("pass", "step", "rank", "mode", "tokens", "seqs", "token_shape", "calls")

MODES = ("prefill", "extend", "decode", "mixed", "unknown")

# Element types a pass file holds (the analyzer reads each one, analyzer/dump/dtypes.py); a tensor of
# any other type (complex, quantized, float8 variants without a safetensors code) is recorded
# under the call's "skipped", with its type.
SAFETENSORS_CODES = {  # each stored type's code in a safetensors header
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
STORED_DTYPES = frozenset(SAFETENSORS_CODES)
