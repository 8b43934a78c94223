"""The KL consistency check without a server: scoring, verdict, thresholds, prompts, the HF
in-process check on a real tiny model (clean, a planted batch-variant op, a planted
cache-restore bug; a state-space model without a KV cache), the sglang helpers' grouping of
prefills under chunked prefill (on a stand-in server), localize's reading of the dumped path,
the CLI's trouble path, and the pytest integration's failure message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dumpdiff.analyzer.errors import DumpError
from dumpdiff.analyzer.kl import prompts as kl_prompts
from dumpdiff.analyzer.kl import score as kl
from dumpdiff.analyzer.kl import thresholds as kl_thresholds
from dumpdiff.analyzer.kl.helpers import Context, _check_ids, prefill_groups, prefill_logprobs, run_match
from dumpdiff.analyzer.kl.inprocess import check_model
from dumpdiff.analyzer.kl.localize import reading
from dumpdiff.analyzer.kl.render import render
from dumpdiff.analyzer.pytest_plugin import KLCheckFailed, assert_kl_pass
from helpers import dumpdiff, load_model, make_tiny_llama

# -- scoring ---------------------------------------------------------------------------------------


def test_k3_of_one_ulp_is_exact_and_positive():
    a = np.float32(-6.4)
    b = np.nextafter(a, np.float32(0))
    k3 = kl.token_kl([float(a)], [float(b)])[0]
    logr = float(a) - float(b)
    assert k3 > 0 and k3 == pytest.approx(logr * logr / 2, rel=1e-6)  # exp(x)-1-x would round this to noise


def test_score_prompt_counts():
    s = kl.score_prompt([-1.0, -2.0, -3.0], [-1.0, -2.5, -3.0], threshold=1e-3)
    assert s["tokens"] == 3 and s["bit_identical"] == 2 and s["over"] == 1 and s["first_over"] == 1
    assert s["max_pos"] == 1 and s["mean_kl"] == pytest.approx((np.exp(0.5) - 1.5) / 3)


def test_summary_is_mean_of_prompt_means_and_skips_misses():
    prompts = [
        {"index": 0, "hit": True, "prefill_lp": [0.0, 0.0], "decode_lp": [0.0, -0.2]},
        {"index": 1, "hit": True, "prefill_lp": [0.0] * 8, "decode_lp": [0.0] * 8},
        {"index": 2, "hit": False, "prefill_lp": None, "decode_lp": [0.0]},
    ]
    h = kl.summarize_helper("prefill_cache_hit", prompts, 1e-3)
    per0 = (np.exp(0.2) - 1.2) / 2
    assert h["avg_kl_div"] == pytest.approx(per0 / 2)  # (per0 + 0) / 2 prompts, not over 10 tokens
    assert h["cache_hits"] == 2 and h["cache_hit_rate"] == pytest.approx(2 / 3) and h["scored_prompts"] == 2
    assert h["status"] == "dirty" and h["worst"] == 0 and h["bit_identical"] == 9


def _helper(status, avg=0.0):
    return {"status": status, "avg_kl_div": avg, "worst": 0}


@pytest.mark.parametrize(
    "m,p,d,kind",
    [
        ("clean", "clean", "clean", kl.PASS),
        ("dirty", "dirty", "dirty", kl.BATCH),
        ("clean", "dirty", "clean", kl.STATE),
        ("clean", "dirty", "dirty", kl.STATE),  # a prefix-restore bug bites both cache helpers
        ("clean", "clean", "dirty", kl.STATE),
        ("dirty", "clean", "clean", kl.MIXED),
        ("clean", "no_cache_hit", "clean", kl.INCONCLUSIVE),
        ("clean", "no_cache_hit", "dirty", kl.STATE),  # a dirty helper decides even when another lacks hits
        ("dirty", "n/a", "n/a", kl.BATCH),  # no radix cache: the verdict rests on match
        ("clean", "n/a", "n/a", kl.PASS),
        (None, "dirty", "clean", kl.UNCLASSIFIED),  # --helpers without match: cannot tell the two apart
        (None, "clean", "clean", kl.PASS),
    ],
)
def test_verdict(m, p, d, kind):
    helpers = {"match": _helper(m), "prefill_cache_hit": _helper(p), "decode_cache_hit": _helper(d)}
    helpers = {n: h for n, h in helpers.items() if h["status"]}
    verdict = kl.classify(helpers)
    assert verdict["kind"] == kind
    assert kl.exit_status(verdict) == {kl.PASS: 0, kl.INCONCLUSIVE: 2}.get(kind, 1)
    if kind == kl.STATE:
        assert verdict["localize"]["helper"] in kl.CACHE_HELPERS and "state bug" in verdict["text"]
    if kind == kl.BATCH:
        assert verdict["localize"]["helper"] == "match"


def _chunked(status, chunked):
    return {**_helper(status), "chunked_references": chunked, "chunked_prefill_size": 32, "scored_prompts": 4}


def test_verdict_with_chunked_references():
    """A reference longer than the chunk read the KV cache: a dirty match then proves nothing
    about batch-variance, and a clean check may hide a cache bug that ran on both sides."""
    message = (
        "reference prefills longer than --chunked-prefill-size 32 were chunked (match 2 of 4): they read the "
        "KV cache, so a cache bug dirties match too; restart the server with --chunked-prefill-size larger "
        "than prompt+output (or -1), or use shorter --prompt-len/--max-new-tokens"
    )
    dirty = kl.classify(
        {
            "match": _chunked("dirty", 2),
            "prefill_cache_hit": _chunked("dirty", 0),
            "decode_cache_hit": _chunked("dirty", 0),
        }
    )
    assert dirty["kind"] == kl.UNCLASSIFIED and dirty["text"].endswith(message) and kl.exit_status(dirty) == 1
    mixed = kl.classify(
        {
            "match": _chunked("dirty", 2),
            "prefill_cache_hit": _chunked("clean", 0),
            "decode_cache_hit": _chunked("clean", 0),
        }
    )
    assert mixed["kind"] == kl.UNCLASSIFIED  # not "no_cache_only": match is not the no-cache path here
    clean = kl.classify(
        {
            "match": _chunked("clean", 0),
            "prefill_cache_hit": _chunked("clean", 0),
            "decode_cache_hit": _chunked("clean", 3),
        }
    )
    assert clean["kind"] == kl.INCONCLUSIVE and "decode_cache_hit 3 of 4" in clean["text"]
    assert kl.exit_status(clean) == 2
    state = kl.classify(
        {
            "match": _chunked("clean", 2),
            "prefill_cache_hit": _chunked("dirty", 2),
            "decode_cache_hit": _chunked("dirty", 4),
        }
    )
    assert state["kind"] == kl.STATE and any("were chunked" in n for n in state["notes"])
    rows = [
        {"index": i, "hit": True, "ref_chunked": i < 2, "prefill_lp": [0.0], "decode_lp": [-0.1 * i]} for i in range(4)
    ]
    summary = kl.summarize_helper("match", rows, 1e-3, chunk_size=32)
    assert summary["chunked_references"] == 2 and summary["chunked_prefill_size"] == 32
    assert summary["avg_kl_div_unchunked"] == pytest.approx(np.mean(kl.token_kl([0.0, 0.0], [-0.2, -0.3])))
    # match is dirty on its cache-free references alone: that still decides
    both = kl.classify(
        {"match": summary, "prefill_cache_hit": _chunked("dirty", 0), "decode_cache_hit": _chunked("dirty", 0)}
    )
    assert both["kind"] == kl.BATCH and any("were chunked" in n for n in both["notes"])


def test_prefill_groups_fit_one_chunk():
    assert prefill_groups([10, 20, 5], None) == [[0, 1, 2]]  # chunked prefill off: all at once
    assert prefill_groups([10, 20, 5, 30, 40, 8], 32) == [[0, 1], [2], [3], [4], [5]]
    assert prefill_groups([16, 16, 16], 32) == [[0, 1], [2]]  # exactly a chunk is not cut
    assert prefill_groups([3, 3, 3], 8, page_size=4) == [[0, 1], [2]]  # charged page-aligned
    assert prefill_groups([], 32) == []


class StandInServer:
    """The Server calls run_match makes, recorded: each generate batch and each flush."""

    chunk_size, page_size = 32, 1

    def __init__(self):
        self.calls = []

    def flush(self):
        self.calls.append("flush")

    def generate(self, input_ids, max_new_tokens, *, sampling, return_logprob=True, logprob_start_len=-1):
        self.calls.append([len(ids) for ids in input_ids])
        out = []
        for ids in input_ids:
            new = [7] * max_new_tokens
            out.append(
                {
                    "output_ids": new,
                    "meta_info": {
                        "cached_tokens": 0,
                        "output_token_logprobs": [[-1.0, t, None] for t in new],
                        "input_token_logprobs": [[None if k == 0 else -1.0, t, None] for k, t in enumerate(ids)],
                    },
                }
            )
        return out


def test_match_never_packs_prefills_past_a_chunk():
    """sglang packs the requests waiting at a step into one prefill batch and cuts the one that
    overflows the chunk; its later chunk reads the cache, so match's prefills go in groups."""
    server = StandInServer()
    ctx = Context(server, max_new_tokens=8, sampling={}, vocab_size=None)
    prompts = [[5] * n for n in (10, 12, 20, 40)]
    rows, notes = run_match(ctx, prompts)
    batches = [c for c in server.calls if c != "flush"]
    assert batches == [[10, 12], [20], [40], [18], [20], [28], [48]]  # decode run, then references
    assert all(sum(b) <= 32 or len(b) == 1 for b in batches)
    assert all(server.calls[i - 1] == "flush" for i, c in enumerate(server.calls) if c != "flush")  # none restores
    assert [r["ref_chunked"] for r in rows] == [False, False, False, True]
    assert any("groups of 2, 1, 1 prompts" in n for n in notes) and ctx.decode_batches == {"match": [2, 1, 1]}
    assert any("1 of 4 reference prefills" in n and "--chunked-prefill-size 32" in n for n in notes)


def test_every_helper_decodes_in_match_groups():
    """Split for chunked prefill, match decoded in groups of 2, 1, 1 while the cache-hit helpers
    decoded all 4 together: a kernel taken at batch size 1 ran in match alone, and a batch-variant
    bug read as 'no-cache path dirty, recalibrate' or pass."""
    from dumpdiff.analyzer.kl.helpers import run_decode_cache_hit, run_prefill_cache_hit

    class CacheHitStandIn(StandInServer):
        kv_tokens, has_tokenizer = None, False

    prompts = [[5] * n for n in (10, 12, 20, 24)]
    for runner in (run_prefill_cache_hit, run_decode_cache_hit):
        server = CacheHitStandIn()
        runner(Context(server, max_new_tokens=8, sampling={}, vocab_size=None, turn_token=3), prompts)
        generates = [c for c in server.calls if c != "flush"]
        # the warm-up (or turn 1) in chunk groups of 2, 1, 1; then the scored decode run in match's groups
        assert [len(b) for b in generates[:6]] == [2, 1, 1, 2, 1, 1], (runner.__name__, generates)


def test_localize_reading_follows_the_dumped_passes():
    """The match replay restores no prefix, but a reference longer than a chunk does: the
    reading says so from the reference dump's extend passes, not from the helper name."""
    noise = [{"call": "model.layers.1.self_attn.attn#0"}]
    strict = {"call": "model.layers.0.self_attn.qkv_proj#0"}
    plain = {"dec": {"prefill": 1, "decode": 15}, "ref": {"prefill": 1}}
    text = reading("match", strict, noise, True, plain)
    assert "no prefix restored from the cache in either dump" in text and "not a prefix-cache restore" in text
    chunked = {"dec": {"prefill": 1, "decode": 15}, "ref": {"prefill": 1, "extend": 1}}
    text = reading("match", strict, noise, True, chunked)
    assert "no prefix restored" not in text and "the reference is not cache-free: 1 of its 2 passes" in text
    hit = {"dec": {"extend": 1, "decode": 15}, "ref": {"prefill": 1}}
    assert "on the decode run's cache path (1 of its passes" in reading("prefill_cache_hit", strict, noise, True, hit)
    assert "not cache-free" in reading("match", strict, [], True, chunked)  # strict-only reading too
    # a cache-hit helper dirty, nothing beyond noise in bfloat16: the bug may hide under 16-bit noise
    assert "restart the server in float32" in reading("prefill_cache_hit", strict, [], True, hit, dtype="bfloat16")
    assert "float32" not in reading("prefill_cache_hit", strict, [], True, hit, dtype="float32")


def test_batch_variance_with_a_state_bug_on_top_is_noted():
    helpers = {
        "match": _helper("dirty", 1e-6),
        "prefill_cache_hit": _helper("dirty", 1e-2),
        "decode_cache_hit": _helper("dirty", 2e-6),
    }
    verdict = kl.classify(helpers)
    assert verdict["kind"] == kl.BATCH
    assert any("prefill_cache_hit" in n and "state bug" in n for n in verdict["notes"])


# -- logprob ids: positions are the truth ---------------------------------------------------------


def test_vocab_quirk_is_tolerated_and_misalignment_refused():
    assert _check_ids([5, 0, 7], [5, 1023, 7], "x", vocab_size=1024) == 1
    assert _check_ids([5, 0], [5, 1023], "x", vocab_size=None) == 1
    with pytest.raises(DumpError, match="do not line up"):
        _check_ids([5, 0], [5, 17], "x", vocab_size=1024)
    with pytest.raises(DumpError, match="do not line up"):
        _check_ids([5, 8], [5, 7], "x", vocab_size=1024)
    full = [1, 2, 3, 1023]
    result = {
        "meta_info": {"input_token_logprobs": [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None], [-3.0, 0, None]]}
    }
    assert prefill_logprobs(result, full, 2, "x", 1024) == ([-2.0, -3.0], 1)
    with pytest.raises(DumpError, match="input logprobs for 5"):
        prefill_logprobs(result, full + [4], 2, "x", 1024)


# -- prompts ---------------------------------------------------------------------------------------


def test_prompts_jsonl_and_synthetic(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2, 3]\n{"input_ids": [4, 5]}\n\n"hello world"\n{"text": "w5 w6"}\n')
    prompts = kl_prompts.read_jsonl(str(path))
    assert prompts == [[1, 2, 3], [4, 5], "hello world", "w5 w6"]
    with pytest.raises(DumpError, match="no tokenizer"):
        kl_prompts.resolve(prompts, None, str(path))
    ids = kl_prompts.resolve(prompts, lambda texts: [[len(t)] for t in texts], str(path))
    assert ids == [[1, 2, 3], [4, 5], [11], [5]]
    path.write_text("[1, -2]\n")
    with pytest.raises(DumpError, match=r"p.jsonl:1: a prompt is"):
        kl_prompts.read_jsonl(str(path))
    a = kl_prompts.synthetic(32, 64, 1024, seed=3)
    assert a == kl_prompts.synthetic(32, 64, 1024, seed=3) != kl_prompts.synthetic(32, 64, 1024, seed=4)
    assert len({p[0] for p in a}) == 32  # distinct first tokens: no accidental 1-token prefix hits
    assert all(32 <= len(p) <= 96 and min(p) >= 3 and max(p) < 1024 for p in a)


# -- thresholds file ------------------------------------------------------------------------------


def _run(avg, max_kl, identical, tokens):
    return {
        "helpers": {
            "match": {
                "status": "clean",
                "avg_kl_div": avg,
                "max_kl": max_kl,
                "tokens": tokens,
                "bit_identical": identical,
            }
        }
    }


def test_propose_threshold():
    exact = kl_thresholds.propose([_run(0.0, 0.0, 64, 64), _run(0.0, 0.0, 64, 64)])
    assert exact["kl_div"] == 1e-9 and exact["bit_exact"]
    noisy = kl_thresholds.propose([_run(2e-14, 1.1e-13, 50, 64), _run(3e-14, 1.1e-13, 52, 64)], margin=10)
    assert noisy["kl_div"] == pytest.approx(3e-13) and not noisy["bit_exact"]
    spiky = kl_thresholds.propose([_run(1e-15, 4.5e-13, 63, 64)], margin=10)
    assert spiky["kl_div"] == pytest.approx(4.5e-13)  # never below the worst single token seen


def test_thresholds_file_roundtrip_and_lookup(tmp_path):
    path = str(tmp_path / "t.json")
    target = {"model": "/models/Llama-3.1-8B", "tp": 2, "dtype": "bfloat16", "engine": "sglang"}
    key = kl_thresholds.update(path, target, kl_thresholds.propose([_run(1e-4, 1e-3, 0, 64)]), {"repeats": 1})
    data = json.load(open(path))
    assert data["format"] == "dumpdiff-kl-thresholds" and data["entries"][key]["kl_div"] == pytest.approx(1e-3)
    assert kl_thresholds.resolve_thresholds(None, path, target)["value"] == pytest.approx(1e-3)
    other_tp = kl_thresholds.resolve_thresholds(None, path, {**target, "tp": 1})
    assert other_tp["source"] == "default" and "no entry" in other_tp["note"]
    moved = kl_thresholds.resolve_thresholds(None, path, {**target, "model": "/other/place/Llama-3.1-8B"})
    assert moved["value"] == pytest.approx(1e-3)  # matched by the folder name
    assert "note" not in moved
    other_dtype = kl_thresholds.resolve_thresholds(None, path, {**target, "dtype": "float32"})
    assert "calibrated on a bfloat16 server, this one runs float32" in other_dtype["note"]  # said in the report
    assert kl_thresholds.resolve_thresholds(5e-5, path, target)["source"] == "--threshold"
    data["entries"][key]["helpers"] = {"decode_cache_hit": 2e-3}
    kl_thresholds.save(path, data)
    assert kl_thresholds.resolve_thresholds(None, path, target)["helpers"] == {"decode_cache_hit": 2e-3}
    (tmp_path / "bad.json").write_text('{"format": "x"}')
    with pytest.raises(DumpError, match="not a dumpdiff-kl-thresholds file"):
        kl_thresholds.load(str(tmp_path / "bad.json"))


# -- the HF in-process check on a real tiny model ------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("kl-llama") / "model"))


@pytest.fixture(scope="module")
def prompts():
    return kl_prompts.synthetic(3, 12, 1024, seed=0)


class BrokenRestore:
    """Duck-typed model whose generate corrupts a restored cache (one key of layer 1, +0.5),
    as a buggy prefix-cache restore would. Fresh caches are left alone."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def parameters(self):
        return self.model.parameters()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, input_ids, past_key_values=None, **kwargs):
        if past_key_values is not None:
            past_key_values.layers[1].keys[:, :, 3, :] += 0.5
        return self.model.generate(input_ids, past_key_values=past_key_values, **kwargs)


@pytest.mark.slow
def test_inprocess_clean_calibrated_and_planted(tiny, prompts):
    clean = check_model(tiny, prompts, max_new_tokens=12, threshold=float("inf"))
    assert set(clean["helpers"]) == set(kl.HELPERS)
    for h in clean["helpers"].values():
        assert h["scored_prompts"] == 3 and h["tokens"] == 36
        assert h["avg_kl_div"] < 1e-12  # float32 on CPU: a few ulps at most
    assert clean["helpers"]["prefill_cache_hit"]["cache_hit_rate"] == 1.0
    assert clean["helpers"]["decode_cache_hit"]["cache_hit_rate"] == 1.0
    threshold = kl_thresholds.propose([clean])["kl_div"]
    assert 0 < threshold <= 1e-9

    again = check_model(tiny, prompts, max_new_tokens=12, threshold=threshold)
    assert again["verdict"]["kind"] == kl.PASS, render(again, "text")

    broken = check_model(BrokenRestore(tiny), prompts, max_new_tokens=12, threshold=threshold)
    status = {n: h["status"] for n, h in broken["helpers"].items()}
    assert status == {"match": "clean", "prefill_cache_hit": "dirty", "decode_cache_hit": "dirty"}
    assert broken["verdict"]["kind"] == kl.STATE

    def batch_variant(module, args, out):  # a GEMM chosen by M: one token row computes differently
        return out * (1 + 2**-9) if out.shape[-2] == 1 else None

    hook = tiny.model.layers[1].mlp.down_proj.register_forward_hook(batch_variant)
    try:
        variant = check_model(tiny, prompts, max_new_tokens=12, threshold=threshold)
    finally:
        hook.remove()
    assert all(h["status"] == "dirty" for h in variant["helpers"].values()), render(variant, "text")
    assert variant["verdict"]["kind"] == kl.BATCH
    with pytest.raises(KLCheckFailed, match="BATCH-INVARIANCE"):
        assert_kl_pass(variant)
    md, js = render(variant, "md"), json.loads(render(variant, "json"))
    assert "| match | DIRTY |" in md and js["verdict"]["kind"] == "batch_invariance"


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("mamba", dict(state_size=8, expand=2, conv_kernel=4)),
        ("mamba2", dict(state_size=8, expand=2, conv_kernel=4, head_dim=16, n_groups=1, num_heads=8, chunk_size=16)),
    ],
)
def test_inprocess_state_space_model_has_no_cache_hit_path(arch, extra):
    """Mamba's cache is a recurrent state with no length (get_seq_length raises): generate cannot
    resume a prompt from it, so the cache-hit helpers are n/a with the reason; match still runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        arch,
        vocab_size=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_size=64,
        num_hidden_layers=2,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    result = check_model(model, kl_prompts.synthetic(2, 12, 1024, seed=0), max_new_tokens=4, threshold=1e-6)
    for name in kl.CACHE_HELPERS:
        h = result["helpers"][name]
        assert h["status"] == "n/a" and "reports no length" in h["notes"][0], h["notes"]
    assert result["helpers"]["match"]["status"] == "clean" and result["helpers"]["match"]["tokens"] == 8
    assert result["verdict"]["kind"] == kl.PASS


def test_inprocess_text_prompts_need_a_tokenizer(tiny):
    with pytest.raises(DumpError, match="need a tokenizer"):
        check_model(tiny, ["w5 w6 w7"], max_new_tokens=2)


# -- CLI trouble -----------------------------------------------------------------------------------


def test_cli_unreachable_server_is_one_line_exit_2():
    code, out, err = dumpdiff("kl", "--url", "http://127.0.0.1:9", "-q")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dumpdiff: error:") and "cannot connect" in err
    code, out, err = dumpdiff("localize", "--url", "http://127.0.0.1:9", "-q")
    assert code == 2 and err.count("\n") == 1


def test_cli_help_reads_like_a_man_page():
    for args in (["kl"], ["kl", "calibrate"], ["localize"]):
        code, out, _ = dumpdiff(*args, "--help")
        assert code == 0 and "Exit status" in out, args


def test_pytest_plugin_loads_in_a_user_suite(tmp_path):
    """A user's suite: the plugin via pytest_plugins, its fixture and options, the mixin."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["dumpdiff.analyzer.pytest_plugin"]\n')
    (tmp_path / "test_user.py").write_text(
        "from dumpdiff.analyzer.pytest_plugin import KLConsistency\n"
        "class TestServer(KLConsistency):\n"
        "    pass\n"
        "def test_fixture(dumpdiff_kl):\n"
        "    dumpdiff_kl()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DUMPDIFF_KL_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 skipped" in proc.stdout and "no server for the KL check" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert "--kl-url" in proc.stdout and "--kl-thresholds" in proc.stdout


def test_a_cache_path_far_dirtier_than_match_is_no_pass_under_an_uncalibrated_threshold():
    """Measured on the real server (Gemma-2, a planted cache-restore bug at layer 0): match
    2.8e-14, prefill_cache_hit 8.1e-7, decode_cache_hit 1.9e-14, all under the default 1e-3:
    "pass", exit 0, over a state bug. With the default threshold, a cache-hit helper 100x
    dirtier than match is inconclusive (exit 2), and localize is pointed at it."""
    values = {"match": 2.84e-14, "prefill_cache_hit": 8.11e-7, "decode_cache_hit": 1.89e-14}
    helpers = {name: {**_helper("clean"), "avg_kl_div": value, "worst": 1} for name, value in values.items()}
    verdict = kl.classify(helpers, uncalibrated=True)
    assert verdict["kind"] == kl.INCONCLUSIVE and kl.exit_status(verdict) == 2
    assert "prefill_cache_hit is 2.86e+07x dirtier than match" in verdict["text"] and "calibrate" in verdict["text"]
    assert verdict["localize"] == {"helper": "prefill_cache_hit", "prompt": 1}
    assert kl.classify(helpers)["kind"] == kl.PASS  # a calibrated threshold was measured on this server: it decides
    helpers["match"]["avg_kl_div"] = 0.0  # every no-cache token bit-identical: infinitely cleaner, not "no ratio"
    assert kl.classify(helpers, uncalibrated=True)["kind"] == kl.INCONCLUSIVE
    helpers["match"]["avg_kl_div"] = 2.84e-14
    helpers["prefill_cache_hit"]["avg_kl_div"] = 2.0e-13  # a clean engine's helpers stay within a small factor
    assert kl.classify(helpers, uncalibrated=True)["kind"] == kl.PASS


# -- local files are checked before the server is asked, and ids past the vocabulary never sent ----

NO_SERVER = "http://127.0.0.1:9"  # nothing listens there: an error about a file must come first


def _one_line(result, *needles):
    code, out, err = result
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("dumpdiff: error: "), (code, out, err)
    assert "cannot connect" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("command", [["kl"], ["kl", "calibrate"], ["localize"]], ids=" ".join)
def test_cli_a_missing_prompts_file_is_said_before_the_unreachable_server(tmp_path, command):
    missing = tmp_path / "nope.jsonl"
    _one_line(
        dumpdiff(*command, "--url", NO_SERVER, "--prompts", missing, "-q", timeout=60),
        f"{missing}: cannot read the prompts file (No such file or directory)",
    )


@pytest.mark.parametrize("command", [["kl"], ["kl", "calibrate"], ["localize"]], ids=" ".join)
def test_cli_a_token_id_past_the_vocabulary_is_refused_before_anything_is_sent(tmp_path, command):
    """An id >= vocab_size was sent; the server's embedding crashed and the check said "cannot connect"."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2, 3]\n\n[4, 1000, 5]\n")
    _one_line(
        dumpdiff(*command, "--url", NO_SERVER, "--prompts", prompts, "--vocab-size", "1000", "-q", timeout=60),
        f"{prompts}:3: token id 1000 is out of the model's vocabulary (vocab size 1000, from --vocab-size)",
    )
    if command == ["localize"]:
        _one_line(
            dumpdiff("localize", "--url", NO_SERVER, "--prompt-ids", "[1, 4096]", "--vocab-size", "1000", timeout=60),
            "--prompt-ids: token id 4096 is out of the model's vocabulary",
        )


def test_cli_the_vocab_size_from_the_models_config_refuses_ids_before_any_generate(tmp_path):
    """Without --vocab-size the size comes from the config.json of /server_info's model_path:
    /server_info is all the server is asked."""
    import http.server
    import threading

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = json.dumps({"model_path": str(model), "tp_size": 1, "version": "stand-in"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            asked.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"input_ids": [3, 600]}\n')
        _one_line(
            dumpdiff("kl", "--url", f"http://127.0.0.1:{server.server_port}", "--prompts", prompts, "-q", timeout=60),
            f"{prompts}:1: token id 600",
            f"vocab size 512, from {model}/config.json",
        )
    finally:
        server.shutdown()
        server.server_close()
    assert asked == ["/server_info"]


def test_json_outputs_say_their_format_and_version():
    from dumpdiff.analyzer.kl.render import to_json

    result = {"kind": "dumpdiff-kl", "verdict": {"kind": "pass"}}
    marked = json.loads(to_json(result))
    assert list(marked)[:2] == ["format", "version"] and marked["format"] == "dumpdiff-kl" and marked["version"] == 1
    assert marked["kind"] == "dumpdiff-kl" and marked["verdict"] == {"kind": "pass"}  # the keys before are kept
    assert json.loads(to_json({"kind": "dumpdiff-kl-calibration"}))["format"] == "dumpdiff-kl-calibration"
    assert json.loads(to_json({"localized": False}, "dumpdiff-localize"))["format"] == "dumpdiff-localize"


def test_text_reports_count_in_the_right_number():
    from dumpdiff.analyzer.kl.localize import to_text

    result = {
        "localized": True,
        "divergence": True,
        "helper": "match",
        "prompt_index": None,
        "prompt_len": 1,
        "replay": {
            "output_len": 1,
            "cached_tokens": 0,
            "hit": True,
            "mean_kl": 0.0,
            "max_kl": 0.0,
            "bit_identical": 1,
            "tokens": 1,
        },
        "strict_culprit": None,
        "noise_culprits": [{"call": "c#0", "cls": "L", "rows": 1, "in_err": 0.0, "out_err": 1.0, "amplification": 9.0}],
        "dumps": {"dec": "d", "ref": "r"},
        "notes": [],
    }
    text = to_text(result)
    assert "(1 token)" in text and "replay: 1 token decoded" in text and "(1 row, " in text, text
