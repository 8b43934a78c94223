"""The dumper's promises, one at a time: config errors, capture naming, clones, aliases, no pickle."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from dumpdiff import dumper
from dumpdiff.analyzer.dump.load import open_dump
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.config import VARIABLES, ConfigError, DumperConfig
from helpers import ROOT, dumpdiff


def test_env_example_documents_every_variable_with_its_default():
    text = open(os.path.join(ROOT, "env.example")).read()
    documented = dict(re.findall(r"^(DUMPER_[A-Z_]+)=(.*)$", text, re.M))
    assert documented == {name: default for name, (default, _) in VARIABLES.items()}
    defaults = DumperConfig()
    for name, (default, _) in VARIABLES.items():
        parsed = DumperConfig.from_env({name: default})  # the documented default parses to the real one
        field = name[len("DUMPER_") :].lower()
        assert getattr(parsed, field) == getattr(defaults, field), name


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("DUMPER_ENABLE", "maybe", "DUMPER_ENABLE='maybe' is not valid: expected 1 or 0"),
        ("DUMPER_NON_INTRUSIVE_MODE", "everything", "expected one of off|core|all"),
        ("DUMPER_MAX_BYTES", "lots", "DUMPER_MAX_BYTES='lots' is not valid"),
        ("DUMPER_EXP_NAME", "../escape", "DUMPER_EXP_NAME='../escape' is not valid"),
        ("DUMPER_FILTER", "layers.(", "DUMPER_FILTER='layers.(' is not valid"),
        ("DUMPER_SERVER_PORT", "http", "-1, reuse, or a port number"),
        ("DUMPER_POSITIONS", "a:b", "DUMPER_POSITIONS='a:b' is not valid"),
        ("DUMPER_POSITIONS", "5:3", "ranges whose end is past their start"),  # kept nothing, silently
        ("DUMPER_MAX_BYTES", "1e400", "DUMPER_MAX_BYTES='1e400' is not valid"),  # an OverflowError escaped
        ("DUMPER_LAST_ROWS", "1.9", "DUMPER_LAST_ROWS='1.9' is not valid"),  # was truncated to 1
        ("DUMPER_SERVER_PORT", "99999", "a port number up to 65535"),  # bind() failed at install
        ("DUMPER_DIR", "", "DUMPER_DIR='' is not valid"),  # wrote into the current folder
    ],
)
def test_bad_values_are_one_line_errors_naming_the_variable(name, value, needle):
    with pytest.raises(ConfigError) as err:
        DumperConfig.from_env({name: value})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sglang_compatible_values_parse():
    cfg = DumperConfig.from_env(
        {
            "DUMPER_ENABLE": "true",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_FILTER": "layer_id=[0-3]",
            "DUMPER_NON_INTRUSIVE_MODE": "core",
            "DUMPER_CLEANUP_PREVIOUS": "1",
        }
    )
    assert (
        cfg.enable and cfg.server_port_parsed == "reuse" and cfg.cleanup_previous and cfg.non_intrusive_mode == "core"
    )


@dataclasses.dataclass
class Pair:
    main: torch.Tensor
    extra: torch.Tensor
    label: str


class Toy(torch.nn.Module):
    """Token ids in, a dataclass and a tuple through the middle, an in-place op at the end."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.split = Splitter()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        pair = self.split(hidden, scale=2.0, tag="x", cache=object())
        out = self.proj(pair.main)
        out.add_(1.0)  # in place after the hook: the dump must hold the value at hook time
        return out, pair.extra


class Splitter(torch.nn.Module):
    def forward(self, hidden, scale=1.0, tag="", cache=None):
        return Pair(hidden * scale, hidden[..., :2], tag)


def read_pass(path):
    with safe_open(path, "pt") as handle:
        meta = json.loads(handle.metadata()[fmt.PASS_META_KEY])
        return meta, {k: handle.get_tensor(k) for k in handle.keys()}


class PassOn(torch.nn.Module):
    """One hidden tensor object handed from call to call: unchanged, rewritten in place, given
    other storage through .data (no version bump), then unchanged again; then, through .data
    again, the same memory read with other strides and as another type."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.first, self.second, self.third, self.fourth = (torch.nn.Identity() for _ in range(4))
        self.fifth, self.sixth = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        self.first(hidden)
        hidden.mul_(3.0)
        self.second(hidden)
        hidden.data = hidden.data.flip(-1).clone()
        self.third(hidden)
        out = self.fourth(hidden)
        square = hidden.data.reshape(1, 4, 8)[..., :4].clone()  # [1, 4, 4]: a transpose keeps its shape
        self.fifth(square)
        square.data = square.data.transpose(1, 2)
        self.fifth(square)
        square.data = square.data.view(torch.int32)
        self.sixth(square)
        return out


@pytest.mark.parametrize("mode", ["all", "fingerprint"])
def test_the_same_tensor_object_is_an_alias_only_while_unchanged(tmp_path, mode):
    torch.manual_seed(0)
    model = PassOn().eval()
    config = DumperConfig(dir=str(tmp_path), enable=True, exp_name=mode, non_intrusive_mode=mode)
    handle = dumper.install(model, config)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        out = model(ids)
        model(ids)  # a second pass: every tensor object is new, nothing taken from the first
    handle.remove()
    embedded = model.embed(ids).detach()
    for pass_id in (0, 1):
        meta, tensors = read_pass(tmp_path / mode / "rank0" / fmt.pass_file_name(pass_id))
        metas = {name: m for c in meta["calls"] for name, m in c["tensors"].items()}
        assert metas["first#0.in.0"]["alias"] == "embed#0.out.0"
        assert metas["first#0.out.0"]["alias"] == "embed#0.out.0"
        assert "alias" not in metas["second#0.in.0"]  # rewritten in place since
        assert metas["second#0.out.0"]["alias"] == "second#0.in.0"
        assert "alias" not in metas["third#0.in.0"]  # other storage since
        assert metas["fourth#0.out.0"]["alias"] == "third#0.in.0"
        assert "alias" not in metas["fifth#1.in.0"]  # other strides over the same memory
        assert "alias" not in metas["sixth#0.in.0"] and metas["sixth#0.in.0"]["dtype"] == "int32"
        if mode == "all":
            assert torch.equal(tensors["embed#0.out.0"], embedded)
            assert torch.equal(tensors["second#0.in.0"], embedded * 3.0)
            assert torch.equal(tensors["third#0.in.0"], out)
            assert torch.equal(tensors["fifth#1.in.0"], tensors["fifth#0.in.0"].transpose(1, 2))
        else:
            assert all("alias" in m or "print" in m for m in metas.values())


def test_capture_names_values_skips_and_clones(tmp_path):
    torch.manual_seed(0)
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="toy"))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        out, _ = model(ids)
    handle.remove()
    meta, tensors = read_pass(tmp_path / "toy" / "rank0" / fmt.pass_file_name(0))
    calls = {c["call"]: c for c in meta["calls"]}
    split = calls["split#0"]
    assert split["values"] == {"in.scale": 2.0, "in.tag": "x", "out.label": "x"}
    assert split["skipped"] == {"in.cache": "object"}
    assert set(split["tensors"]) == {"split#0.in.0", "split#0.out.main", "split#0.out.extra"}
    assert split["tensors"]["split#0.in.0"]["alias"] == "embed#0.out.0"  # stored once
    assert meta["tokens"]["ids"] == [3, 4, 5, 6] and meta["tokens"]["pos"] == [0, 1, 2, 3]
    # the hook-time copy, not the tensor after the in-place add
    assert torch.equal(tensors["proj#0.out.0"] + 1.0, out)
    assert calls["proj#0"]["pre"] < calls["proj#0"]["post"] < calls["<root>#0"]["post"]


def test_the_collector_is_paused_for_a_dumped_pass_and_left_as_the_user_set_it(tmp_path):
    """Paused while a pass is dumped (its metadata would grow old and make full collections
    run), running again after it, also when the model raises; a collector the user turned off
    stays off; a forward that is not dumped runs with the collector as it was."""
    model = Toy().eval()
    seen = []
    model.proj.register_forward_hook(lambda *a: seen.append(gc.isenabled()))
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="toy"))
    ids = torch.tensor([[3, 4, 5, 6]])
    try:
        with torch.no_grad():
            model(ids)
            assert seen == [False] and gc.isenabled()
            with pytest.raises(IndexError):
                model(torch.tensor([[3, 99]]))  # an id outside the embedding
            assert gc.isenabled()
            gc.disable()
            model(ids)
            assert seen == [False, False] and not gc.isenabled()
            gc.enable()
            handle._begin_pass = lambda args, kwargs: False  # a forward the adapter cannot describe
            model(ids)
            assert seen == [False, False, True] and gc.isenabled()  # runs undumped, collector on
    finally:
        gc.enable()
        handle.remove()


def test_files_are_safetensors_and_json_only(tmp_path):
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="toy"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        model(torch.tensor([[1, 2]]))
    handle.remove()
    exp = tmp_path / "toy"
    assert json.load(open(exp / fmt.RUN_FILE))["version"] == fmt.FORMAT_VERSION
    lines = [json.loads(line) for line in open(exp / "rank0" / fmt.MANIFEST_FILE)]
    assert [e["pass"] for e in lines] == [0, 1]
    names = sorted(os.listdir(exp / "rank0"))
    assert names == [".lock", "manifest.jsonl", "pass-000000.safetensors", "pass-000001.safetensors"]
    for entry in lines:
        assert os.path.getsize(exp / "rank0" / entry["file"]) == entry["bytes"]


def test_disabled_hooks_cost_nothing_and_enable_later(tmp_path):
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), exp_name="late"))
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert not any(m._forward_pre_hooks for m in model.modules())  # no per-module hooks while idle
    handle.configure(enable=True)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert any(m._forward_pre_hooks for m in model.modules())
    handle.configure(enable=False)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert not any(m._forward_pre_hooks for m in model.modules())  # disabled again: idle again
    handle.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert "forward" not in model.__dict__
    lines = open(tmp_path / "late" / "rank0" / fmt.MANIFEST_FILE).read().splitlines()
    assert len(lines) == 1  # the pass run before enabling was not dumped


def test_core_mode_writes_metadata_only(tmp_path, caplog):
    model = Toy().eval()
    handle = dumper.install(
        model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="c", non_intrusive_mode="core")
    )
    with caplog.at_level("WARNING", logger="dumper"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    handle.remove()
    meta, tensors = read_pass(tmp_path / "c" / "rank0" / fmt.pass_file_name(0))
    assert tensors == {} and meta["calls"] == [] and meta["tokens"]["ids"] == [1, 2, 3]
    assert "metadata only" in caplog.text


def test_filter_selects_modules(tmp_path):
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="f", filter="^(embed|proj)$"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    handle.remove()
    meta, _ = read_pass(tmp_path / "f" / "rank0" / fmt.pass_file_name(0))
    assert [c["call"] for c in meta["calls"]] == ["embed#0", "proj#0"]


def test_positions_keep_only_selected_rows(tmp_path):
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="p", positions="2:"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]))
    handle.remove()
    meta, tensors = read_pass(tmp_path / "p" / "rank0" / fmt.pass_file_name(0))
    assert meta["kept_rows"] == [2, 3, 4] and len(meta["tokens"]["ids"]) == 5  # metadata stays complete
    assert tensors["embed#0.out.0"].shape == (3, 8)
    code, out, err = dumpdiff("index", tmp_path / "p", "--no-progress")
    assert code == 0, err


def test_fingerprint_is_order_sensitive():
    from dumpdiff.analyzer.index.fingerprint import fingerprints

    rows = torch.randn(3, 16)
    swapped = rows.clone()
    swapped[0, [3, 7]] = swapped[0, [7, 3]]
    flipped = rows.clone()
    flipped.view(torch.int32)[1, 5] ^= 1  # one bit
    fp = fingerprints(rows)
    assert (fingerprints(rows.clone()) == fp).all()
    assert fingerprints(swapped)[0] != fp[0] and (fingerprints(swapped)[1:] == fp[1:]).all()
    assert fingerprints(flipped)[1] != fp[1]
    assert (
        fingerprints(torch.zeros(2, 3, dtype=torch.bfloat16))[0]
        != fingerprints(torch.zeros(2, 6, dtype=torch.bfloat16))[0]
    )


def test_switching_experiment_closes_the_previous_dump(tmp_path):
    """A server keeps running after the workflow; the dumps it finished must read as whole."""
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="a"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        handle.configure(exp_name="b")
        model(torch.tensor([[1, 2, 3]]))
        handle.configure(enable=False)
    try:
        for exp in ("a", "b"):
            assert open(tmp_path / exp / "rank0" / ".lock").read().strip() == "closed"
        code, out, err = dumpdiff("first-divergence", tmp_path / "a", tmp_path / "b", "--no-progress")
        assert code == 0 and "warning" not in err + out
    finally:
        handle.remove()


def run_python(code: str, env: dict):
    """(exit code, stderr) of ``code`` in a fresh interpreter: umask and environment are read there."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DUMPER_")}, **env},
    )
    return proc.returncode, proc.stderr


def test_every_dump_file_gets_the_mode_a_plain_open_gives(tmp_path):
    """Pass files were 0600 (safetensors writes through a temp file): an analyst could not read a
    server's dump. Under umask 007 every file must be 0660, as open() would make it."""
    code, err = run_python(
        f"""
import os, sys
os.umask(0o007)
sys.path.insert(0, "tests")
import torch, dumper
from test_dumper_units import Toy
model = Toy().eval()
handle = dumper.install(model, dumper.DumperConfig(dir={str(tmp_path)!r}, enable=True, exp_name="m"))
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
handle.remove()
""",
        {},
    )
    assert code == 0, err
    modes = {
        os.path.relpath(os.path.join(d, f), tmp_path): oct(os.stat(os.path.join(d, f)).st_mode & 0o777)
        for d, _, files in os.walk(tmp_path)
        for f in files
    }
    assert "m/rank0/pass-000000.safetensors" in modes
    assert set(modes.values()) == {"0o660"}, modes


def test_misspelt_dumper_variables_warn_once_naming_the_closest():
    code, err = run_python(
        """
import sys
from dumpdiff.dumper.config import DumperConfig, any_dumper_variable
assert not any_dumper_variable()  # sglang's plugin asks this first: DUMPER_ENABLED=1 alone must still warn
print("-- from_env", file=sys.stderr)
cfg = DumperConfig.from_env()
DumperConfig.from_env()  # read again (sglang's plugin does): no second warning
assert cfg.dir == "/tmp/dumper" and not cfg.enable
""",
        {"DUMPER_ENABLED": "1", "DUMPER_FILTR": "mlp", "DUMPER_ENABLE_VALUE": "1", "DUMPER_GRAFTER_ROLE": "target"},
    )
    assert code == 0, err
    lines = err.splitlines()
    assert lines == [
        "dumper: DUMPER_ENABLED is not a dumper variable and is ignored; did you mean DUMPER_ENABLE?",
        "dumper: DUMPER_FILTR is not a dumper variable and is ignored; did you mean DUMPER_FILTER?",
        "-- from_env",
    ]
    # sglang's own dumper reads DUMPER_ENABLE_VALUE, DUMPER_GRAFTER_*...: set for it, not misspelt
    code, err = run_python(
        "from dumpdiff import dumper; dumper.DumperConfig.from_env()", {"DUMPER_EXPNAME": "x"}
    )  # dumper.install()'s way
    assert code == 0 and err.splitlines() == [
        "dumper: DUMPER_EXPNAME is not a dumper variable and is ignored; did you mean DUMPER_EXP_NAME?"
    ], err


def test_filter_with_an_unknown_key_is_an_error_naming_the_keys():
    with pytest.raises(ConfigError) as err:
        DumperConfig.from_env({"DUMPER_FILTER": "layer=3"})
    assert "DUMPER_FILTER='layer=3' is not valid" in str(err.value) and "name|layer_id|cls" in str(err.value)
    for regex in ("layers\\.(0|1)\\.", "(?=mlp)mlp", "layer_id=[0-3]", "cls=Linear"):  # still filters
        DumperConfig.from_env({"DUMPER_FILTER": regex})


@pytest.mark.parametrize(
    "filter_text,needle",
    [
        (
            "nothing_here",
            "DUMPER_FILTER='nothing_here' matches no module of Toy; nothing but pass metadata will be dumped",
        ),
        ("^proj$", "DUMPER_FILTER='^proj$' leaves out the embedding (embed) of Toy; the analyzer needs its output"),
        ("^(embed|proj)$", None),
    ],
    ids=["matches-nothing", "no-embedding", "fine"],
)
def test_filter_that_cannot_localize_warns_once_at_install(tmp_path, caplog, filter_text, needle):
    model = Toy().eval()
    with caplog.at_level("WARNING", logger="dumper"):
        handle = dumper.install(model, DumperConfig(dir=str(tmp_path), exp_name="f", filter=filter_text))
        assert (needle in caplog.text) if needle else "DUMPER_FILTER" not in caplog.text  # before any pass
        handle.configure(enable=True)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
            model(torch.tensor([[1, 2]]))
        handle.remove()
    assert caplog.text.count("DUMPER_FILTER") == (1 if needle else 0)


def test_an_earlier_runs_passes_in_the_folder_are_named_once(tmp_path, caplog):
    def run(model, passes, **config):
        handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="ref", **config))
        with torch.no_grad():
            for _ in range(passes):
                model(torch.tensor([[1, 2, 3]]))
            handle.configure(exp_name="other")
            handle.configure(exp_name="ref")  # back to a folder this dumper wrote: no warning
            model(torch.tensor([[1, 2, 3]]))
        handle.remove()

    model = Toy().eval()
    run(model, 1)
    with caplog.at_level("WARNING", logger="dumper"):
        run(model, 2)  # a second run of the same workflow
    rank_dir = tmp_path / "ref" / "rank0"
    assert caplog.messages == [
        f"dumper: {rank_dir} already holds 2 passes from an earlier run; new passes are appended "
        "(DUMPER_CLEANUP_PREVIOUS=1 or a new exp_name starts afresh)"
    ]
    # the analyzer says so too, in every report (the server's log is rarely read): two writers' passes
    notes = [n for n in open_dump(str(tmp_path / "ref")).warnings() if "writer sessions" in n]
    assert len(notes) == 1 and "passes from 2 writer sessions" in notes[0] and "rerun was appended" in notes[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dumper"):
        run(model, 1, cleanup_previous=True)  # starts afresh: nothing to say
    assert caplog.messages == []
    assert open_dump(str(tmp_path / "ref")).warnings() == []


def test_core_mode_warns_once_per_dumper(tmp_path, caplog):
    model = Toy().eval()
    handle = dumper.install(
        model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="c1", non_intrusive_mode="core")
    )
    with caplog.at_level("WARNING", logger="dumper"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        handle.configure(exp_name="c2")
        model(torch.tensor([[1, 2, 3]]))
    handle.remove()
    assert caplog.text.count("metadata only") == 1


# An engine's output object: sglang's LogitsProcessorOutput has 24 fields and holds the logits.
WideOutput = dataclasses.make_dataclass(
    "WideOutput",
    [("next_token_logits", torch.Tensor)]
    + [(f"field_{i}", object, dataclasses.field(default=None)) for i in range(23)],
)
WideState = dataclasses.make_dataclass(
    "WideState",
    [(f"pool_{i}", object, dataclasses.field(default=None)) for i in range(17)] + [("positions", object, None)],
)


class LogitsStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 50)

    def forward(self, hidden, state):
        return WideOutput(next_token_logits=self.head(hidden))


class WithLogitsStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.logits = LogitsStage()

    def forward(self, input_ids):
        return self.logits(self.embed(input_ids), WideState(positions=torch.arange(input_ids.shape[-1])))


def test_an_output_dataclass_of_any_size_is_opened_an_input_state_object_is_not(tmp_path):
    """The logits of an engine's logits stage live in a wide output dataclass: listed as skipped,
    they were never compared, and a decode-only lm_head bug was invisible. A wide dataclass
    passed in (sglang's ForwardBatch, pools of the whole KV cache) stays pass metadata."""
    model = WithLogitsStage().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="wide"))
    with torch.no_grad():
        out = model(torch.tensor([[3, 4, 5]]))
    handle.remove()
    meta, tensors = read_pass(tmp_path / "wide" / "rank0" / fmt.pass_file_name(0))
    call = {c["call"]: c for c in meta["calls"]}["logits#0"]
    assert call["tensors"]["logits#0.out.next_token_logits"]["alias"] == "logits.head#0.out.0"  # stored once
    assert torch.equal(tensors["logits.head#0.out.0"], out.next_token_logits)
    assert call["skipped"] == {"in.1": "WideState"}


def test_a_module_shared_at_the_top_level_and_deeper_keeps_every_call_closed(tmp_path):
    """A module registered both at the root's top level and under a block is named under the
    block when the block calls it, under its top-level name otherwise; every call is closed."""

    class Block(torch.nn.Module):
        def __init__(self, act):
            super().__init__()
            self.act = act

        def forward(self, x):
            return self.act(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act = torch.nn.Tanh()
            self.emb = torch.nn.Embedding(10, 4)
            self.block = Block(self.act)

        def forward(self, input_ids):
            return self.block(self.act(self.emb(input_ids)))

    model = Net().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="x"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    handle.remove()
    meta, _ = read_pass(str(tmp_path / "x" / "rank0" / "pass-000000.safetensors"))
    calls = {c["call"]: c for c in meta["calls"]}
    assert {"act#0", "block.act#0"} <= set(calls) and all(c["post"] is not None for c in calls.values())


def test_a_model_that_contains_itself_installs_and_dumps(tmp_path):
    """A submodule holding its parent (a cycle) makes named_modules(remove_duplicate=False)
    recurse without end; the shared-module naming gives up and every module keeps its first name."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.back = torch.nn.Module()

        def forward(self, input_ids):
            return self.emb(input_ids)

    model = Net().eval()
    model.back.net = model
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="x"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    handle.remove()
    meta, _ = read_pass(str(tmp_path / "x" / "rank0" / "pass-000000.safetensors"))
    assert [c["call"] for c in meta["calls"]] == ["<root>#0", "emb#0"]


@pytest.mark.parametrize("mode", ["all", "fingerprint"])
def test_pass_metadata_leaves_the_garbage_collector_nothing_to_track(tmp_path, mode):
    """Each pass leaves hundreds of tensor metadata dicts queued for the writer. Held in tuples
    and scalars, they are untracked at the collector's first look, so they never age into the
    oldest generation, whose collection walks every object of the engine's process (150 ms
    and more with torch and transformers imported)."""
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="gc", non_intrusive_mode=mode))
    queued = []
    submit = handle._writer.submit
    handle._writer.submit = lambda record: queued.append(record) or submit(record)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]))
    handle.remove()
    metas = [meta for call in queued[0].meta["calls"] for meta in call["tensors"].values()]
    assert metas and any("print" in meta for meta in metas) == (mode == "fingerprint")
    gc.collect()
    assert [meta for meta in metas if gc.is_tracked(meta)] == []
