"""`dumpdiff kl`, `kl calibrate` and `localize` against the real sglang server on CPU.

Four servers of one tiny float32 Llama, started once each for this module:

  clean          the engine as it is. On CPU float32, prefill and decode differ by 1-2 ulps
                 on some tokens (a GEMM over 1 row vs many), so avg_kl_div is ~1e-14, not 0.
                 calibrate proposes a threshold from it and the engine passes with it.
  prefix_kv:1    a cache-restore bug: a key of layer 1 is corrupted whenever an extend pass
                 restores a prefix from the radix cache. prefill_cache_hit restores the
                 prompt, and decode_cache_hit's second turn restores the first turn: both
                 cache-hit helpers are dirty while match (no cache) is clean -> state bug, not
                 batch-invariance. localize names the planted RadixAttention (noise-aware).
  batch_variant:1  layer 1's down_proj computes differently when a pass has exactly one token
                 row. With one prompt every decode step has one row, so every helper is dirty
                 -> batch-invariance. (With several prompts batched, decode passes have
                 several rows and this planted op never bites.)

  prefix_kv:1 with --chunked-prefill-size 64
                 the references of 4 prompts (~130 tokens) no longer fit one chunk: sent
                 together, sglang cut one and its later chunk read the KV cache, so the planted
                 bug dirtied match too (batch_invariance). Sent in groups that fit a chunk they
                 are cache-free again: state bug. References longer than a chunk are chunked
                 anyway: the check then cannot tell (over_threshold), never pass.

The thresholds file calibrate writes for the clean engine is the one the planted engines are
checked against: the same model path, so the same entry.
"""

from __future__ import annotations

import json
import os

import pytest

from dumpdiff.analyzer.pytest_plugin import KLConsistency
from helpers import check_schema, dumpdiff, make_tiny_llama
from sglang_server import sglang_fixture

pytestmark = pytest.mark.sglang
sglang = sglang_fixture(scope="module")

SIZES = ("--max-samples", "4", "--max-new-tokens", "16", "--prompt-len", "16")
# An idle sglang scheduler spins a whole core on CPU; asleep, three servers fit on two cores.
IDLE = ["--sleep-on-idle"]
PLANTED_ATTN = "model.layers.1.self_attn.attn#0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("kl-llama") / "model")


@pytest.fixture(scope="module")
def clean(sglang, model_dir):
    return sglang(model_dir, extra_args=IDLE)


@pytest.fixture(scope="module")
def calibrated(clean, tmp_path_factory):
    """`dumpdiff kl calibrate` on the clean engine: (thresholds file, its JSON output)."""
    path = tmp_path_factory.mktemp("kl") / "dumpdiff-kl-thresholds.json"
    code, out, err = dumpdiff(
        "kl", "calibrate", "--url", clean.url, *SIZES, "--repeats", "2", "--thresholds", path, "--format", "json", "-q"
    )
    assert code == 0, err
    return path, json.loads(out)


def localize_json(server, kl_result: dict, tmp_path, prefix: str, *extra):
    """`dumpdiff localize` on a saved `kl` result; (its JSON result, stderr). A culprit: exit 1."""
    saved = tmp_path / "kl.json"
    saved.write_text(json.dumps(kl_result))
    code, out, err = dumpdiff(
        "localize", "--url", server.url, "--kl-result", saved, "--exp-prefix", prefix, "--format", "json", "-q", *extra
    )
    assert code == 1, err
    return json.loads(out), err


def kl_json(url, *args):
    code, out, err = dumpdiff("kl", "--url", url, "--format", "json", "-q", *args)
    assert code in (0, 1), err
    result = json.loads(out)
    check_schema(result, "kl")
    # the exit status is what the table says: 1 exactly when some helper is over its threshold
    over = [n for n, h in result["helpers"].items() if h["avg_kl_div"] > h["threshold"]]
    assert code == (1 if over else 0) and sorted(over) == sorted(result["verdict"]["dirty"])
    return code, result


def test_clean_engine_calibrates_and_passes(clean, calibrated, model_dir):
    path, calibration = calibrated
    proposal = calibration["proposal"]
    entry = json.loads(path.read_text())["entries"][calibration["written_key"]]
    assert entry["model"] == str(model_dir) and entry["tp"] == 1 and entry["kl_div"] == proposal["kl_div"]
    seen = proposal["observed_avg_kl_div"]
    assert set(seen) == {"match", "prefill_cache_hit", "decode_cache_hit"}
    assert all(v < 1e-12 for v in seen.values())  # a few float32 ulps, nothing more
    if proposal["bit_exact"]:
        assert proposal["kl_div"] == 1e-9
    else:  # CPU float32: some tokens differ by an ulp
        expected = max(10 * max(seen.values()), max(proposal["observed_max_kl"].values()))
        assert proposal["kl_div"] == pytest.approx(expected) and 0 < proposal["kl_div"] < 1e-9
    assert calibration["suspicious"] == []

    # other prompts (seed 5, not a calibration seed): the clean engine passes the calibrated check
    code, result = kl_json(clean.url, *SIZES, "--seed", "5", "--thresholds", path)
    assert code == 0 and result["verdict"]["kind"] == "pass"
    assert result["threshold"]["source"] == str(path) and result["threshold"]["value"] == proposal["kl_div"]
    for name, h in result["helpers"].items():
        assert h["status"] == "clean" and h["tokens"] == 64, name
        assert h["bit_identical"] > h["tokens"] // 2  # most tokens bit-identical, the rest an ulp or two
    assert result["helpers"]["prefill_cache_hit"]["cache_hit_rate"] == 1.0
    assert result["helpers"]["decode_cache_hit"]["cache_hit_rate"] == 1.0
    for row in result["helpers"]["prefill_cache_hit"]["per_prompt"]:
        assert row["cached_tokens"] == row["prompt_len"] - 1 and row["ref_cached_tokens"] == 0
    assert all(r["cached_tokens"] == 0 for r in result["helpers"]["match"]["per_prompt"])
    assert any("decode together: decode steps ran at batch size" in n for n in result["notes"])

    code, out, _ = dumpdiff("kl", "--url", clean.url, *SIZES, "--thresholds", path, "-q")
    assert code == 0 and out.startswith("dumpdiff kl: PASS") and "prefill_cache_hit  clean" in out


def test_text_prompts_without_tokenizer_and_missing_cache_hits(clean, tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text('"w5 w6 w7"\n')
    code, out, err = dumpdiff("kl", "--url", clean.url, "--prompts", texts, "-q")
    assert code == 2 and out == "" and err.count("\n") == 1 and "no tokenizer" in err

    # one-token prompts: nothing of the prompt can come back from the cache (the last token
    # is always recomputed), so prefill_cache_hit tests nothing and the check cannot pass
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(f"[{t}]\n" for t in (5, 9, 17, 33)))
    code, out, err = dumpdiff(
        "kl", "--url", clean.url, "--prompts", tiny, "--max-new-tokens", "8", "--threshold", "1e-6", "-q"
    )
    assert code == 2 and "dumpdiff kl: INCONCLUSIVE" in out and "prefill_cache_hit  no_cache_hit" in out
    assert "cache hits on 0 of 4 prompts" in out
    assert err.startswith("dumpdiff: error: inconclusive") and err.count("\n") == 1


class TestPytestIntegration(KLConsistency):
    """The mixin users drop into their suite, here pointed at the clean server."""

    kl_max_samples, kl_max_new_tokens, kl_prompt_len = 4, 16, 16

    @pytest.fixture
    def dumpdiff_kl_url(self, clean, calibrated):
        self.kl_thresholds = str(calibrated[0])
        return clean.url


def test_planted_cache_restore_bug_is_a_state_bug_and_localized(sglang, model_dir, calibrated, tmp_path):
    dumps = tmp_path / "dumps"
    server = sglang(
        model_dir,
        env={
            "DUMPDIFF_PLANT": "prefix_kv:1",
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(dumps),
        },
        extra_args=IDLE,
    )
    code, result = kl_json(server.url, *SIZES, "--thresholds", calibrated[0])
    status = {n: h["status"] for n, h in result["helpers"].items()}
    # both cache-hit helpers restore from the radix cache (turn 2 restores turn 1), so both are hit
    assert status == {"match": "clean", "prefill_cache_hit": "dirty", "decode_cache_hit": "dirty"}
    assert code == 1 and result["verdict"]["kind"] == "state_bug" and "cache-restore" in result["verdict"]["text"]
    assert (
        result["helpers"]["match"]["avg_kl_div"] < 1e-12 < 1e-9 < result["helpers"]["prefill_cache_hit"]["avg_kl_div"]
    )
    choice = result["verdict"]["localize"]
    assert choice["helper"] in ("prefill_cache_hit", "decode_cache_hit")

    found, err = localize_json(server, result, tmp_path, "kl-test")
    assert found["helper"] == choice["helper"] and found["replay"]["hit"]
    assert found["noise_culprits"][0]["call"] == PLANTED_ATTN and found["noise_culprits"][0]["cls"] == "RadixAttention"
    assert found["strict_culprit"]["call"]  # CPU float32: the first bit flips early (layer 0 GEMM) anyway
    assert found["dumps"] == {"dir": str(dumps), "dec": str(dumps / "kl-test-dec"), "ref": str(dumps / "kl-test-ref")}
    assert os.path.isfile(dumps / "kl-test-dec" / "run.json") and os.path.isfile(dumps / "kl-test-ref" / "run.json")
    assert "never closed" not in err
    server.stop()  # done with it: free its memory for the next server


def test_planted_batch_variant_op_dirties_every_helper(sglang, model_dir, calibrated, tmp_path):
    """The planted op is wrong only on passes of one token row: one prompt (each decode step of
    batch size 1) shows it in every helper. localize then points at the planted op first, not
    at the strict culprit (natural CPU GEMM variance), and not at a cache bug."""
    server = sglang(
        model_dir,
        env={
            "DUMPDIFF_PLANT": "batch_variant:1",
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(tmp_path / "dumps"),
        },
        extra_args=IDLE,
    )
    code, result = kl_json(
        server.url, "--max-samples", "1", "--max-new-tokens", "16", "--prompt-len", "16", "--thresholds", calibrated[0]
    )
    assert code == 1 and result["verdict"]["kind"] == "batch_invariance", result["verdict"]
    assert all(h["status"] == "dirty" for h in result["helpers"].values())
    assert not any("decode together" in n for n in result["notes"])  # one prompt: batch size 1 was run
    assert result["verdict"]["localize"]["helper"] == "match"
    found, _ = localize_json(server, result, tmp_path, "kl-bv")
    planted = "model.layers.1.mlp.down_proj#0"
    assert found["noise_culprits"][0]["call"] == planted
    assert found["reading"].startswith(f"look at {planted} first") and "not a prefix-cache restore" in found["reading"]
    server.stop()


def test_chunked_prefill_keeps_match_cache_free_or_says_it_cannot(sglang, model_dir, calibrated, tmp_path):
    """Chunked prefill reads earlier chunks back from the KV cache, as a prefix restore does:
    a reference (or match's decode-run prefill) cut into chunks is not cache-free, and the
    planted cache-restore bug then dirties match too."""
    server = sglang(
        model_dir,
        env={
            "DUMPDIFF_PLANT": "prefix_kv:1",
            "DUMPER_ENABLE": "0",
            "DUMPER_SERVER_PORT": "reuse",
            "DUMPER_DIR": str(tmp_path / "dumps"),
        },
        extra_args=IDLE + ["--chunked-prefill-size", "64"],
    )
    # every prompt+output fits one chunk (<= 40 tokens), all of them together do not
    code, result = kl_json(server.url, *SIZES, "--thresholds", calibrated[0])
    assert result["target"]["chunked_prefill_size"] == 64
    status = {n: h["status"] for n, h in result["helpers"].items()}
    assert status == {"match": "clean", "prefill_cache_hit": "dirty", "decode_cache_hit": "dirty"}, result["verdict"]
    assert result["verdict"]["kind"] == "state_bug"
    assert all(h["chunked_references"] == 0 for h in result["helpers"].values())

    # prompt+output longer than a chunk: chunked whatever the grouping; the verdict cannot tell
    longer = ("--max-samples", "4", "--max-new-tokens", "16", "--prompt-len", "48")
    code, result = kl_json(server.url, *longer, "--thresholds", calibrated[0])
    assert code == 1 and result["verdict"]["kind"] == "over_threshold", result["verdict"]
    assert "reference prefills longer than --chunked-prefill-size 64 were chunked" in result["verdict"]["text"]
    assert "restart the server with --chunked-prefill-size larger than prompt+output" in result["verdict"]["text"]
    assert result["helpers"]["match"]["chunked_references"] > 0
    assert any("longer than --chunked-prefill-size 64" in n for n in result["helpers"]["match"]["notes"])

    # localize's reading comes from the dumps: the match replay's reference has an extend pass
    found, _ = localize_json(server, result, tmp_path, "kl-chunked", "--helper", "match")
    assert found["helper"] == "match" and found["pass_modes"]["ref"].get("extend")
    assert "the reference is not cache-free" in found["reading"] and "no prefix restored" not in found["reading"]

    # one prompt longer than a chunk: both sides run the planted bug alike and agree; not a pass
    code, out, err = dumpdiff(
        "kl",
        "--url",
        server.url,
        "--max-samples",
        "1",
        "--max-new-tokens",
        "16",
        "--prompt-len",
        "96",
        "--threshold",
        "1e-10",
        "-q",
    )
    assert code == 2 and "dumpdiff kl: INCONCLUSIVE" in out and "were chunked" in out, out
    server.stop()
