"""Which tensor of one run is which tensor of another: the rules `dumpdiff compare` maps by.

Two runs of one model name their modules alike only when they run the same code. An engine fuses
what HF keeps apart (sglang's and vLLM's ``qkv_proj`` is HF's ``q_proj``, ``k_proj`` and
``v_proj`` side by side; ``gate_up_proj`` is ``gate_proj`` and ``up_proj``), computes the
attention core in a module HF has not (its output is the input of ``o_proj``), and hands the
residual through its norms (``norm(x, residual)`` returns the normalized sum and the sum, which
is HF's norm input). Each side's tensors are renamed to the names HF gives them, rule by rule;
what then holds the same name on both sides is compared.

A rule (built in here, or in a mapping file: JSON, or TOML with ``[[rule]]`` tables):

    match    regular expression, matched whole against a tensor name (module#call.in|out.slot)
    to       one name or a list (regex replacement templates: \\1 ...): the tensor is each of them
    split    a list of names: the tensor's last dim, cut in this many parts in order, is them
    sizes    with split: the widths of the parts on one rank (else the dump's record of the
             module, else the other run's widths of the parts divided by this run's tp size)
    ignore   true: the tensor has no counterpart, and is not compared
    side     "reference", "test" or "both" (default both)
    engine   regular expression on the dump's engine (run.json: hf, sglang, vllm, generic)
    other    regular expression on the other run's engine
    cls      regular expression on the module's class
    when     a slot the call must hold (out.1: a norm that returns the residual)

The first rule that matches a tensor decides; a tensor no rule matches keeps its name. A user's
rules come before the built-in ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import List, Optional, Tuple

from ..errors import DumpError

SIDES = ("reference", "test", "both")


@dataclasses.dataclass(frozen=True)
class Rule:
    match: str
    to: Tuple[str, ...] = ()
    split: Tuple[str, ...] = ()
    sizes: Optional[Tuple[int, ...]] = None
    ignore: bool = False
    side: str = "both"
    engine: Optional[str] = None
    cls: Optional[str] = None
    when: Optional[str] = None
    other: Optional[str] = None
    why: str = ""  # said in the report when the rule is used
    origin: str = "built-in"

    def applies(self, side: str, engine: str, other: str, cls: str, slots) -> bool:
        return (
            self.side in ("both", side)
            and (self.engine is None or re.fullmatch(self.engine, engine or "") is not None)
            and (self.other is None or re.fullmatch(self.other, other or "") is not None)
            and (self.cls is None or re.fullmatch(self.cls, cls or "") is not None)
            and (self.when is None or self.when in slots)
        )


ENGINES = "sglang|vllm"
_FUSED_QKV = "QKVParallelLinear|QKVCrossParallelLinear"
_MERGED = "MergedColumnParallelLinear"
_GATED_ACT = r"\w*AndMul"  # SiluAndMul, GeluAndMul: act(gate) * up in one op
_ATTN_CORE = "RadixAttention|Attention"
_NORM = r"\w*(RMSNorm|LayerNorm)\w*"


def _fused(module: str, parts: Tuple[str, ...], cls: str, engine: str = ENGINES, other=None) -> List[Rule]:
    """A fused projection: its output cut into the parts' outputs, its input each part's input."""
    return [
        Rule(
            rf"(.*)\.{module}#(\d+)\.out\.0",
            split=tuple(rf"\1.{part}#\2.out.0" for part in parts),
            engine=engine,
            cls=cls,
            other=other,
            why=f"fused {module} cut into {', '.join(parts)}",
        ),
        Rule(
            rf"(.*)\.{module}#(\d+)\.in\.0",
            to=tuple(rf"\1.{part}#\2.in.0" for part in parts),
            engine=engine,
            cls=cls,
            other=other,
        ),
    ]


def _output_as_input(module: str, target: str, cls: str, what: str) -> List[Rule]:
    """An engine module HF computes in code of its parent's: its output is the input of the
    sibling module ``target``; its other tensors have no counterpart."""
    return [
        Rule(
            rf"(.*)\.{module}#(\d+)\.out\.0",
            to=(rf"\1.{target}#\2.in.0",),
            engine=ENGINES,
            cls=cls,
            why=f"{what} compared as {target}'s input",
        ),
        Rule(rf".*\.{module}#\d+\..*", ignore=True, engine=ENGINES, cls=cls),
    ]


BUILTIN: List[Rule] = [
    *_fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), _FUSED_QKV),
    *_fused("gate_up_proj", ("gate_proj", "up_proj"), _MERGED),
    # HF models that fuse them too (Phi-3): cut alike, by the engine's widths, so that an engine's
    # shards, cut per rank, meet them part by part
    *_fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), r"\w*Linear\w*", engine="hf", other=ENGINES),
    *_fused("gate_up_proj", ("gate_proj", "up_proj"), r"\w*Linear\w*", engine="hf", other=ENGINES),
    # act(gate) * up is the input of down_proj; HF's act_fn computes act(gate) alone
    *_output_as_input("act_fn", "down_proj", _GATED_ACT, "gated activation (act(gate) * up)"),
    Rule(
        r".*\.mlp\.(act_fn|act|activation_fn|activation)#\d+\..*",
        ignore=True,
        engine="hf",
        other=ENGINES,
        why="HF's act_fn(gate) alone has no engine counterpart",
    ),
    # HF's dropouts (identity in eval) have none either
    Rule(r".*#\d+\..*", ignore=True, engine="hf", other=ENGINES, cls=r"Dropout\w*", why="HF's dropouts not compared"),
    # the attention core: q, k, v after rotary in (HF has no such module), its output is o_proj's input
    *_output_as_input("attn", "o_proj", _ATTN_CORE, "attention core"),
    Rule(r".*\.rotary_emb#\d+\..*", ignore=True, engine=ENGINES),
    Rule(r".*rotary_emb#\d+\..*", ignore=True, engine="hf", other=ENGINES),
    # norm(x, residual) -> (normalized x + residual, x + residual): the sum is HF's norm input
    Rule(
        r"(.*)#(\d+)\.out\.1",
        to=(r"\1#\2.in.0",),
        engine=ENGINES,
        cls=_NORM,
        when="out.1",
        why="norms that take and return the residual: the sum they return is the plain norm's input",
    ),
    Rule(r".*#\d+\.in\..*", ignore=True, engine=ENGINES, cls=_NORM, when="out.1"),
    # a decoder layer that hands (hidden, residual) to the next: the residual stream in two parts,
    # compared through its norms
    Rule(r"model\.layers\.\d+#\d+\..*", ignore=True, engine=ENGINES, cls=r"\w*DecoderLayer\w*"),
    # vLLM's model runner computes the logits (lm_head) after the model's forward, where no dump
    # sees them: the other run's logits have no counterpart
    Rule(
        r"(lm_head|<root>)#\d+\..*",
        ignore=True,
        other="vllm",
        why="vLLM computes the logits after the model's forward, outside the dump: logits not compared",
    ),
    # the logits: the engine's logits processor output at the root, HF's lm_head
    Rule(r"<root>#(\d+)\.out\.next_token_logits", to=(r"lm_head#\1.out.0",), engine=ENGINES),
    Rule(r"(.*\.)?(logits_processor|sampler)#\d+\..*", ignore=True, engine=ENGINES),
]


def load_rules(path: Optional[str]) -> List[Rule]:
    """The user's rules (before the built-in ones), from a JSON or TOML mapping file."""
    if not path:
        return list(BUILTIN)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise DumpError(f"cannot read the mapping file {path}: {exc.strerror or exc}") from None
    name = os.path.basename(path)
    try:
        if path.endswith(".toml"):
            import tomllib

            document = tomllib.loads(raw.decode("utf-8"))
        else:
            document = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.endswith(".toml") else "JSON (a TOML file's name ends in .toml)"
        raise DumpError(f"mapping file {name} is not valid {kind}: {exc}") from None
    items = document.get("rule") if isinstance(document, dict) else None
    if not isinstance(items, list):
        raise DumpError(f'mapping file {name}: expected a list of rules under "rule" ([[rule]] tables in TOML)')
    other_keys = sorted(set(document) - {"rule"})
    if other_keys:
        raise DumpError(f'mapping file {name}: unknown key {other_keys[0]!r}; rules go under "rule" ([[rule]] in TOML)')
    return [_rule(item, f"{name} rule {i + 1}") for i, item in enumerate(items)] + list(BUILTIN)


_FIELDS = {"match", "to", "split", "sizes", "ignore", "side", "engine", "other", "cls", "when"}


def _check_template(template: str, match: re.Pattern, where: str) -> None:
    """A name template must refer only to groups 'match' has (\\1, \\g<name>) and escape nothing else."""
    try:
        match.sub(template, "")  # parses the template against the pattern's groups, matching nothing
    except (re.error, IndexError) as exc:
        raise DumpError(f"{where}: the name {template!r} does not fit 'match' {match.pattern!r}: {exc}") from None


def _rule(item, where: str) -> Rule:
    if not isinstance(item, dict):
        raise DumpError(f"{where}: a rule is a table of fields ({', '.join(sorted(_FIELDS))})")
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise DumpError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    if not isinstance(item.get("match"), str):
        raise DumpError(f"{where}: 'match' (a regular expression on tensor names) is required")
    for field in ("side", "engine", "other", "cls", "when"):
        if item.get(field) is not None and not isinstance(item[field], str):
            raise DumpError(f"{where}: '{field}' takes a string, not {item[field]!r}")
    patterns = {}
    for field in ("match", "engine", "other", "cls"):
        if item.get(field) is not None:
            try:
                patterns[field] = re.compile(item[field])
            except re.error as exc:
                raise DumpError(f"{where}: {field} {item[field]!r} is not a regular expression: {exc}") from None
    to, split, sizes = item.get("to", []), item.get("split", []), item.get("sizes")
    to = [to] if isinstance(to, str) else to
    if not isinstance(to, list) or not all(isinstance(t, str) for t in to):
        raise DumpError(f"{where}: 'to' takes a name or a list of names (strings)")
    if not isinstance(split, list) or not all(isinstance(t, str) for t in split) or len(split) == 1:
        raise DumpError(f"{where}: 'split' takes a list of two or more names (strings), the parts in order")
    if not isinstance(item.get("ignore", False), bool):
        raise DumpError(f"{where}: 'ignore' is true or false, not {item['ignore']!r}")
    if sum(map(bool, (to, split, item.get("ignore")))) != 1:
        raise DumpError(f"{where}: give exactly one of 'to', 'split' or 'ignore = true'")
    for template in [*to, *split]:
        _check_template(template, patterns["match"], where)
    if sizes is not None and (
        not split
        or not isinstance(sizes, list)
        or len(sizes) != len(split)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
    ):
        raise DumpError(f"{where}: 'sizes' goes with 'split', one positive width per part")
    if item.get("side", "both") not in SIDES:
        raise DumpError(f"{where}: 'side' is one of {', '.join(SIDES)}")
    if item.get("when") is not None and not re.fullmatch(r"(in|out)\.\w+", item["when"]):
        raise DumpError(f"{where}: 'when' names a slot as in.<slot> or out.<slot> (out.1), not {item['when']!r}")
    return Rule(
        item["match"],
        to=tuple(to),
        split=tuple(split),
        sizes=tuple(sizes) if sizes else None,
        ignore=bool(item.get("ignore")),
        side=item.get("side", "both"),
        engine=item.get("engine"),
        cls=item.get("cls"),
        when=item.get("when"),
        other=item.get("other"),
        why=where,
        origin=where,
    )
