"""Fingerprint dumps of the real sglang server on CPU: the workflow of test_sglang_e2e.py with
DUMPER_NON_INTRUSIVE_MODE=fingerprint names the planted prefix-cache bug's call, as a full dump
of the same requests does (bfloat16: on this CPU its first bit flip is the planted one), and a
focused second run, configured over HTTP, gives the full dump's figures and noise-aware verdict."""

from __future__ import annotations

import glob
import os
import shlex

import pytest
from test_sglang_e2e import ctl

from helpers import dumpdiff, first_divergence_json, make_tiny_llama, prompt_ids
from sglang_server import sglang_fixture

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")
PLANTED = "model.layers.1.self_attn.attn#0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=3)


def dump_run(server, prompt, name, *settings, new_tokens=6):
    """dec<name>: a cache-hit generate; ref<name>: flushed, one prefill of prompt+output."""
    server.flush_cache()
    server.generate([prompt], max_new_tokens=1)  # fills the radix cache; not dumped
    ctl(server, "enable=true", f"exp_name=dec{name}", *settings)
    result = server.generate([prompt], max_new_tokens=new_tokens)[0]
    ctl(server, f"exp_name=ref{name}")
    server.flush_cache()
    server.generate([prompt + result["output_ids"]], max_new_tokens=0)
    state = ctl(server, "enable=false")
    return result, state


def test_fingerprint_dump_of_the_sglang_server_names_the_planted_call(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(
        model_dir,
        env={
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(dumps),
            "DUMPER_NON_INTRUSIVE_MODE": "fingerprint",
            "DUMPDIFF_PLANT": "prefix_kv:1",
        },
        extra_args=["--dtype", "bfloat16"],
    )
    prompt = prompt_ids(20, seed=3)[0].tolist()
    fp_run, fp_state = dump_run(server, prompt, "-fp")
    # decode steps after the first follow its plan (dumper/passplan.py) in the engine too
    assert fp_state[0]["passes_planned"] >= 3
    full_run, _ = dump_run(server, prompt, "-full", "non_intrusive_mode=all")
    assert fp_run["output_ids"] == full_run["output_ids"]
    code, fp = first_divergence_json(dumps / "ref-fp", dumps / "dec-fp")
    assert code == 1
    verdict = fp["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and "bit-identical" in verdict["alignment"]["proof"][1]
    strict_calls = {r["culprit"] for r in verdict["per_row"]}
    assert PLANTED in strict_calls
    assert strict_calls <= {PLANTED} | {c for c in strict_calls if ".layers.0." in c}
    assert fp["kind"] == "not-judged" and "fingerprint dump" in verdict["summary"]
    _, full = first_divergence_json(dumps / "ref-full", dumps / "dec-full")

    def rows(result):  # sequences are request ids: new in every run
        return [(r["pos"], r["kind"], r["culprit"]) for r in result["ranks"]["0"]["per_row"]]

    assert rows(fp) == rows(full) and fp["culprit"]["call"] == full["culprit"]["call"]
    from safetensors import safe_open

    for name in ("dec-fp", "ref-fp"):  # one small file per pass: the print table alone (and the metadata)
        files = glob.glob(str(dumps / name / "rank0" / "*.safetensors"))
        assert files
        for path in files:
            with safe_open(path, "np") as handle:
                assert list(handle.keys()) == ["~rowprints"]
        full_bytes = sum(
            os.path.getsize(f) for f in glob.glob(str(dumps / name.replace("fp", "full") / "rank0" / "*.safetensors"))
        )
        assert sum(os.path.getsize(f) for f in files) < full_bytes

    code, out, err = dumpdiff("focus", dumps / "ref-fp", dumps / "dec-fp", "--no-progress")
    assert code == 0, err
    settings = [line.split("=", 1) for line in out.splitlines() if line.startswith("DUMPER_")]
    args = [f"{k.replace('DUMPER_', '').lower()}={shlex.split(v)[0]}" for k, v in settings]
    dump_run(server, prompt, "-focus", *args)
    code, focused = first_divergence_json(dumps / "ref-focus", dumps / "dec-focus")
    assert code == 1
    assert focused["culprit"]["call"] == PLANTED  # now with its values: figures and the noise-aware verdict
    for key in ("max_abs", "max_ulp", "rel"):
        assert focused["culprit"][key] == full["culprit"][key] is not None
    noise = [c["call"] for c in focused["ranks"]["0"]["noise"]["culprits"]]
    assert focused["kind"] == full["kind"] and noise == [c["call"] for c in full["ranks"]["0"]["noise"]["culprits"]]


def test_per_head_norm_rows_of_a_flat_engine_are_printed_token_by_token(sglang, tmp_path):
    """sglang's Qwen3 applies q_norm and k_norm to [T*heads, head_dim], held as [T, heads, head_dim]:
    their prints are per token row too, so the norms are compared row by row on a fingerprint dump
    and its verdict (with a decode-only error in layer 1's q_norm) is the full dump's."""
    from tiny_models import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "qwen3", num_hidden_layers=2)
    dumps = tmp_path / "dumps"
    server = sglang(
        model,
        env={
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(dumps),
            "DUMPER_NON_INTRUSIVE_MODE": "fingerprint",
            "DUMPDIFF_PLANT": "q_norm:1",
        },
        extra_args=["--dtype", "bfloat16"],
    )
    try:
        prompt = prompt_ids(12, seed=12)[0].tolist()
        dump_run(server, prompt, "-fp")
        dump_run(server, prompt, "-full", "non_intrusive_mode=all")
    finally:
        server.stop()
    code, fp = first_divergence_json(dumps / "ref-fp", dumps / "dec-fp")
    _, full = first_divergence_json(dumps / "ref-full", dumps / "dec-full")
    verdict = fp["ranks"]["0"]
    assert code == 1 and not any("_norm" in n["call"] for n in verdict["not_comparable"])
    assert fp["culprit"]["call"] == full["culprit"]["call"]
    assert [(r["pos"], r["culprit"]) for r in verdict["per_row"]] == [
        (r["pos"], r["culprit"]) for r in full["ranks"]["0"]["per_row"]
    ]
    timeline = {c["call"]: c for c in verdict["calls_timeline"]}
    norm = timeline["model.layers.1.self_attn.q_norm#0"]
    assert norm["rows"] == verdict["rows_compared"] and norm["rows"] > 0  # compared on every token row
    assert timeline == {c["call"]: c for c in full["ranks"]["0"]["calls_timeline"]}


def test_tensor_parallel_ranks_write_and_compare_their_own_fingerprints(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(
        model_dir,
        tp=2,
        env={
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(dumps),
            "DUMPER_NON_INTRUSIVE_MODE": "fingerprint",
        },
        startup_timeout=400,
    )
    try:
        prompt = prompt_ids(10, seed=5)[0].tolist()
        dump_run(server, prompt, "-fp", new_tokens=4)
        dump_run(server, prompt, "-full", "non_intrusive_mode=all", new_tokens=4)
    finally:
        server.stop()
    assert sorted(os.listdir(dumps / "dec-fp")) >= ["rank0", "rank1", "run.json"]
    code, fp = first_divergence_json(dumps / "ref-fp", dumps / "dec-fp")
    _, full = first_divergence_json(dumps / "ref-full", dumps / "dec-full")
    assert set(fp["ranks"]) == {"0", "1"}
    for rank, verdict in fp["ranks"].items():
        assert verdict["alignment"]["unaligned_b"] == 0 and "bit-identical" in verdict["alignment"]["proof"][1]
        assert [(r["pos"], r["culprit"]) for r in verdict["per_row"]] == [
            (r["pos"], r["culprit"]) for r in full["ranks"][rank]["per_row"]
        ]
