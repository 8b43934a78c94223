"""`dumpdiff repro`: the culprit's inputs at both shapes and a standalone script that replays it.

The script must reproduce on its own: it is run in a subprocess where dumpdiff (analyzer,
dumper) and transformers cannot be imported, with torch and safetensors only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_core_loop import plant_batch_variant

from dumpdiff.analyzer.report import repro
from helpers import dump_pair, dumpdiff, first_divergence_json, load_model, make_tiny_llama, prompt_ids

pytestmark = pytest.mark.slow  # minutes of CPU: left out of make test-fast

# Runs a script with a meta-path finder that refuses dumpdiff's packages (and transformers, for the
# standalone kinds), from a folder outside the repository, in isolated mode (no PYTHONPATH, no cwd).
BLOCKED_RUNNER = """
import runpy, sys
BLOCKED = set(sys.argv[2].split(","))
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked in this test: " + name)
        return None
sys.meta_path.insert(0, Blocker())
script = sys.argv[1]
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def run_script(script, blocked=("dumpdiff", "transformers", "helpers", "tiny_models"), *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", BLOCKED_RUNNER, str(script), ",".join(blocked), *args],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(str(script)),
        env=env,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=4)


@pytest.fixture(scope="module")
def natural(llama_dir, tmp_path_factory):
    """float32 on CPU, no planted bug: decode (M=1) and the reference prefill (M=32) differ naturally."""
    model = load_model(llama_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path_factory.mktemp("dumps"), prompt_ids(24), new_tokens=8)
    return ref, dec


def test_natural_float32_culprit_reproduces_standalone(llama_dir, natural, tmp_path):
    ref, dec = natural
    _, result = first_divergence_json(ref, dec)
    culprit = result["culprit"]
    assert culprit["cls"] == "Linear" and culprit["module"].startswith("model.layers.0."), culprit

    out = tmp_path / "repro"
    code, stdout, err = dumpdiff("repro", ref, dec, "--out", out, "--no-progress")  # no --model: say what is missing
    assert code == 2 and err.count("\n") == 1, err
    assert culprit["module"] in err and "parameters" in err and "--model" in err
    assert (out / "inputs_a.safetensors").exists() and not (out / "repro.py").exists()

    code, stdout, err = dumpdiff("repro", ref, dec, "--out", out, "--model", llama_dir, "--no-progress")
    assert code == 0, err
    assert f"{culprit['call']} [Linear], replayed as linear" in stdout
    assert {"repro.py", "weights.safetensors", "inputs_a.safetensors", "inputs_b.safetensors"} <= set(os.listdir(out))
    script = (out / "repro.py").read_text()
    top_imports = {line.split()[1] for line in script.splitlines() if line.startswith(("import ", "from "))}
    assert top_imports == {"argparse", "json", "math", "os", "sys", "torch", "torch.nn.functional", "safetensors.torch"}

    code, stdout, err = run_script(out / "repro.py")
    assert code == 1, stdout + err
    m_a, m_b = culprit["shapes"]["a"]["M"], culprit["shapes"]["b"]["M"]
    assert (m_a, m_b) == (32, 1)
    assert "inputs of these rows in A and B: bit-identical" in stdout
    assert "replay of A reproduces the dumped output: yes" in stdout
    assert "replay of B reproduces the dumped output: yes" in stdout
    assert f"A (M={m_a}) vs B (M={m_b}), output 0 of the same token rows: MISMATCH max abs" in stdout
    assert f"inside the full batch (M={m_a}) vs each alone (M=1): MISMATCH" in stdout
    assert "verdict: MISMATCH" in stdout

    data = (out / "inputs_a.safetensors").read_bytes()  # a copy cut short: trouble (2), not a mismatch (1)
    (out / "inputs_a.safetensors").write_bytes(data[: len(data) // 2])
    code, stdout, err = run_script(out / "repro.py")
    assert code == 2 and "repro: error: inputs_a.safetensors cannot be read" in err and "Traceback" not in err, err


def test_planted_class_is_not_replayed_as_something_else(llama_dir, tmp_path):
    """SplitKLinear lives in the test only: without the model repro cannot replay it, and the model
    builds a plain Linear there, which would not run the planted kernel: repro refuses both."""
    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(20), new_tokens=6)
    # the call named: on a processor whose bfloat16 kernels differ by batch shape, the first bit flips earlier
    call = ("--call", "model.layers.2.mlp.down_proj#0")
    code, out, err = dumpdiff("repro", ref, dec, "--out", tmp_path / "r", "--no-progress", *call)
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot replay SplitKLinear (model.layers.2.mlp.down_proj#0) without the model" in err
    assert (tmp_path / "r" / "inputs_b.safetensors").exists()
    code, out, err = dumpdiff("repro", ref, dec, "--out", tmp_path / "r", "--model", llama_dir, "--no-progress", *call)
    assert code == 2 and err.count("\n") == 1, err
    assert "builds model.layers.2.mlp.down_proj as Linear, but the dump recorded SplitKLinear" in err
    assert not (tmp_path / "r" / "repro.py").exists()


def test_bfloat16_dump_of_a_float32_checkpoint_replays_by_its_formula(llama_dir, tmp_path):
    """The checkpoint is float32, the run bfloat16: the formula check ran the module in float32 on
    bf16 inputs, failed on the dtypes and fell back to rebuilding the module through the model."""
    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(20), new_tokens=4)
    code, out, err = dumpdiff(
        "repro",
        ref,
        dec,
        "--out",
        tmp_path / "r",
        "--model",
        llama_dir,
        "--call",
        "model.layers.1.mlp.down_proj#0",
        "--no-progress",
    )
    assert code == 0, err
    assert "[Linear], replayed as linear" in out and "checked bit for bit against Linear" in out, out
    code, out, err = run_script(tmp_path / "r" / "repro.py")
    assert "replay of A reproduces the dumped output: yes (bit-identical)" in out, out + err


def test_a_call_that_carries_noise_is_replayed_on_its_cached_rows(llama_dir, tmp_path):
    """--call on a noise-aware culprit (its inputs carry float noise, so it is never the strict
    origin): the replay took the prompt's rows of the prefill, where the bug does not run."""
    model = load_model(llama_dir, torch.float32)
    model.model.layers[2].mlp.register_forward_hook(lambda m, a, out: out * 1.01 if out.shape[1] == 1 else None)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(24), new_tokens=8)  # prompt rows 16.. differ too
    code, out, err = dumpdiff(
        "repro",
        ref,
        dec,
        "--out",
        tmp_path / "r",
        "--model",
        llama_dir,
        "--call",
        "model.layers.2.mlp#0",
        "--no-progress",
    )
    assert code == 0, err
    assert "B dec pass 1 (decode, M=1)" in out, out
    # a victim: its inputs already differ, so its different outputs test nothing (was "verdict: MATCH")
    code, out, err = run_script(tmp_path / "r" / "repro.py", ("dumpdiff",))
    assert code == 2 and "inputs of these rows in A and B: DIFFER" in out and "verdict: NOT TESTED" in out, out + err


def test_unknown_class_is_rebuilt_through_the_model(llama_dir, tmp_path):
    """Only MLPs hooked: the culprit is LlamaMLP, replayed by calling the model's own module. The
    planted kernel is not in the model, and the script says so honestly: its replay of B does not
    reproduce the dumped output, and the outputs match."""
    model = load_model(llama_dir, torch.bfloat16)
    plant_batch_variant(model, layer=2)
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(20), new_tokens=6, filter="cls=LlamaMLP|Embedding")
    code, out, err = dumpdiff("repro", ref, dec, "--out", tmp_path / "r", "--model", llama_dir, "--no-progress")
    assert code == 0, err
    assert "model.layers.2.mlp#0 [LlamaMLP], replayed as module" in out and "transformers" in out
    code, out, err = run_script(tmp_path / "r" / "repro.py", ("dumpdiff",))
    assert code == 0, out + err
    assert "replay of A reproduces the dumped output: yes" in out
    assert "replay of B reproduces the dumped output: NO" in out
    assert "verdict: MATCH" in out


def test_attention_with_a_cache_is_refused(llama_dir, natural, tmp_path):
    ref, dec = natural
    code, out, err = dumpdiff(
        "repro",
        ref,
        dec,
        "--out",
        tmp_path / "r",
        "--model",
        llama_dir,
        "--call",
        "model.layers.1.self_attn#0",
        "--no-progress",
    )
    assert code == 2 and "in.past_key_values (DynamicCache)" in err and "--call" in err
    code, out, err = dumpdiff("repro", ref, dec, "--out", tmp_path / "r", "--call", "nope#0", "--no-progress")
    assert code == 2 and "no call 'nope#0'" in err


class Source:
    """What ModelSource gives, from an in-memory module: its class and its parameters."""

    path = "in-memory"

    def __init__(self, module):
        self.sub = module

    def module(self, path, cls):
        assert type(self.sub).__name__ == cls
        return path, self.sub

    def params(self, path, sub, dtype):
        return {k: v.detach().clone() for k, v in sub.state_dict().items()}


class Sdpa(torch.nn.Module):
    def forward(self, query, key, value, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal)


def leaf_cases():
    from transformers.activations import NewGELUActivation, SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data.normal_()
    layer_norm = torch.nn.LayerNorm(64)
    layer_norm.weight.data.normal_()
    x = torch.randn(1, 16, 64)
    ids = torch.randint(0, 100, (1, 16))
    return [
        ("linear", torch.nn.Linear(64, 32), x),
        ("rmsnorm_hf", norm, x),
        ("layernorm", layer_norm, x),
        ("embedding", torch.nn.Embedding(100, 64), ids),
        ("activation", SiLUActivation(), x),
        ("activation", NewGELUActivation(), x),
        ("activation", torch.nn.GELU(approximate="tanh"), x),
    ]


def captured_for(module, cls, inputs_a, inputs_b, row, dims_a, dims_b, values_a=None, values_b=None):
    """What repro.collect gives, made from an in-memory module: A = the full batch (M=16), B = the
    row's own call (M=1). dims: token dims of each input slot, and of the output under "out"."""
    with torch.no_grad():
        out_a, out_b = module(**inputs_a, **(values_a or {})), module(**inputs_b, **(values_b or {}))

    def side(inputs, dims, r, m, values):
        return {
            "label": "x",
            "pass": 0,
            "mode": "prefill",
            "M": m,
            "row_names": [f"s@{row}"],
            "token_rows": [r],
            "token_dims": {s: dims.get(s) for s in inputs},
            "rows": {s: ([r] if dims.get(s) is not None else None) for s in inputs},
            "shapes": {s: list(t.shape) for s, t in inputs.items()},
            "out_dims": dims["out"],
            "out_rows": [r],
            "values": values or {},
        }

    meta = {
        "call": "m#0",
        "module": "m",
        "cls": cls,
        "rank": 0,
        "out_slot": "0",
        "notes": [],
        "device": "cpu",
        "dtype": None,
        "dump_versions": "",
        "dumps": {"a": "a", "b": "b"},
        "sides": {"a": side(inputs_a, dims_a, row, 16, values_a), "b": side(inputs_b, dims_b, 0, 1, values_b)},
    }
    return {"meta": meta, "inputs": {"a": inputs_a, "b": inputs_b}, "outputs": {"a": out_a, "b": out_b}, "skipped": {}}


@pytest.mark.parametrize("case", range(7))
def test_leaf_formulas_replay_the_module_bit_for_bit(case, tmp_path):
    """Each standalone formula equals its module's code (checked by repro, then by the script
    against the module's real outputs, with neither dumpdiff nor transformers importable)."""
    kind, module, x = leaf_cases()[case]
    slot = "hidden_states" if kind == "rmsnorm_hf" else "input"
    dims = {slot: [0, 1], "out": [0, 1]}
    captured = captured_for(module, type(module).__name__, {slot: x}, {slot: x[:, 5:6].contiguous()}, 5, dims, dims)
    result = repro.write_bundle(str(tmp_path), captured, Source(module))
    assert result["meta"]["kind"] == kind and any("checked bit for bit" in n for n in result["meta"]["notes"])
    code, out, err = run_script(tmp_path / "repro.py")
    assert code in (0, 1), out + err
    assert (
        "replay of A reproduces the dumped output: yes" in out
        and "replay of B reproduces the dumped output: yes" in out
    )
    assert "inputs of these rows in A and B: bit-identical" in out and "vs each alone (M=1)" in out


def test_sdpa_replays_prefill_and_decode_without_a_model(tmp_path):
    """A module around torch SDPA: causal over 16 query rows (A) vs query row 9 alone against its
    10 keys (B, as in decode). Its is_causal argument differs per call and is replayed per side."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    inputs_a = {"query": q, "key": k, "value": v}
    inputs_b = {
        "query": q[:, :, 9:10].contiguous(),
        "key": k[:, :, :10].contiguous(),
        "value": v[:, :, :10].contiguous(),
    }
    dims = {"query": [0, 2], "out": [0, 2]}
    captured = captured_for(
        Sdpa(), "Sdpa", inputs_a, inputs_b, 9, dims, dims, {"is_causal": True}, {"is_causal": False}
    )
    captured["meta"]["sides"]["b"]["token_dims"].update(key=None, value=None)
    result = repro.write_bundle(str(tmp_path), captured, None)
    assert result["meta"]["kind"] == "sdpa" and not result["meta"]["rowwise"]
    assert any("unchecked" in n for n in result["meta"]["notes"])
    code, out, err = run_script(tmp_path / "repro.py")
    assert code in (0, 1), out + err
    assert (
        "replay of A reproduces the dumped output: yes" in out
        and "replay of B reproduces the dumped output: yes" in out
    )
    # B's 10 keys are A's first 10, all that query row 9 sees: the same inputs (a difference is the kernel's)
    assert "inputs of these rows in A and B: bit-identical" in out
    assert "vs each alone" not in out  # attention is not row-wise: no alone replay
    assert ("verdict: MISMATCH" in out) == (code == 1) and ("verdict: MATCH" in out) == (code == 0)

    # a cached key that differs (a state bug): nothing the replay can test, and not "the same outputs"
    stale_key = inputs_b["key"].clone()
    stale_key[:, :, 3] += 1
    captured = captured_for(
        Sdpa(),
        "Sdpa",
        inputs_a,
        {**inputs_b, "key": stale_key},
        9,
        dims,
        dims,
        {"is_causal": True},
        {"is_causal": False},
    )
    captured["meta"]["sides"]["b"]["token_dims"].update(key=None, value=None)
    repro.write_bundle(str(tmp_path / "stale"), captured, None)
    code, out, err = run_script(tmp_path / "stale" / "repro.py")
    assert code == 2 and "DIFFER in key" in out and "verdict: NOT TESTED" in out, out + err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_can_place_weights_where_a_memory_mapped_checkpoint_left_them(dtype):
    """A checkpoint's loader leaves weights at any offset in a 64-byte line and some CPUs' kernels
    round by alignment: the script retries the weights at each offset its element size allows,
    each one a bit-exact copy at exactly that offset."""
    from dumpdiff.analyzer.report.repro_script import runtime

    env = runtime()
    weight = torch.randn(33, 7).to(dtype)
    offsets = env["weight_offsets"]({"weight": weight, "bias": torch.randn(33)})
    size = torch.empty((), dtype=dtype).element_size()
    assert offsets == list(range(size, 64, size))  # every offset the smallest element allows
    for offset in offsets:
        copy = env["placed"](weight, offset)
        assert copy.data_ptr() % 64 == offset and copy.dtype == dtype and copy.shape == weight.shape
        bits = torch.int16 if size == 2 else torch.int32
        assert torch.equal(copy.view(bits), weight.view(bits))
