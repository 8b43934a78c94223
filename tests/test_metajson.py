"""The writer reuses the JSON of a call equal to the previous pass's: the text must always be that
pass's own metadata, whatever changed and whatever stayed."""

from __future__ import annotations

import json

import torch

from dumpdiff import dumper
from dumpdiff.dumper import metajson
from helpers import load_model, prompt_ids
from tiny_models import make_tiny_llama


def test_each_pass_is_written_as_its_own_metadata_with_equal_calls_reused(tmp_path, monkeypatch):
    """A prefill, decode steps (calls equal pass to pass) and a reference prefill of another
    length (calls that differ): every text parses to its pass's metadata, and decode steps
    reuse most calls' text."""
    encoded, reused = [], []
    original, plain = metajson.MetaJson.dumps_escaped, json.dumps

    def spy(self, meta):
        calls = meta["calls"]
        before = {name: escaped for name, (_, escaped) in self._previous.items()}
        escaped = original(self, meta)
        reused.append(sum(before.get(c["call"]) is self._previous[c["call"]][1] for c in calls) / len(calls))
        encoded.append((plain(meta), json.loads('"' + escaped + '"')))  # as the header's string holds it
        return escaped

    monkeypatch.setattr(metajson.MetaJson, "dumps_escaped", spy)
    model = load_model(make_tiny_llama(tmp_path / "model", num_hidden_layers=2))
    for mode in ("fingerprint", "all"):
        handle = dumper.install(
            model, dumper.DumperConfig(dir=str(tmp_path / mode), enable=True, exp_name="run", non_intrusive_mode=mode)
        )
        with torch.no_grad():
            output = model.generate(prompt_ids(9), max_new_tokens=5, do_sample=False)
            model(output)
        handle.remove()
    assert len(encoded) == 2 * 6  # per mode: a prefill, 4 decode steps, the reference prefill
    for whole, text in encoded:
        assert _canonical(text) == _canonical(whole)
    decode_steps = reused[2:5] + reused[8:11]
    assert min(decode_steps) > 0.9 and reused[0] == 0 and max(reused[5], reused[11]) < 0.5


def test_a_call_that_changes_is_encoded_again_even_where_python_calls_it_equal():
    """1, 1.0 and True are equal in Python and 0.0 equals -0.0, but JSON writes each its own way:
    a call's argument values that change so are written as they are."""
    encoder = metajson.MetaJson()
    for step, (first, scale) in enumerate([(0, 1), (0, 1), (0, 1.0), (0, True), (0, 0.0), (0, -0.0), (4, -0.0)]):
        call = {"call": "mlp#0", "tensors": {"mlp#0.out.0": {"shape": (4, 8), "print": (first, 4)}}}
        call["values"] = {"in.scale": scale}
        meta = {"mode": "decode", "calls": [call], "step": step}
        assert _canonical(_unescaped(encoder, meta)) == _canonical(json.dumps(meta)), (step, first, scale)
        noted = dict(meta, note='a "quoted" \\ path\n')
        assert _canonical(_unescaped(encoder, noted)) == _canonical(json.dumps(noted))
    assert _unescaped(encoder, {"no calls": 1}) == json.dumps({"no calls": 1}, separators=(",", ":"))


def _unescaped(encoder, meta) -> str:
    """The JSON text a header's string holds (the encoder's escaped text, read as that string)."""
    return json.loads('"' + encoder.dumps_escaped(meta) + '"')


def _canonical(text: str) -> str:
    """The JSON as text with keys sorted: 1, 1.0, true and -0.0 stay apart (parsed values would not)."""
    return json.dumps(json.loads(text), sort_keys=True)
