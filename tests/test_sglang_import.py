"""dumpdiff import-sglang: dumps of sglang's BUILT-IN dumper (not ours) analyzed by dumpdiff.

The real sglang server runs with our plugin kept out (SGLANG_PLUGINS=none), its own dumper in
non-intrusive mode 'all', driven over its HTTP control route; both dumps are converted and
first-divergence must prove the prefill<->decode alignment and pair every decode row.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import dumpdiff, make_tiny_llama, prompt_ids
from sglang_server import sglang_fixture

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", num_hidden_layers=2)


def test_import_builtin_dumper_and_align_prefill_with_decode(sglang, model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    env = {
        "SGLANG_PLUGINS": "none",
        "DUMPER_ENABLE": "0",
        "DUMPER_SERVER_PORT": "reuse",
        "DUMPER_NON_INTRUSIVE_MODE": "all",
        "DUMPER_DIR": str(dumps),
    }
    server = sglang(model_dir, env=env)
    assert "dumpdiff: dumper installed" not in server.log_text()  # our plugin was kept out
    prompt = prompt_ids(9, seed=1)[0].tolist()
    server.request("/dumper/configure", {"enable": True, "exp_name": "dec"})
    result = server.generate([prompt], max_new_tokens=NEW_TOKENS)[0]
    server.request("/dumper/configure", {"exp_name": "ref"})
    server.flush_cache()
    server.generate([prompt + result["output_ids"]], max_new_tokens=0)
    server.request("/dumper/configure", {"enable": False})
    names = os.listdir(dumps / "dec")
    assert names and all(n.endswith(".pt") and n.startswith("step=") for n in names)
    assert any("non_intrusive__model.embed_tokens.output" in n for n in names)

    for exp in ("ref", "dec"):
        code, out, err = dumpdiff("import-sglang", dumps / exp, tmp_path / "conv" / exp)
        assert code == 0, err
        assert "rank0" in out and "refused" not in out
        run = json.loads((tmp_path / "conv" / exp / "run.json").read_text())
        assert run["engine"] == "sglang-builtin" and run["format"] == "dumpdiff"
    code, out, err = dumpdiff("import-sglang", dumps / "dec", tmp_path / "conv" / "dec")
    assert code == 2 and err.startswith("dumpdiff: error:") and "already exists" in err

    code, out, err = dumpdiff(
        "first-divergence", tmp_path / "conv" / "ref", tmp_path / "conv" / "dec", "--format", "json", "--no-progress"
    )
    assert code in (0, 1), err
    verdict = json.loads(out)["ranks"]["0"]
    align = verdict["alignment"]
    decode_rows = NEW_TOKENS - 1  # the last new token is sampled, never fed back
    assert align["rows_b"] == len(prompt) + decode_rows
    assert align["unaligned_b"] == 0 and align["unkeyed_b"] == 0
    assert "bit-identical" in align["proof"][1] and align["embedding"] == "model.embed_tokens"
    assert {r["kind"] for r in verdict["per_row"]} <= {"prefill", "decode"}
    code, out, err = dumpdiff(
        "first-divergence", tmp_path / "conv" / "ref", tmp_path / "conv" / "dec", "--format", "md", "--no-progress"
    )
    assert code in (0, 1) and "alignment" in out.lower(), err


def test_weights_only_refusal_is_skipped_and_counted(tmp_path):
    """A file torch.load(weights_only=True) refuses is never unpickled: skipped with a warning."""
    src = tmp_path / "src"
    src.mkdir()
    tag = "step=0___rank=0___dump_index={}___name={}.pt"
    core = {
        "input_ids": torch.tensor([5, 6, 7]),
        "positions": torch.tensor([0, 1, 2]),
        "seq_lens": torch.tensor([3]),
        "rids": ["req-a"],
    }
    for i, (name, value) in enumerate(core.items(), 1):
        torch.save({"value": value, "meta": {}}, src / tag.format(i, name))
    torch.save({"value": torch.tensor([5, 6, 7]), "meta": {}}, src / tag.format(5, "non_intrusive__embed.inputs.0"))
    torch.save({"value": torch.ones(3, 4), "meta": {}}, src / tag.format(6, "non_intrusive__embed.output"))
    torch.save({"value": _Evil(), "meta": {}}, src / tag.format(7, "non_intrusive__embed.output.1"))
    os.mkfifo(src / tag.format(8, "non_intrusive__embed.output.2"))  # torch.load on it waited forever
    # tensors the format does not hold: skipped as the dumper skips them (import or index failed on them)
    torch.save(
        {"value": torch.ones(3, 4, dtype=torch.complex64), "meta": {}},
        src / tag.format(9, "non_intrusive__embed.output.3"),
    )
    torch.save({"value": torch.eye(3).to_sparse(), "meta": {}}, src / tag.format(10, "non_intrusive__embed.output.4"))
    # a name that is not UTF-8 cannot name a safetensors tensor: the import said "internal error"
    latin1 = os.fsencode(src) + b"/" + tag.format(11, "non_intrusive__emb\xe9d.output").encode("latin-1")
    with open(latin1, "wb") as handle:
        torch.save({"value": torch.ones(3, 4), "meta": {}}, handle)
    code, out, err = dumpdiff("import-sglang", src, tmp_path / "dst", timeout=120)
    assert code == 0, err
    assert "2 file(s) refused by torch.load(weights_only=True)" in out and "not a regular file; skipped" in out + err
    assert "1 .pt file(s) whose name is not valid UTF-8 ignored" in out
    code, out, err = dumpdiff("index", tmp_path / "dst", "--no-progress")
    assert code == 0, err


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dumpdiff-should-never-exist",))
