"""The three KL helpers over sglang's HTTP API, with the semantics of sglang's own KL tests
(sglang/test/kl_test_utils.py):

match              flush; generate (keep output logprobs); flush; prefill prompt+output with
                   max_new_tokens 0, logprob_start_len 0; take the last len(output) input
                   logprobs. No cache anywhere.
prefill_cache_hit  flush; prefill the prompts (max_new_tokens 0) to warm the radix cache;
                   generate (the prompt must come back from the cache: meta_info.cached_tokens);
                   flush; reference prefill.
decode_cache_hit   flush; turn 1 generates; turn 2 = prompt + output + one more token, on the
                   warm cache (cached_tokens must reach into turn 1's output); flush; reference
                   prefill of turn 2 + its output.

Every prefill from scratch (the reference prefills, match's decode run, the warm-up, turn 1) is
sent in groups whose prompts fit one chunk together (sglang's --chunked-prefill-size, from
/server_info): sglang packs the requests waiting at a step into one prefill batch and cuts the
one that overflows the chunk, whose later chunks then read the earlier ones back from the KV
cache as a prefix restore does, so a cache bug would dirty `match` too. A single request longer
than a chunk is chunked anyway: its reference is marked (ref_chunked) and the verdict reads it.

Tokens are aligned by position: output logprob k belongs to output_ids[k], and the reference
prefill's last len(output) input logprobs to the same tokens. The token ids the server reports
next to the logprobs are only checked, never trusted: sglang 0.5.23 reports the id
vocab_size-1 as 0 in its logprob lists, which is tolerated (and counted); any other mismatch
means the positions do not line up, and the check stops.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable, List, Optional

from ..errors import DumpError
from ..http import DEFAULT_URL
from ..wording import plural
from . import prompts as kl_prompts
from . import score as kl
from .server import Server

Log = Callable[[str], None]


def sampling_params(server: Server, temperature: float, seed: Optional[int], notes: list) -> dict:
    """temperature 0 by default; sampling_seed only where the server honours it."""
    params = {"temperature": temperature}
    if temperature > 0 and seed is not None:
        if server.info().get("enable_deterministic_inference"):
            params["sampling_seed"] = int(seed)
        else:
            notes.append(
                "temperature > 0 and the server ignores sampling_seed (no --enable-deterministic-inference): "
                "sampled tokens differ run to run; the check still scores whatever was sampled"
            )
    return params


# -- reading logprobs ----------------------------------------------------------------------------


def _values_and_ids(entries, where: str):
    values, ids = [], []
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise DumpError(f"{where}: a logprob entry is not [logprob, token_id, ...]: {entry!r}")
        values.append(entry[0])
        ids.append(entry[1])
    return values, ids


def _check_ids(reported: list, expected: list, where: str, vocab_size: Optional[int]) -> int:
    """Compare reported ids with the tokens at the same positions; returns how many were the
    known vocab_size-1 -> 0 quirk. Any other difference: the positions are not aligned."""
    quirks = 0
    for pos, (got, want) in enumerate(zip(reported, expected)):
        if got == want or got is None:
            continue
        if got == 0 and (vocab_size is None or want == vocab_size - 1):
            quirks += 1
            continue
        raise DumpError(
            f"{where}: position {pos} reports token {got} where the sequence has {want}; the logprobs "
            "do not line up with the tokens, refusing to score them"
        )
    return quirks


def decode_logprobs(result: dict, where: str, vocab_size: Optional[int]):
    out_ids = result.get("output_ids") or []
    entries = result["meta_info"].get("output_token_logprobs") or []
    if len(entries) != len(out_ids):
        raise DumpError(f"{where}: {len(entries)} output logprobs for {len(out_ids)} output tokens")
    values, ids = _values_and_ids(entries, where)
    quirks = _check_ids(ids, out_ids, where, vocab_size)
    if any(v is None for v in values):
        raise DumpError(f"{where}: an output logprob is null")
    return [float(v) for v in values], quirks


def prefill_logprobs(result: dict, full: List[int], n: int, where: str, vocab_size: Optional[int]):
    entries = result["meta_info"].get("input_token_logprobs") or []
    if len(entries) != len(full):
        raise DumpError(
            f"{where}: {len(entries)} input logprobs for {len(full)} input tokens "
            "(logprob_start_len 0 should cover them all)"
        )
    if n == 0:
        return [], 0
    values, ids = _values_and_ids(entries[-n:], where)
    quirks = _check_ids(ids, full[-n:], where, vocab_size)
    if any(v is None for v in values):
        raise DumpError(f"{where}: an input logprob of a generated token is null")
    return [float(v) for v in values], quirks


# -- the helpers -------------------------------------------------------------------------------


def prefill_groups(lengths: List[int], chunk: Optional[int], page_size: int = 1) -> List[List[int]]:
    """Request indices in order, grouped so that each group's prefills fit one chunk together
    (page-aligned, as sglang charges them); a request longer than the chunk goes alone (it is
    chunked anyway, but cuts no other). One group when chunked prefill is off."""
    if not chunk:
        return [list(range(len(lengths)))] if lengths else []
    groups, used = [], chunk + 1
    for i, n in enumerate(lengths):
        size = -(-n // page_size) * page_size
        if used + size > chunk:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


class Context:
    """What every helper needs: the server, sampling, sizes, logging."""

    def __init__(
        self,
        server: Server,
        *,
        max_new_tokens: int,
        sampling: dict,
        vocab_size: Optional[int],
        log: Log = lambda _m: None,
        turn_token: Optional[int] = None,
    ) -> None:
        self.server = server
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.log = log
        self.turn_token = turn_token
        self.quirks = 0
        self.decode_batches = {}  # helper -> batch sizes its scored decode run went in, when split

    def groups_of(self, prompts: List[List[int]]) -> List[List[int]]:
        """The prompts' indices in groups whose prefills fit one chunk (prefill_groups, on this
        server); every helper's scored decode run goes in those of the base prompts: match's."""
        return prefill_groups([len(p) for p in prompts], self.server.chunk_size, self.server.page_size)

    def chunked(self, length: int) -> bool:
        """A prefill from scratch of this many tokens is chunked (read back from the KV cache)."""
        chunk = self.server.chunk_size
        return chunk is not None and length > chunk

    def generate_unchunked(
        self,
        prompts: List[List[int]],
        max_new_tokens: int,
        *,
        flush_between: bool,
        groups: Optional[List[List[int]]] = None,
        **kwargs,
    ) -> tuple:
        """generate, one group of prefill_groups at a time: (results in prompt order, group sizes).
        flush_between: flush before every later group, so that none restores a prefix an earlier
        group left behind (the no-cache runs); the warm-up and turn 1 keep theirs. ``groups``:
        given ones (the scored decode runs of every helper go in match's, so all decode at the
        same batch sizes: a kernel taken at one of them runs in every helper, not in match alone)."""
        if groups is None:
            groups = self.groups_of(prompts)
        results = [None] * len(prompts)
        for k, group in enumerate(groups):
            if k and flush_between:
                self.server.flush()
            for i, r in zip(group, self.server.generate([prompts[i] for i in group], max_new_tokens, **kwargs)):
                results[i] = r
        return results, [len(g) for g in groups]

    def reference(self, fulls: List[List[int]], outputs: List[int], helper: str):
        """Flush, then one prefill of each prompt+output: the last len(output) input logprobs,
        the cached tokens, and whether each reference was chunked (longer than a chunk)."""
        if not fulls:  # no prompt hit the cache: nothing to score
            return [], [], []
        self.server.flush()
        results, _ = self.generate_unchunked(fulls, 0, flush_between=True, sampling=self.sampling, logprob_start_len=0)
        lps, cached = [], []
        for i, (full, n, r) in enumerate(zip(fulls, outputs, results)):
            values, quirks = prefill_logprobs(r, full, n, f"{helper} reference prefill, prompt {i}", self.vocab_size)
            self.quirks += quirks
            lps.append(values)
            cached.append(int(r["meta_info"].get("cached_tokens") or 0))
        return lps, cached, [self.chunked(len(f)) for f in fulls]

    def decoded(self, results: list, helper: str):
        lps, outs = [], []
        for i, r in enumerate(results):
            values, quirks = decode_logprobs(r, f"{helper} generate, prompt {i}", self.vocab_size)
            self.quirks += quirks
            lps.append(values)
            outs.append(list(r.get("output_ids") or []))
        return lps, outs


def _cached(result: dict) -> int:
    return int(result["meta_info"].get("cached_tokens") or 0)


def _ref_notes(ref_cached: list, notes: list, ctx: Context, fulls: list) -> None:
    hit = [c for c in ref_cached if c]
    if hit:
        notes.append(
            f"the reference prefill restored tokens from the cache on {len(hit)} prompts (up to {max(hit)}; "
            "prompts sharing first tokens): that reference is not cache-free"
        )
    long = [len(f) for f in fulls if ctx.chunked(len(f))]
    if long:
        notes.append(
            f"{len(long)} of {len(fulls)} reference prefills (prompt+output, up to {max(long)} tokens) are "
            f"longer than --chunked-prefill-size {ctx.server.chunk_size}: sglang chunked them, and their "
            "later chunks read the earlier ones back from the KV cache: those references are not cache-free"
        )


def run_match(ctx: Context, prompts: List[List[int]]) -> tuple:
    s = ctx.server
    s.flush()
    # The decode run's prompt prefills must not be chunked either: a chunk past the first reads
    # the cache, and this is the no-cache run.
    results, batches = ctx.generate_unchunked(prompts, ctx.max_new_tokens, flush_between=True, sampling=ctx.sampling)
    decode_lp, outs = ctx.decoded(results, "match")
    cached = [_cached(r) for r in results]
    fulls = [p + o for p, o in zip(prompts, outs)]
    ref_lp, ref_cached, ref_chunked = ctx.reference(fulls, [len(o) for o in outs], "match")
    notes = []
    if len(batches) > 1:
        ctx.decode_batches["match"] = batches
        notes.append(
            f"the decode run went in {len(batches)} groups of {', '.join(map(str, batches))} prompts, the "
            f"cache flushed in between, so that no prompt prefill was cut at --chunked-prefill-size "
            f"{s.chunk_size} by another's: its decode steps ran at those batch sizes"
        )
    long = [len(p) for p in prompts if ctx.chunked(len(p))]
    if long:
        notes.append(
            f"{len(long)} prompts are longer than --chunked-prefill-size {s.chunk_size} (up to {max(long)} "
            "tokens): the decode run's prefill of those was chunked too"
        )
    if any(cached):
        notes.append(
            f"{sum(1 for c in cached if c)} prompts restored up to {max(cached)} tokens from the cache in the "
            "no-cache run (prompts sharing first tokens, e.g. a BOS, batched together)"
        )
    _ref_notes(ref_cached, notes, ctx, fulls)
    rows = [
        {
            "index": i,
            "prompt_len": len(p),
            "output_len": len(o),
            "cached_tokens": c,
            "ref_cached_tokens": rc,
            "ref_chunked": rk,
            "hit": True,
            "prefill_lp": rl,
            "decode_lp": dl,
        }
        for i, (p, o, c, rc, rk, rl, dl) in enumerate(
            zip(prompts, outs, cached, ref_cached, ref_chunked, ref_lp, decode_lp)
        )
    ]
    return rows, notes


def _eviction_note(server: Server, hits: list, needed: int, notes: list) -> None:
    """Misses because the batch does not fit the KV pool (the warm entries were evicted)."""
    pool = server.kv_tokens
    if not all(hits) and pool and needed > pool:
        notes.append(
            f"these prompts need about {needed} tokens of KV cache but the server holds {pool} "
            "(max_total_num_tokens): cached entries were evicted before reuse; use fewer or shorter "
            "prompts (--max-samples, --prompt-len, --max-new-tokens)"
        )


def expected_prefill_hit(prompt_len: int, page_size: int) -> int:
    """Tokens a warmed prompt restores: all but the last (always recomputed), page-aligned."""
    return ((prompt_len - 1) // page_size) * page_size


def run_prefill_cache_hit(ctx: Context, prompts: List[List[int]]) -> tuple:
    s = ctx.server
    s.flush()
    # warm the radix cache, each prompt in one prefill (as localize's replay warms it)
    ctx.generate_unchunked(prompts, 0, flush_between=False, sampling=ctx.sampling, return_logprob=False)
    results, _ = ctx.generate_unchunked(
        prompts, ctx.max_new_tokens, flush_between=False, groups=ctx.groups_of(prompts), sampling=ctx.sampling
    )
    decode_lp, outs = ctx.decoded(results, "prefill_cache_hit")
    cached = [_cached(r) for r in results]
    hits = [c > 0 and c >= expected_prefill_hit(len(p), s.page_size) for p, c in zip(prompts, cached)]
    keep = [i for i, h in enumerate(hits) if h]
    fulls = [prompts[i] + outs[i] for i in keep]
    ref_lp, ref_cached, ref_chunked = ctx.reference(fulls, [len(outs[i]) for i in keep], "prefill_cache_hit")
    by_index = dict(zip(keep, zip(ref_lp, ref_cached, ref_chunked)))
    notes = []
    _eviction_note(s, hits, sum(len(p) + ctx.max_new_tokens for p in prompts), notes)
    _ref_notes(ref_cached, notes, ctx, fulls)
    rows = []
    for i, (p, o, c, h, dl) in enumerate(zip(prompts, outs, cached, hits, decode_lp)):
        rl, rc, rk = by_index.get(i, (None, None, None))
        rows.append(
            {
                "index": i,
                "prompt_len": len(p),
                "output_len": len(o),
                "cached_tokens": c,
                "expected_cached": expected_prefill_hit(len(p), s.page_size),
                "ref_cached_tokens": rc,
                "ref_chunked": rk,
                "hit": h,
                "prefill_lp": rl,
                "decode_lp": dl,
            }
        )
    return rows, notes


def turn_tokens(ctx: Context, prompts: List[List[int]]) -> List[int]:
    """The extra token of turn 2: --turn-token, else the tokenizer's ',' (as sglang's test),
    else each prompt's own last token (any in-vocabulary id does)."""
    if ctx.turn_token is not None:
        return [ctx.turn_token] * len(prompts)
    if ctx.server.has_tokenizer:
        try:
            comma = ctx.server.tokenize([","], add_special_tokens=False)[0]
            if len(comma) == 1:
                return comma * len(prompts)
        except DumpError:
            pass
    return [p[-1] for p in prompts]


def run_decode_cache_hit(ctx: Context, prompts: List[List[int]]) -> tuple:
    s = ctx.server
    s.flush()
    # turn 1 fills the cache, each prompt in one prefill (as localize's replay runs it)
    first, _ = ctx.generate_unchunked(prompts, ctx.max_new_tokens, flush_between=False, sampling=ctx.sampling)
    extra = turn_tokens(ctx, prompts)
    second = [p + list(r.get("output_ids") or []) + [t] for p, r, t in zip(prompts, first, extra)]
    results, _ = ctx.generate_unchunked(
        second, ctx.max_new_tokens, flush_between=False, groups=ctx.groups_of(prompts), sampling=ctx.sampling
    )
    decode_lp, outs = ctx.decoded(results, "decode_cache_hit")
    cached = [_cached(r) for r in results]
    hits = [c > len(p) + 1 for p, c in zip(prompts, cached)]  # restored into turn 1's output (sglang's rule)
    keep = [i for i, h in enumerate(hits) if h]
    fulls = [second[i] + outs[i] for i in keep]
    ref_lp, ref_cached, ref_chunked = ctx.reference(fulls, [len(outs[i]) for i in keep], "decode_cache_hit")
    by_index = dict(zip(keep, zip(ref_lp, ref_cached, ref_chunked)))
    notes = []
    _eviction_note(s, hits, sum(len(p) + 2 * ctx.max_new_tokens + 1 for p in prompts), notes)
    _ref_notes(ref_cached, notes, ctx, fulls)
    rows = []
    for i, (p, sec, o, c, h, dl) in enumerate(zip(prompts, second, outs, cached, hits, decode_lp)):
        rl, rc, rk = by_index.get(i, (None, None, None))
        rows.append(
            {
                "index": i,
                "prompt_len": len(p),
                "turn2_len": len(sec),
                "output_len": len(o),
                "turn_token": extra[i],
                "cached_tokens": c,
                "ref_cached_tokens": rc,
                "ref_chunked": rk,
                "hit": h,
                "prefill_lp": rl,
                "decode_lp": dl,
            }
        )
    return rows, notes


RUNNERS = {"match": run_match, "prefill_cache_hit": run_prefill_cache_hit, "decode_cache_hit": run_decode_cache_hit}


# -- the whole check ---------------------------------------------------------------------------


def read_local(
    *,
    prompts=None,
    prompts_file: Optional[str] = None,
    threshold: Optional[float] = None,
    thresholds_file: Optional[str] = None,
    vocab_size: Optional[int] = None,
) -> Optional[list]:
    """Read and check what the check takes from this machine before the server is asked anything:
    a missing or broken file is the error to see, not an unreachable server (and not after a run of
    minutes). Returns the prompts as (where, prompt) pairs (None: synthetic ones)."""
    from .thresholds import DEFAULT_FILE, load

    if threshold is None and os.path.exists(thresholds_file or DEFAULT_FILE):
        load(thresholds_file or DEFAULT_FILE)  # its form only; the entry needs the server's model
    if prompts is not None:
        numbered = [(f"prompt {i}", p) for i, p in enumerate(prompts)]
    else:
        numbered = (
            [(f"{prompts_file}:{n}", p) for n, p in kl_prompts.read_numbered(prompts_file)] if prompts_file else None
        )
    if numbered and vocab_size:
        kl_prompts.check_vocab(numbered, vocab_size, "--vocab-size")
    return numbered


def load_prompts(
    server: Server,
    numbered: Optional[list],
    *,
    source: str = "given",
    max_samples: int = 32,
    prompt_len: int = 256,
    seed: int = 0,
    vocab_size: Optional[int] = None,
):
    """The prompt ids and a description of where they came from (numbered: read_local's)."""
    if numbered is None:
        vocab = vocab_size or kl_prompts.vocab_size_of(server.model)
        note = ""
        if vocab is None:
            vocab, note = 1000, " (vocab size unknown: ids below 1000; give --vocab-size)"
        ids = kl_prompts.synthetic(max_samples, prompt_len, vocab, seed=seed)
        return ids, {"source": f"synthetic seed={seed} len~{prompt_len} vocab={vocab}{note}", "count": len(ids)}
    prompts = [p for _, p in numbered][:max_samples]
    tokenize = server.tokenize if server.has_tokenizer else None
    ids = kl_prompts.resolve(prompts, tokenize, source)
    return ids, {"source": source, "count": len(ids)}


def check_server(
    url: str,
    *,
    prompts=None,
    prompts_file: Optional[str] = None,
    max_samples: int = 32,
    max_new_tokens: int = 512,
    prompt_len: int = 256,
    seed: int = 0,
    temperature: float = 0.0,
    helpers: Iterable[str] = kl.HELPERS,
    threshold: Optional[float] = None,
    thresholds_file: Optional[str] = None,
    min_hit_rate: float = 0.5,
    turn_token: Optional[int] = None,
    vocab_size: Optional[int] = None,
    timeout: float = 600.0,
    log: Log = lambda _m: None,
) -> dict:
    """Run the helpers against a live sglang server and classify. Returns a plain dict
    (render.py renders it; score.exit_status gives the exit code)."""
    from .thresholds import resolve_thresholds

    numbered = read_local(
        prompts=prompts,
        prompts_file=prompts_file,
        threshold=threshold,
        thresholds_file=thresholds_file,
        vocab_size=vocab_size,
    )
    from .vllm import connect  # a client of this module's Server

    server = connect(url, timeout=timeout)
    target = server.describe()
    vocab = vocab_size or kl_prompts.vocab_size_of(server.model)
    if numbered and vocab and not vocab_size:  # the model's own size, known now: still before any prompt is sent
        kl_prompts.check_vocab(numbered, vocab, f"{server.model}/config.json")
    source = prompts_file if prompts is None and prompts_file else "given"
    ids, prompt_info = load_prompts(
        server, numbered, source=source, max_samples=max_samples, prompt_len=prompt_len, seed=seed, vocab_size=vocab
    )
    lengths = [len(p) for p in ids]
    prompt_info.update({"min_len": min(lengths), "max_len": max(lengths)})
    limits = resolve_thresholds(threshold, thresholds_file, target)
    notes = []
    sampling = sampling_params(server, temperature, seed, notes)
    ctx = Context(
        server, max_new_tokens=max_new_tokens, sampling=sampling, vocab_size=vocab, log=log, turn_token=turn_token
    )
    batch_note_at = len(notes)  # said after the helpers ran: match may have decoded in groups
    result = {
        "kind": "dumpdiff-kl",
        "target": target,
        "prompts": prompt_info,
        "settings": {
            "max_samples": max_samples,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "min_hit_rate": min_hit_rate,
            "helpers": list(helpers),
        },
        "threshold": limits,
        "helpers": {},
        "timings": {},
        "notes": notes,
    }
    for name in helpers:
        if name not in RUNNERS:
            raise DumpError(f"unknown helper {name!r}; choose from {', '.join(kl.HELPERS)}")
        t0 = time.monotonic()
        limit = limits["helpers"].get(name, limits["value"])
        if name in kl.CACHE_HELPERS and not server.radix_cache:
            log(f"kl: {name}: skipped, the server runs without a radix cache")
            summary = kl.summarize_helper(name, [], limit, cache_applicable=False)
        else:
            log(f"kl: {name}: {len(ids)} prompts x {max_new_tokens} new tokens ...")
            rows, helper_notes = RUNNERS[name](ctx, ids)
            summary = kl.summarize_helper(
                name, rows, limit, min_hit_rate=min_hit_rate, notes=helper_notes, chunk_size=server.chunk_size
            )
            worst = summary.get("worst")
            if worst is not None:
                summary["worst_prompt_ids"] = ids[worst]
                if name == "decode_cache_hit":
                    summary["worst_turn_token"] = rows[worst]["turn_token"]
        result["timings"][name] = round(time.monotonic() - t0, 3)
        result["helpers"][name] = summary
        log(f"kl: {name}: {summary['status']} avg_kl_div={summary['avg_kl_div']} ({result['timings'][name]:.1f} s)")
    groups = ctx.groups_of(ids)
    sizes = sorted({len(g) for g in groups}) if len(ids) > 1 else [1]
    if sizes != [1]:  # say what the batch left out: bugs of one kernel shape hide there
        ran = (
            f"in groups of {', '.join(str(len(g)) for g in groups)} (each fits one prefill chunk; "
            "every helper's decode run the same way)"
            if len(sizes) > 1 or sizes[0] != len(ids)
            else "together"
        )
        notes.insert(
            batch_note_at,
            f"the {len(ids)} prompts of a helper decode {ran}: decode steps ran at batch size "
            f"{', '.join(map(str, sizes))} only, not at the other sizes down to 1 (one request alone); a "
            "kernel path taken only at those (a GEMV for one token row) was not exercised: rerun with "
            "--max-samples 1 to test one",
        )
    if ctx.quirks:
        notes.append(
            f"{plural(ctx.quirks, 'logprob entry')} reported token id 0 for the last vocabulary id (a known sglang "
            "off-by-one in its logprob ids; tokens were aligned by position, values are right)"
        )
    result["verdict"] = kl.classify(result["helpers"], uncalibrated=limits["source"] == "default")
    return result


def env_url(default: str = DEFAULT_URL) -> str:
    return os.environ.get("DUMPDIFF_KL_URL", default)
