"""From a dirty KL helper to the culprit op: replay its worst prompt with dumping on, once as
the decode run and once as the reference prefill, then run first-divergence in-process.

The server must run our dumper with the HTTP control (DUMPER_SERVER_PORT=reuse, dumping off
until asked: DUMPER_ENABLE=0). The replay re-creates the helper's cache state before the
dumped request, and nothing else is dumped:

    match              flush | dump DEC: generate           | flush | dump REF: prefill prompt+output
    prefill_cache_hit  flush, warm the prompt | dump DEC: generate (prefix restored) | ...
    decode_cache_hit   flush, turn 1 | dump DEC: turn 2 (turn 1 restored) | flush | dump REF: turn 2+output

The dumps go to DUMPER_DIR/<prefix>-dec and DUMPER_DIR/<prefix>-ref (DUMPER_DIR as the
server's /dumper/get_state reports it; it must be readable here). What the reading says about
the path comes from the dumps' pass modes, not from the helper's name: an extend pass read a
prefix back from the KV cache (a prefix-cache hit, or a chunk after the first of a chunked
prefill), so extend passes in the reference mean it was not cache-free.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ..dump.load import open_dump
from ..errors import DumpError
from ..http import post_json
from ..verdict.phrases import noise_errors, noise_place
from ..wording import plural
from . import score as kl
from .helpers import decode_logprobs, expected_prefill_hit, prefill_logprobs, sampling_params
from .prompts import check_vocab, vocab_size_of
from .server import Server
from .vllm import connect

Log = Callable[[str], None]


def dumper_call(url: str, method: str, body: Optional[dict] = None) -> list:
    reply = post_json(url.rstrip("/") + f"/dumper/{method}", body or {}, timeout=120)
    if not isinstance(reply, list) or not reply or not all(isinstance(r, dict) for r in reply):
        raise DumpError(
            f"{url}/dumper/{method}: unexpected reply {str(reply)[:200]}; is this dumpdiff's dumper "
            "(DUMPER_SERVER_PORT=reuse)?"
        )
    return reply


def dump_dir(url: str) -> str:
    states = dumper_call(url, "get_state")
    config = states[0].get("config") or {}
    folder = config.get("dir")
    if not folder:
        raise DumpError(f"{url}/dumper/get_state reports no dump folder (config.dir)")
    if config.get("non_intrusive_mode") == "core":
        raise DumpError(
            "the server's dumper is in DUMPER_NON_INTRUSIVE_MODE=core (metadata only): localizing needs "
            "module tensors; restart it with DUMPER_NON_INTRUSIVE_MODE=all"
        )
    return folder


def _wait_written(url: str, before: list, timeout: float = 300.0) -> None:
    """Until every pass the dumper took since `before` is on disk (the writer is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        now = dumper_call(url, "get_state")
        pending = 0
        for b, n in zip(before, now):
            if n.get("stopped"):
                raise DumpError(f"the dumper stopped writing ({n['stopped']}); the dump is incomplete")
            taken = (
                n["passes_dumped"] - b["passes_dumped"]
                if n["passes_dumped"] >= b["passes_dumped"]
                else n["passes_dumped"]
            )
            pending += max(0, b["passes_written"] + taken - n["passes_written"])
        if not pending:
            return
        if time.monotonic() > deadline:
            raise DumpError(f"{pending} dumped passes still not written after {timeout:.0f} s")
        time.sleep(0.2)


def choose(result: dict, helper: Optional[str]) -> tuple:
    """(helper, prompt ids, turn token, prompt index) to replay, from a KL check result."""
    if helper is None:
        choice = result["verdict"].get("localize")
        if not choice:
            return None, None, None, None
        helper = choice["helper"]
    h = result["helpers"].get(helper)
    if not h or h.get("worst_prompt_ids") is None:
        raise DumpError(f"the KL result has no scored prompt for helper {helper!r}")
    return helper, list(h["worst_prompt_ids"]), h.get("worst_turn_token"), h.get("worst")


def replay(
    server: Server,
    control: str,
    helper: str,
    prompt: list,
    exp_dec: str,
    exp_ref: str,
    *,
    max_new_tokens: int,
    sampling: dict,
    turn_token: Optional[int],
    vocab_size: Optional[int],
    log: Log,
) -> dict:
    """Dump the helper's decode run into exp_dec and its reference prefill into exp_ref
    (``control``: the URL of the dumper's /dumper routes)."""

    def dumped(exp: str, ids: list, new_tokens: int, **kw):
        dumper_call(control, "configure", {"enable": True, "exp_name": exp})
        try:
            return server.generate([ids], new_tokens, sampling=sampling, **kw)[0]
        finally:
            dumper_call(control, "configure", {"enable": False})

    dumper_call(control, "configure", {"enable": False})
    server.flush()
    if helper == "prefill_cache_hit":
        server.generate([prompt], 0, sampling=sampling, return_logprob=False)  # warm, not dumped
        ids = prompt
    elif helper == "decode_cache_hit":
        first = server.generate([prompt], max_new_tokens, sampling=sampling)[0]  # turn 1, not dumped
        ids = prompt + list(first["output_ids"]) + [turn_token if turn_token is not None else prompt[-1]]
    elif helper == "match":
        ids = prompt
    else:
        raise DumpError(f"unknown helper {helper!r}; choose from {', '.join(kl.HELPERS)}")
    log(f"localize: {helper}: dumping the decode run into {exp_dec} ...")
    dec = dumped(exp_dec, ids, max_new_tokens)
    decode_lp, _ = decode_logprobs(dec, "replayed decode run", vocab_size)
    full = ids + list(dec["output_ids"])
    server.flush()
    log(f"localize: dumping the reference prefill into {exp_ref} ...")
    ref = dumped(exp_ref, full, 0, logprob_start_len=0)
    prefill_lp, _ = prefill_logprobs(ref, full, len(decode_lp), "replayed reference prefill", vocab_size)
    cached = int(dec["meta_info"].get("cached_tokens") or 0)
    if helper == "prefill_cache_hit":
        hit = cached > 0 and cached >= expected_prefill_hit(len(prompt), server.page_size)
    elif helper == "decode_cache_hit":
        hit = cached > len(prompt) + 1
    else:
        hit = True
    return {
        "input_len": len(ids),
        "output_len": len(decode_lp),
        "cached_tokens": cached,
        "hit": hit,
        "ref_cached_tokens": int(ref["meta_info"].get("cached_tokens") or 0),
        "prefill_lp": prefill_lp,
        "decode_lp": decode_lp,
    }


def localize(
    url: str,
    *,
    helper: Optional[str] = None,
    kl_result: Optional[dict] = None,
    prompt: Optional[list] = None,
    turn_token: Optional[int] = None,
    exp_prefix: Optional[str] = None,
    max_new_tokens: Optional[int] = None,
    temperature: float = 0.0,
    seed: int = 0,
    check_options: Optional[dict] = None,
    noise_aware: bool = True,
    dumper_url: Optional[str] = None,
    log: Log = lambda _m: None,
) -> dict:
    """Replay a dirty helper's worst prompt with dumping on and name the culprit.

    The prompt comes from `prompt` (ids), else from `kl_result` (a `dumpdiff kl --format json`
    result), else from a fresh KL check (`check_options` go to check_server). Returns a dict:
    localized (bool), helper, prompt, dumps, replay figures, culprits, the first-divergence result.
    ``dumper_url``: the dumper's own control endpoint (a numeric DUMPER_SERVER_PORT; vLLM's
    server has no /dumper route), else the server's.
    """
    from ..verdict.diverge import first_divergence
    from .helpers import check_server, read_local

    options = dict(check_options or {})
    vocab_given = options.get("vocab_size")
    if prompt is not None and vocab_given:
        check_vocab([("--prompt-ids", prompt)], vocab_given, "--vocab-size")
    elif prompt is None and kl_result is None:  # a KL check will run: its files first, before any server call
        read_local(
            **{k: options.get(k) for k in ("prompts", "prompts_file", "threshold", "thresholds_file", "vocab_size")}
        )
    server = connect(url)
    if dumper_url is None and getattr(server, "engine", "sglang") == "vllm":
        raise DumpError(
            "vLLM's server has no /dumper route: give --dumper-url http://127.0.0.1:PORT, the "
            "DUMPER_SERVER_PORT the server was started with"
        )
    control = dumper_url or url
    folder = dump_dir(control)  # fail early: no dumper control on this server
    prompt_index, check = None, None
    if max_new_tokens is not None:
        options["max_new_tokens"] = max_new_tokens
    if prompt is None:
        if kl_result is None:
            helpers = [helper] if helper else list(kl.HELPERS)
            log(f"localize: running the KL check ({', '.join(helpers)}) to find the worst prompt ...")
            kl_result = check_server(url, helpers=helpers, temperature=temperature, seed=seed, log=log, **options)
            check = kl_result
        helper, prompt, turn, prompt_index = choose(kl_result, helper)
        if helper is None:
            return {
                "localized": False,
                "reason": f"the KL check passes: no dirty helper to localize ({kl_result['verdict']['text']})",
                "kl": _kl_brief(kl_result),
            }
        turn_token = turn_token if turn_token is not None else turn
        max_new_tokens = max_new_tokens or kl_result["settings"]["max_new_tokens"]
    helper = helper or "match"
    max_new_tokens = max_new_tokens or 32
    vocab = vocab_given or vocab_size_of(server.model)
    if vocab:  # an id past the embedding crashes the server: refuse it before the replay sends it
        check_vocab(
            [("--prompt-ids" if prompt_index is None else f"prompt {prompt_index}", prompt)],
            vocab,
            "--vocab-size" if vocab_given else f"{server.model}/config.json",
        )
    stamp = exp_prefix or time.strftime("kl-%Y%m%d-%H%M%S-") + f"{os.getpid() % 100000}"
    exp_dec, exp_ref = f"{stamp}-dec", f"{stamp}-ref"
    notes = []
    sampling = sampling_params(server, temperature, seed, notes)
    before = dumper_call(control, "get_state")
    t0 = time.monotonic()
    figures = replay(
        server,
        control,
        helper,
        prompt,
        exp_dec,
        exp_ref,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        turn_token=turn_token,
        vocab_size=vocab,
        log=log,
    )
    _wait_written(control, before)
    replay_seconds = time.monotonic() - t0
    if not figures["hit"]:
        notes.append(
            f"the replay did not restore the expected cache state (cached_tokens {figures['cached_tokens']}): "
            f"the dump may not show the {helper} path"
        )
    threshold = (kl_result or {}).get("threshold", {}).get("value", 0.0)
    score = kl.score_prompt(figures.pop("prefill_lp"), figures.pop("decode_lp"), threshold)
    figures.update(score)
    path_dec, path_ref = os.path.join(folder, exp_dec), os.path.join(folder, exp_ref)
    for path in (path_dec, path_ref):
        if not os.path.isdir(path):
            raise DumpError(
                f"the server dumped to {path}, which is not a folder here: run localize on the server's "
                "host (or mount its DUMPER_DIR at the same path)"
            )
    log(f"localize: first-divergence {path_ref} {path_dec} ...")
    t1 = time.monotonic()
    diverge = first_divergence(path_ref, path_dec, progress=False, noise_aware=noise_aware)
    modes = {"dec": pass_modes(path_dec), "ref": pass_modes(path_ref)}
    ranks = [v for v in diverge["ranks"].values()]
    noise = next((v["noise"]["culprits"] for v in ranks if v.get("noise", {}).get("culprits")), [])
    return {
        "localized": True,
        "url": url,
        "helper": helper,
        "prompt_index": prompt_index,
        "prompt_len": len(prompt),
        "dumps": {"dir": folder, "dec": path_dec, "ref": path_ref},
        "replay": figures,
        "threshold": threshold,
        "notes": notes,
        "pass_modes": modes,
        "divergence": diverge["divergence"],
        "strict_culprit": diverge.get("culprit"),
        "noise_culprits": noise,
        "summary": next((v.get("summary") for v in ranks if v.get("summary")), None),
        "reading": reading(
            helper, diverge.get("culprit"), noise, figures["hit"], modes, dtype=(diverge.get("b") or {}).get("dtype")
        ),
        "timings": {"replay": round(replay_seconds, 3), "first_divergence": round(time.monotonic() - t1, 3)},
        "kl": _kl_brief(check) if check else None,
        "first_divergence": diverge,
    }


def pass_modes(path: str) -> dict:
    """How many passes of each mode (prefill, extend, decode, mixed) a dump holds, all ranks."""
    counts = {}
    for rank in open_dump(path).ranks.values():
        for p in rank.passes:
            counts[p.mode or "unknown"] = counts.get(p.mode or "unknown", 0) + 1
    return counts


def reading(
    helper: str,
    strict: Optional[dict],
    noise: list,
    hit: bool = True,
    modes: Optional[dict] = None,
    dtype: Optional[str] = None,
) -> Optional[str]:
    """Which culprit to look at first, and what the dumped path says about it. ``modes``: the
    pass modes of each dump ({"dec": {...}, "ref": {...}}, see pass_modes); an extend pass read a
    cached prefix. Without them the replay stands in (``hit``: the helper's cache state was
    restored; match restores none). ``dtype``: the decode run's model dtype."""
    if modes is None:
        dec_extend, ref_extend = (0 if helper == "match" or not hit else None), 0
    else:
        dec_extend, ref_extend = modes["dec"].get("extend", 0), modes["ref"].get("extend", 0)
    caveat = ""
    if ref_extend:
        passes = plural(sum(modes["ref"].values()), "pass")
        caveat = (
            f"; but the reference is not cache-free: {ref_extend} of its {passes} read a cached prefix (extend "
            "passes: a chunked prefill, or a prefix-cache hit), so a cache-restore bug runs in it too and these "
            "dumps cannot tell one from batch-variance: dump a reference that fits one chunk "
            "(--chunked-prefill-size larger than prompt+output, or -1)"
        )
    if noise:
        top = noise_place(noise[0])
        if dec_extend == 0 and not ref_extend:
            missed = "" if helper == "match" or hit else f"; the {helper} replay missed the cache"
            where = (
                "with no prefix restored from the cache in either dump (the decode run's prompt and the "
                f"reference were each one prefill{missed}): in the decode path itself, a kernel wrong at this "
                "batch shape (e.g. taken only for one token row) or the decode steps' KV-cache state, not a "
                "prefix-cache restore"
            )
        elif dec_extend != 0:
            passes = f" ({dec_extend} of its passes read a prefix from the KV cache)" if dec_extend else ""
            where = (
                f"on the decode run's cache path{passes}: a cache-restore (state) bug, or a kernel wrong at "
                "this batch shape"
            )
        else:  # only the reference read a cached prefix: the caveat says it
            where = ""
        text = f"look at {top} first: it adds an error far beyond float noise{', ' + where if where else ''}{caveat}"
        if strict and strict["call"] != noise[0]["call"]:
            text += f"; {strict['call']} (strict) is only where bits first flip, within float noise"
        return text
    if strict:
        text = f"no op adds an error beyond float noise: {strict['call']} is where batch-variance starts{caveat}"
        if dtype in ("bfloat16", "float16") and helper != "match":
            # past layer 0 the noise is about an epsilon of a 16-bit type: a cached key a little off hides under it
            text += (
                f"; in {dtype} a state bug smaller than the noise already there cannot be seen (a stale cached "
                "key moved a trained model's attention by 0.29 epsilon under 0.8 of noise): if this helper is "
                "dirty, restart the server in float32 (--dtype float32) and localize again"
            )
        return text
    return None


def _kl_brief(result: dict) -> dict:
    return {
        "verdict": result["verdict"]["kind"],
        "text": result["verdict"]["text"],
        "avg_kl_div": {n: h.get("avg_kl_div") for n, h in result["helpers"].items()},
    }


def to_text(result: dict) -> str:
    if not result["localized"]:
        return f"dumpdiff localize: nothing to localize\n{result['reason']}\n"
    r = result["replay"]
    lines = [
        f"dumpdiff localize: {'DIVERGENCE' if result['divergence'] else 'no divergence in the dumps'}",
        f"helper: {result['helper']}, prompt {result['prompt_index'] if result['prompt_index'] is not None else '(given)'} "
        f"({plural(result['prompt_len'], 'token')}), replayed with dumping on",
        f"replay: {plural(r['output_len'], 'token')} decoded, cached_tokens {r['cached_tokens']}"
        f"{'' if r['hit'] else ' (NO cache hit)'}, mean k3 {r['mean_kl']:.3g}, max k3 {r['max_kl']:.3g}, "
        f"{r['bit_identical']}/{r['tokens']} bit-identical",
    ]
    strict = result.get("strict_culprit")
    lines.append(
        f"strict culprit:      {strict['call']}  [{strict['cls']}]  (first op whose inputs match bit for bit "
        "and whose output does not)"
        if strict
        else "strict culprit:      none"
    )
    if result["noise_culprits"]:
        top = result["noise_culprits"][0]
        where = noise_place(top) if top.get("gap_before") else f"{top['call']}  [{top['cls']}]"
        lines.append(f"noise-aware culprit: {where}  ({plural(top['rows'], 'row')}, {noise_errors(top)})")
    else:
        lines.append("noise-aware culprit: none (no op introduces an error beyond float noise)")
    if result.get("reading"):
        lines.append(f"reading: {result['reading']}")
    if result.get("summary"):
        lines.append(result["summary"])
    d = result["dumps"]
    lines += [
        f"dumps: {d['dec']} (decode run), {d['ref']} (reference prefill)",
        f"again: dumpdiff first-divergence {d['ref']} {d['dec']}",
        f"report: dumpdiff first-divergence {d['ref']} {d['dec']} --format html -o report.html",
    ]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def to_markdown(result: dict) -> str:
    text = to_text(result).rstrip("\n").splitlines()
    return "## " + text[0] + "\n\n" + "\n".join(f"- {line}" for line in text[1:]) + "\n"
