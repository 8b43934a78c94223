"""The published JSON Schemas (docs/schemas/) are the contract for tools that read dumpdiff's
files: the dump's metadata, the index tables and both JSON reports. Real dumps and reports must
validate, and the report schemas must be the ones the typed result models make."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest
import torch

from dumpdiff.analyzer.kl.result import kl_schema
from dumpdiff.analyzer.verdict.across_result import compare_schema
from dumpdiff.analyzer.verdict.result import report_schema
from dumpdiff.dumper import format as fmt
from helpers import ROOT, check_schema, dump_padded_batch, first_divergence_json, load_model, make_tiny_llama


def _published(name: str) -> dict:
    with open(os.path.join(ROOT, "docs", "schemas", f"{name}.schema.json")) as handle:
        return json.load(handle)


@pytest.mark.parametrize(
    "name, made", [("first-divergence", report_schema), ("kl", kl_schema), ("compare", compare_schema)]
)
def test_published_report_schemas_are_the_typed_models(name, made):
    """Regenerate with python -m dumpdiff.analyzer.verdict.result (or .kl.result, .verdict.across_result)
    > docs/schemas/..."""
    assert _published(name) == json.loads(json.dumps(made()))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dumps(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"schemas-{request.param}")
    make_tiny_llama(root / "model", num_hidden_layers=2)
    model = load_model(root / "model", getattr(torch, request.param))
    dump_padded_batch(model, root / "dumps", new_tokens=3)
    return root / "dumps"


def _pass_meta(path: str) -> dict:
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        return json.loads(json.loads(handle.read(size))["__metadata__"][fmt.PASS_META_KEY])


def test_a_real_dump_follows_the_dump_schemas(dumps):
    for exp in ("ref", "dec"):
        with open(dumps / exp / fmt.RUN_FILE) as handle:
            check_schema(json.load(handle), "run")
        passes = sorted(glob.glob(str(dumps / exp / "rank0" / "pass-*.safetensors")))
        assert passes
        for path in passes:
            check_schema(_pass_meta(path), "pass")
        with open(dumps / exp / "rank0" / fmt.MANIFEST_FILE) as handle:
            for line in handle:
                check_schema(json.loads(line), "manifest")


def test_the_index_tables_and_the_report_follow_their_schemas(dumps):
    import pyarrow.parquet as pq

    first_divergence_json(dumps / "ref", dumps / "dec")  # builds both indexes; the report is checked inside
    tables = {}
    for path in glob.glob(str(dumps / "dec" / "index" / "*.parquet")):
        tables[os.path.basename(path)[: -len(".parquet")]] = pq.read_table(path).to_pylist()
    assert sorted(tables) == sorted(_published("index")["properties"])
    check_schema(tables, "index")


def test_a_key_the_model_does_not_declare_fails_validation(dumps):
    """The check is not vacuous: an undeclared key or a wrong type is caught."""
    _, result = first_divergence_json(dumps / "ref", dumps / "dec")
    with pytest.raises(AssertionError, match="surprise"):
        check_schema({**result, "surprise": 1}, "first-divergence")
    rank = next(iter(result["ranks"]))
    result["ranks"][rank]["rows_compared"] = "many"
    with pytest.raises(AssertionError, match="rows_compared"):
        check_schema(result, "first-divergence")


def test_an_in_process_kl_result_follows_its_schema(tmp_path):
    from dumpdiff.analyzer.kl.inprocess import check_model
    from dumpdiff.analyzer.kl.render import to_json

    make_tiny_llama(tmp_path / "model", num_hidden_layers=2)
    result = check_model(load_model(tmp_path / "model"), [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], max_new_tokens=3)
    check_schema(json.loads(to_json(result)), "kl")
