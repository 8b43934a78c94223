"""`dumpdiff repro`: the culprit call's inputs at both shapes, and a script that replays it alone.

The strict culprit is a call whose inputs are bit-identical on some token rows in A and B and
whose output is not. Its inputs in A's pass (the reference: the full batch, M=N) and in B's pass
(e.g. a decode step, M=1) are written to DIR as safetensors, with the dumped outputs, and
DIR/repro.py replays the op on both and says whether the outputs of the same rows match. For
a row-wise op it also runs each reference row alone (M=1): a batch-variant kernel reproduces
with no engine at all.

Known leaf ops (nn.Linear, nn.Embedding, RMSNorm / LayerNorm, activations, torch SDPA) are
replayed by a few lines of torch code; the parameters come from the model (--model: an HF model
dir), since a dump holds activations only. Any other class is rebuilt through the model and
called; a class the model does not build (a module swapped in at run time, an engine's own
class) cannot be replayed from here, and repro says so rather than replay something else.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from dumpdiff.dumper import format as fmt

from ..dump.load import PassFile, open_dump, show
from ..errors import DumpError
from ..index.store import load_indexes
from ..index.table import Index
from ..verdict.align import align, prove
from ..verdict.compare import RowTable, row_table, strict_verdict
from ..verdict.diverge import check_same_model
from .repro_script import runtime, script_text

MAX_ROWS = 64  # token rows of one pass pair replayed and compared
DATA_FILES = ("inputs_a.safetensors", "inputs_b.safetensors", "outputs_a.safetensors", "outputs_b.safetensors")
SCRIPT, WEIGHTS, CALL_JSON = "repro.py", "weights.safetensors", "call.json"

ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELU": "gelu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_new",
    "FastGELUActivation": "gelu_fast",
    "QuickGELUActivation": "quick_gelu",
    "ReLU": "relu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
}
SDPA_CLASSES = {"ScaledDotProductAttention", "SDPA", "SdpaAttention", "SDPAttention"}
ROWWISE = {"linear", "embedding", "rmsnorm_hf", "rmsnorm_torch", "layernorm", "activation"}
NEEDS_PARAMS = {
    "linear": ["weight", "bias?"],
    "embedding": ["weight"],
    "rmsnorm_hf": ["weight"],
    "rmsnorm_torch": ["weight?"],
    "layernorm": ["weight?", "bias?"],
}
KNOWN = "nn.Linear, nn.Embedding, RMSNorm, LayerNorm, activations (SiLU, GELU...), torch SDPA"


def make_repro(
    path_a: str,
    path_b: str,
    out_dir: str,
    model: Optional[str] = None,
    call: Optional[str] = None,
    rank: Optional[int] = None,
    trust_alignment: bool = False,
    allow_mismatch: bool = False,
    progress: bool = True,
) -> dict:
    """Write DIR/{inputs,outputs}_{a,b}.safetensors, call.json and (when it can run) DIR/repro.py
    (+ weights.safetensors). Returns what was written; raises DumpError when no replay is possible."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # checked before the analysis, not after
        raise DumpError(f"--out {show(out_dir)}: is a file; give a folder (created if missing)")
    source = ModelSource(model) if model else None
    target = locate(path_a, path_b, call, rank, trust_alignment, allow_mismatch, progress)
    return write_bundle(out_dir, collect(target), source)


def write_bundle(out_dir: str, captured: dict, source=None) -> dict:
    """Write the data files, then the plan's weights and script; `source` gives modules and
    parameters (a ModelSource, or any object with .path, .module(path, cls), .params(path, sub, dtype))."""
    os.makedirs(out_dir, exist_ok=True)
    for stale in (SCRIPT, WEIGHTS):  # never leave a script from an earlier run next to new inputs
        if os.path.exists(os.path.join(out_dir, stale)):
            os.unlink(os.path.join(out_dir, stale))
    from safetensors.torch import save_file

    for side in ("a", "b"):
        save_file(
            {slot: t.contiguous().clone() for slot, t in captured["inputs"][side].items()},
            os.path.join(out_dir, f"inputs_{side}.safetensors"),
        )
        save_file(
            {"out": captured["outputs"][side].contiguous().clone()},
            os.path.join(out_dir, f"outputs_{side}.safetensors"),
        )
    meta = captured["meta"]
    _write_text(os.path.join(out_dir, CALL_JSON), json.dumps(meta, indent=2, ensure_ascii=True) + "\n")
    plan = plan_replay(captured, source, show(out_dir))
    meta.update(plan["meta"])
    files = [os.path.join(out_dir, f) for f in DATA_FILES + (CALL_JSON,)]
    if plan["params"]:
        save_file({k: v.contiguous().clone() for k, v in plan["params"].items()}, os.path.join(out_dir, WEIGHTS))
        files.append(os.path.join(out_dir, WEIGHTS))
    _write_text(os.path.join(out_dir, CALL_JSON), json.dumps(meta, indent=2, ensure_ascii=True) + "\n")
    _write_text(os.path.join(out_dir, SCRIPT), script_text(meta))
    files.append(os.path.join(out_dir, SCRIPT))
    return {"meta": meta, "files": files, "script": os.path.join(out_dir, SCRIPT)}


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


# ---- which call, which rows ----------------------------------------------------------------


def locate(path_a, path_b, call, rank, trust_alignment, allow_mismatch, progress) -> dict:
    dump_a, dump_b = open_dump(path_a), open_dump(path_b)
    check_same_model(dump_a, dump_b, allow_mismatch)
    from ..index.printkind import fingerprint_only

    if fingerprint_only(dump_a, dump_b):  # a repro replays tensors: refused before any index is built
        from ..verdict.prints import FOCUS_HINT

        raise DumpError(
            f"repro needs the culprit's tensors and {' and '.join(fingerprint_only(dump_a, dump_b))} holds row "
            f"fingerprints only; {FOCUS_HINT}"
        )
    index_a, index_b = load_indexes([dump_a, dump_b], progress=progress)
    ranks = sorted(set(dump_a.ranks) & set(dump_b.ranks))
    if rank is not None:
        if rank not in ranks:
            raise DumpError(f"rank {rank} is not in both dumps (ranks {ranks})")
        ranks = [rank]
    for r in ranks:
        ia, ib = index_a.rank(r), index_b.rank(r)
        alignment = prove(align(ia, ib), ia, ib, dump_a.label, dump_b.label, trust=trust_alignment)
        table = row_table(alignment, ia, ib)
        if call is None:
            culprit = strict_verdict(alignment, ia, ib, table)["culprit"]
            if culprit is None:
                continue
            target = culprit["call"]
        else:
            target = _resolve_call(call, ib)
            if target is None:
                continue
        pairs, origin = _rows_for(target, table, alignment.pairs)
        if pairs.empty:
            raise DumpError(f"{target} has no token row compared between the dumps: nothing to replay")
        return {
            "dumps": (dump_a, dump_b),
            "indexes": (ia, ib),
            "rank": r,
            "call": target,
            "pairs": pairs,
            "origin": origin,
            "table": table,
        }
    if call is not None:
        raise DumpError(
            f"no call {call!r} in {show(dump_b.label)}; give a call name as the report prints it "
            "(module#index, e.g. model.layers.0.mlp.down_proj#0) or a module path"
        )
    raise DumpError(
        "the dumps do not diverge (no call has identical inputs and a differing output): nothing to "
        "reproduce; pass --call to replay a given call anyway"
    )


def _resolve_call(name: str, index: Index) -> Optional[str]:
    calls = index.calls
    if (calls["call"] == name).any():
        return name
    mine = calls[calls["module"] == name].sort_values(["pass", "pre"])
    return mine["call"].iloc[0] if len(mine) else None


def _rows_for(call: str, table: RowTable, pairs: pd.DataFrame):
    """Pairs to replay: those where the call makes the difference (inputs identical, output not),
    else where its output differs, else any compared; all within the first pass pair, in row order."""
    mine = table.frame(table.call_mask(call))
    flags = mine.assign(
        in_differ=mine["differ"] & (mine["io"] == "in"), out_differ=mine["differ"] & (mine["io"] == "out")
    )
    per = flags.groupby("pair")[["in_differ", "out_differ"]].any().reset_index()
    origin = per[per["out_differ"] & ~per["in_differ"]]
    chosen, is_origin = origin, True
    if chosen.empty:
        chosen, is_origin = per[per["out_differ"]], False
    if chosen.empty:
        chosen = per
    rows = pairs[pairs["pair"].isin(chosen["pair"])]
    # Where the call only carries a difference on (a noise-aware culprit, given with --call), its
    # rows computed on a cache come first: that is where a state bug shows, not the prompt's rows.
    fresh = rows["mode_b"].isin(["prefill", None]) if not is_origin else False
    rows = rows.assign(_fresh=fresh).sort_values(["_fresh", "pass_b", "row_b"]).drop(columns="_fresh")
    if rows.empty:
        return rows, is_origin
    first = rows.iloc[0]
    same_passes = rows[(rows["pass_a"] == first["pass_a"]) & (rows["pass_b"] == first["pass_b"])]
    return same_passes.head(MAX_ROWS).reset_index(drop=True), is_origin


# ---- read the call's tensors on both sides -------------------------------------------------


def collect(target: dict) -> dict:
    dump_a, dump_b = target["dumps"]
    ia, ib = target["indexes"]
    call, pairs, rank = target["call"], target["pairs"], target["rank"]
    out_name = _compared_output(call, pairs, target["table"], ib)
    sides, inputs, outputs, values, skipped = {}, {}, {}, {}, {}
    for side, dump, index in (("a", dump_a, ia), ("b", dump_b, ib)):
        pass_id = int(pairs[f"pass_{side}"].iloc[0])
        token_rows = [int(r) for r in pairs[f"row_{side}"]]
        ref = next(p for p in dump.ranks[rank].passes if p.pass_id == pass_id)
        pass_file = PassFile(ref)
        call_meta = next((c for c in pass_file.meta["calls"] if c["call"] == call), None)
        if call_meta is None:
            raise DumpError(
                f"{show(ref.path)}: the index lists {call} but the pass metadata does not; rebuild the index"
            )
        metas = {name: m for c in pass_file.meta["calls"] for name, m in c["tensors"].items()}
        srows = index.rows[(index.rows["pass"] == pass_id)]
        info = {
            "label": dump.label,
            "pass": pass_id,
            "mode": pass_file.meta.get("mode", "unknown"),
            "M": int(sum(1 for v in pass_file.meta["tokens"]["valid"] if v)),
            "row_names": [f"{s}@{int(p)}" for s, p in zip(pairs["seq"], pairs["pos"])],
            "token_rows": token_rows,
            "token_dims": {},
            "rows": {},
            "shapes": {},
        }
        tensors = {}
        for name, tmeta in call_meta["tensors"].items():
            parsed = fmt.TENSOR_NAME_RE.match(name)
            if not parsed or parsed.group("io") != "in":
                continue
            slot = parsed.group("slot") or "0"
            stored = tmeta.get("alias") or name
            data = pass_file.tensor(stored)
            selected = bool(metas.get(stored, {}).get("selected"))
            dims = [0] if selected else tmeta.get("token_dims")
            picks = _srows(srows, name, token_rows) if dims is not None else None
            if picks is None:
                dims = None
            tensors[slot] = data
            info["token_dims"][slot], info["rows"][slot] = dims, picks
            info["shapes"][slot] = list(data.shape)
            if selected:
                info.setdefault("notes", []).append(f"in.{slot} holds only the rows DUMPER_POSITIONS/LAST_ROWS kept")
        out_meta = call_meta["tensors"].get(out_name)
        if out_meta is None:
            raise DumpError(f"{show(ref.path)}: {call} has no output {out_name} in this pass; nothing to compare")
        out_stored = out_meta.get("alias") or out_name
        out_selected = bool(metas.get(out_stored, {}).get("selected"))
        info["out_dims"] = [0] if out_selected else out_meta.get("token_dims")
        info["out_rows"] = _srows(srows, out_name, token_rows) if info["out_dims"] is not None else None
        if info["out_rows"] is None:
            raise DumpError(
                f"{out_name} has no token rows to compare ({out_meta.get('why') or 'rows unknown'}); "
                "replay another call with --call"
            )
        outputs[side] = pass_file.tensor(out_stored)
        inputs[side] = tensors
        values[side] = {k[3:]: v for k, v in (call_meta.get("values") or {}).items() if k.startswith("in.")}
        skipped[side] = {k: v for k, v in (call_meta.get("skipped") or {}).items() if k.startswith("in.")}
        info["values"] = values[side]
        info["module"], info["cls"] = call_meta["module"], call_meta["cls"]
        sides[side] = info
    if set(inputs["a"]) != set(inputs["b"]):
        raise DumpError(
            f"{call} takes different inputs in the two dumps ({sorted(inputs['a'])} vs {sorted(inputs['b'])}); "
            "a replay cannot feed one op both"
        )
    notes = sides["a"].pop("notes", []) + sides["b"].pop("notes", [])
    if not target["origin"]:
        notes.append(
            f"{call} does not make the difference on any row (its inputs already differ, or its output does "
            "not): the replay shows what it does with its own inputs"
        )
    run = dump_a.run
    meta = {
        "call": call,
        "module": sides["b"]["module"],
        "cls": sides["b"]["cls"],
        "rank": target["rank"],
        "out_slot": out_name[len(call) + len(".out.") :],
        "notes": notes,
        "device": run.get("device"),
        "dtype": run.get("dtype"),
        "dump_versions": ", ".join(f"{k} {v}" for k, v in sorted((run.get("versions") or {}).items())),
        "dumps": {"a": show(dump_a.path), "b": show(dump_b.path)},
        "sides": {s: {k: v for k, v in info.items() if k not in ("module", "cls")} for s, info in sides.items()},
    }
    return {"meta": meta, "inputs": inputs, "outputs": outputs, "skipped": skipped["a"] or skipped["b"]}


def _srows(rows: pd.DataFrame, tensor: str, token_rows: List[int]) -> Optional[List[int]]:
    """Row of the stored view holding each token row, or None when one is missing."""
    found = rows[rows["tensor"] == tensor].set_index("row")["srow"]
    if not all(r in found.index for r in token_rows):
        return None
    return [int(found.loc[r]) for r in token_rows]


def _compared_output(call: str, pairs: pd.DataFrame, table: RowTable, index: Index) -> str:
    outs = table.frame(table.call_mask(call) & table["is_out"] & np.isin(table["pair"], pairs["pair"].to_numpy()))
    differing = outs[outs["differ"]]
    if len(differing):
        return differing["tensor"].iloc[0]
    if len(outs):
        return outs["tensor"].iloc[0]
    raise DumpError(
        f"{call} has no output with token rows in both dumps: nothing to compare; replay another call with --call"
    )


# ---- how to replay it ------------------------------------------------------------------------


def leaf_kind(cls: str, slots: Dict[str, object]):
    """(kind, attrs) of a known leaf op, or (None, None). attrs["x"] names the input slot."""
    x = next((s for s in ("0", "input", "hidden_states", "x", "hidden") if s in slots), None)
    if cls in SDPA_CLASSES or {"query", "key", "value"} <= set(slots) or {"q", "k", "v"} <= set(slots):
        names = next(
            (n for n in (("query", "key", "value"), ("q", "k", "v"), ("0", "1", "2")) if set(n) <= set(slots)), None
        )
        if names is None:
            return None, None
        mask = next((s for s in ("attn_mask", "attention_mask", "mask", "3") if s in slots), None)
        attrs = {"q": names[0], "k": names[1], "v": names[2], "mask": mask}  # is_causal, scale: per call, from values
        return "sdpa", attrs
    if x is None or len(slots) != 1:
        return None, None
    if cls == "Linear":
        return "linear", {"x": x}
    if cls == "Embedding":
        return "embedding", {"x": x}
    if cls == "RMSNorm":
        return "rmsnorm_torch", {"x": x}
    if cls.endswith("RMSNorm") and "Gemma" not in cls:  # Gemma scales by (1 + weight): another formula
        return "rmsnorm_hf", {"x": x}
    if cls == "LayerNorm":
        return "layernorm", {"x": x}
    if cls in ACTIVATIONS:
        return "activation", {"x": x, "fn": ACTIVATIONS[cls]}
    return None, None


def plan_replay(captured: dict, source, where: str) -> dict:
    meta, inputs = captured["meta"], captured["inputs"]
    call, module, cls = meta["call"], meta["module"], meta["cls"]
    kind, attrs = leaf_kind(cls, inputs["a"])
    if kind is None and source is None:
        raise DumpError(
            f"cannot replay {cls} ({call}) without the model: it is not a known leaf op ({KNOWN}), so only "
            f"its own code can replay it; pass --model PATH (an HF model dir that builds {module} as {cls}) "
            f"and the script calls it through the model; its inputs are in {where}"
        )
    params, notes, path = {}, [], module
    if source is not None:
        path, sub = source.module(module, cls)
        if kind in NEEDS_PARAMS:
            params = source.params(path, sub, _param_dtype(meta, inputs["a"]))
        if kind is not None:
            attrs = _module_attrs(kind, attrs, sub)
            checked = _check_formula(kind, attrs, sub, params, inputs["a"], meta, captured["outputs"]["a"], source)
            if checked is not None:
                notes.append(
                    f"the standalone {kind} formula differs from {cls}'s own code ({checked}); replayed "
                    "through the model instead"
                )
                kind, attrs = None, None
        if kind is None:
            if captured["skipped"]:
                slot, what = next(iter(captured["skipped"].items()))
                raise DumpError(
                    f"cannot replay {call} [{cls}]: its call took {slot} ({what}), state that a dump does not "
                    f"hold (a KV cache, an engine batch); a replay without it computes something else. "
                    f"Replay one of its submodules with --call; its inputs are in {where}"
                )
            return {
                "meta": {
                    "kind": "module",
                    "attrs": {},
                    "params": [],
                    "params_hint": "",
                    "rowwise": False,
                    "model": os.path.abspath(source.path),
                    "module_in_model": path,
                    "notes": meta["notes"] + notes,
                },
                "params": {},
            }
        notes.append(f"the standalone formula was checked bit for bit against {cls} from {show(source.path)}")
    elif kind in NEEDS_PARAMS:
        needed = ", ".join(n.rstrip("?") + (" (if any)" if n.endswith("?") else "") for n in NEEDS_PARAMS[kind])
        extra = " and its eps" if kind.startswith(("rmsnorm", "layer")) else ""
        raise DumpError(
            f"{module} [{cls}] replays as {kind}, which needs the module's parameters ({needed}){extra}: a "
            f"dump holds activations, not parameters; pass --model PATH (the HF model dir) and repro copies "
            f"them into {where}/{WEIGHTS}; the inputs are in {where}"
        )
    else:
        notes.append(
            f"{cls} is replayed by the standard torch formula, unchecked against its code (no --model); the "
            "line 'replay of A reproduces the dumped output' is the check"
        )
    hint = f"save the state_dict of {module} as {WEIGHTS} next to repro.py, or rerun dumpdiff repro with --model PATH"
    return {
        "meta": {
            "kind": kind,
            "attrs": attrs,
            "params": sorted(params),
            "params_hint": hint,
            "rowwise": kind in ROWWISE,
            "model": os.path.abspath(source.path) if source else None,
            "module_in_model": path,
            "notes": meta["notes"] + notes,
        },
        "params": params,
    }


def _param_dtype(meta: dict, inputs: dict):
    import torch

    named = getattr(torch, str(meta.get("dtype") or ""), None)
    if isinstance(named, torch.dtype):
        return named
    return next((t.dtype for t in inputs.values() if t.is_floating_point()), torch.float32)


def _module_attrs(kind: str, attrs: dict, sub) -> dict:
    attrs = dict(attrs)
    if kind.startswith("rmsnorm") or kind == "layernorm":
        eps = getattr(sub, "variance_epsilon", None)
        eps = getattr(sub, "eps", None) if eps is None else eps
        attrs["eps"] = float(eps) if eps is not None else None
        shape = getattr(sub, "normalized_shape", None)
        if shape is not None:
            attrs["normalized_shape"] = list(shape)
    if kind == "embedding":
        attrs["padding_idx"] = getattr(sub, "padding_idx", None)
    if kind == "activation" and attrs.get("fn") == "gelu":
        attrs["approximate"] = getattr(sub, "approximate", "none")
    return attrs


def _check_formula(
    kind: str, attrs: dict, sub, params: dict, inputs: dict, meta: dict, dumped=None, source=None
) -> Optional[str]:
    """Run the formula and the real module on A's inputs (CPU); None when bit-identical. The
    module must also compute about what the dump holds: else --model is another model."""
    import torch

    env = runtime()
    state = sub.state_dict()
    if any(name not in params for name in state):
        return "module state not available"
    try:
        sub.to_empty(device="cpu")
        # assign: the module runs on the very tensors the formula gets (a copy into the meta-built
        # module's float32 storage ran a bf16 dump's check in float32 and failed on the dtypes)
        sub.load_state_dict(params, strict=True, assign=True)
        sub.eval()
        with torch.no_grad():
            values = meta["sides"]["a"]["values"]
            args, kwargs = env["rebuild_call"](inputs, values)
            real = dict(env["flatten"](sub(*args, **kwargs))).get(meta["out_slot"])
    except Exception as exc:  # noqa: BLE001 - the model's own module cannot take the dumped inputs
        raise DumpError(
            f"--model {show(source.path)}: its {meta['module']} cannot run on the dumped inputs "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); give the model the "
            "dump was made from"
        ) from None
    if real is not None and dumped is not None:
        _same_model(real, dumped, meta, source)
    try:
        with torch.no_grad():
            mine = env["OPS"][kind](inputs, params, attrs, values)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust the formula
        return f"{type(exc).__name__}: {exc}"
    if real is None:
        return f"the module returns no output {meta['out_slot']}"
    found = env["compare"](real, mine)
    return None if found is None else env["say"](found)


# A replay on another machine or kernel differs from the dump by float noise (bf16: about 1e-2
# of the output's scale at worst); other weights differ by the whole scale.
OTHER_WEIGHTS_REL = 0.1


def _same_model(real, dumped, meta: dict, source) -> None:
    """DumpError when the model's module computes something else than the dump holds: another
    shape, or an output off by far more than kernel noise (other weights of the same shapes)."""
    if tuple(real.shape) != tuple(dumped.shape):
        raise DumpError(
            f"--model {show(source.path)}: its {meta['module']} gives shape {list(real.shape)}, the dump "
            f"holds {list(dumped.shape)}; give the model the dump was made from"
        )
    if real.is_floating_point() and dumped.is_floating_point() and dumped.numel():
        scale = float(dumped.double().abs().max()) or 1.0
        off = float((real.double() - dumped.double()).abs().max()) / scale
        if off > OTHER_WEIGHTS_REL:
            raise DumpError(
                f"--model {show(source.path)}: its {meta['module']} computes the dumped inputs into outputs "
                f"{off:.2g} of their scale away from the dumped ones (other weights?); give the model the "
                "dump was made from"
            )


class ModelSource:
    """An HF model dir: its module tree built on the meta device (no memory, no weights read),
    and one module's parameters read from the checkpoint by name (the whole model is loaded only
    when the names do not resolve)."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
            raise DumpError(f"--model {show(path)}: not an HF model directory (no config.json)")
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise DumpError("--model needs transformers: pip install 'dumpdiff[hf]'") from None
        self.path = path
        try:
            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise DumpError(
                f"--model {show(path)}: transformers cannot build it ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None

    def module(self, module_path: str, cls: str):
        for path in (module_path, f"model.{module_path}"):
            try:
                sub = self.model.get_submodule(path)
            except AttributeError:
                continue
            built = type(sub).__name__
            if built != cls:
                raise DumpError(
                    f"the model at {show(self.path)} builds {path} as {built}, but the dump recorded {cls}: "
                    "the module was replaced at run time or the engine has its own class, so a replay from "
                    f"this model would not run the dumped code; replay it in the process that made the dump"
                )
            return path, sub
        raise DumpError(
            f"the model at {show(self.path)} has no module {module_path} (an engine that fuses or renames "
            "modules?); replay another call with --call, or give the model the dump was made from"
        )

    def params(self, path: str, sub, dtype) -> dict:
        import torch

        names = list(sub.state_dict().keys())
        found = self._from_checkpoint([f"{path}.{n}" for n in names])
        if found is None:
            from transformers import AutoModelForCausalLM

            full = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
            found = {f"{path}.{k}": v for k, v in full.get_submodule(path).state_dict().items()}
        out = {}
        for name in names:
            tensor = found[f"{path}.{name}"]
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        return {k: v.detach().to(torch.device("cpu")) for k, v in out.items()}

    def _from_checkpoint(self, keys: List[str]) -> Optional[dict]:
        from safetensors import safe_open

        wanted, found = set(keys), {}
        for file in sorted(glob.glob(os.path.join(self.path, "*.safetensors"))):
            with safe_open(file, framework="pt") as handle:
                for key in wanted & set(handle.keys()):
                    found[key] = handle.get_tensor(key)
        return found if set(found) == wanted else None


def describe(result: dict) -> str:
    """What `dumpdiff repro` prints: the call, both sides, the files, how to run."""
    meta = result["meta"]
    lines = [f"dumpdiff repro: {meta['call']} [{meta['cls']}], replayed as {meta['kind']}"]
    for key, side in (("A", "a"), ("B", "b")):
        info = meta["sides"][side]
        lines.append(
            f"  {key} {info['label']} pass {info['pass']} ({info['mode']}, M={info['M']}): rows "
            f"{', '.join(info['row_names'][:6])}{' ...' if len(info['row_names']) > 6 else ''}"
        )
    lines += [f"  note: {n}" for n in meta.get("notes", [])]
    lines += [f"  wrote {show(f)}" for f in result["files"]]
    needs = (
        "torch, safetensors, transformers and the model" if meta["kind"] == "module" else "torch and safetensors only"
    )
    lines.append(f"run: python {show(result['script'])}   (needs {needs}; exit 1 when the outputs differ)")
    return "\n".join(lines) + "\n"
