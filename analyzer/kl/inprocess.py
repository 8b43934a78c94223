"""The KL consistency check in-process, for an HF transformers model (no server).

    from dumpdiff.analyzer.kl.inprocess import check_model
    result = check_model(model, prompts, max_new_tokens=32)      # prompts: lists of token ids
    assert result["verdict"]["kind"] == "pass", kl_render.to_text(result)

The model is duck-typed: ``model.generate(input_ids, ..., return_dict_in_generate=True,
output_logits=True, past_key_values=...)`` and ``model(input_ids, use_cache=...)`` returning
``.logits`` / ``.past_key_values``, as transformers' causal LMs do (the cache is also read
and passed as ``cache``, transformers 5.2x's name, when the model's forward takes that);
nothing here imports transformers. Prompts run one at a time (batch 1: no padding to disturb the numbers).

The helpers, mapped onto HF's KV cache:

match              generate (prefill + decode steps); reference: one forward of prompt+output.
prefill_cache_hit  forward prompt[:-1] to build a cache, then generate(prompt,
                   past_key_values=cache): the prompt is restored from the cache and only its
                   last token is computed, as sglang does after a radix-cache hit.
decode_cache_hit   turn 1 generates; turn 2 = prompt + output + one token is generated on turn
                   1's returned cache (it holds everything but the last generated token).

A model whose generate does not take a cache (or returns none), or whose cache reports no
length (a state-space model's recurrent state: Mamba, Mamba-2), gets those two helpers marked
n/a with the reason; the verdict then rests on `match`.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Iterable, Optional

import torch

from ..errors import DumpError
from . import score as kl

Log = Callable[[str], None]


def _device(model):
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _logits(output):
    return output.logits if hasattr(output, "logits") else output[0]


# transformers 5.2x renamed past_key_values to cache: outputs are read under both names, and
# the keyword passed is the one the model's forward takes. Mamba's forward returns cache_params.
CACHE_NAMES = ("past_key_values", "cache", "cache_params")


def _returned_cache(output):
    return next((getattr(output, n) for n in CACHE_NAMES if getattr(output, n, None) is not None), None)


def _cache_keyword(model) -> str:
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


class _NotApplicable(Exception):
    pass


def _cache_len(cache) -> Optional[int]:
    if cache is None:
        return None
    if hasattr(cache, "get_seq_length"):
        try:
            return int(cache.get_seq_length())
        except Exception as exc:  # noqa: BLE001 - a state-only cache (Mamba's) raises ValueError
            # generate resumes a passed cache from its length: without one it recomputes the prompt
            raise _NotApplicable(
                f"its cache ({type(cache).__name__}) reports no length (get_seq_length raised "
                f"{type(exc).__name__}): a recurrent state, not a cache of tokens, so no prompt "
                "prefix can be restored from it"
            ) from None
    try:  # legacy tuple of (key, value) per layer: [batch, heads, seq, dim]
        return int(cache[0][0].shape[-2])
    except (TypeError, IndexError, AttributeError):
        return None


class _Runner:
    def __init__(self, model, max_new_tokens: int, temperature: float, seed: int) -> None:
        self.model = model
        self.device = _device(model)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.cache_keyword = _cache_keyword(model)

    def tensor(self, ids):
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def generate(self, ids, cache=None):
        """-> (new token ids, their decode logprobs, the returned cache)."""
        x = self.tensor(ids)
        kwargs = dict(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.max_new_tokens,  # = ignore_eos
            return_dict_in_generate=True,
            output_logits=True,
            attention_mask=torch.ones_like(x),
        )
        if self.temperature > 0:
            torch.manual_seed(self.seed)
            kwargs.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if cache is not None:
            kwargs[self.cache_keyword] = cache
        with torch.no_grad():
            out = self.model.generate(x, **kwargs)
        new = out.sequences[0, x.shape[1] :].tolist()
        if len(out.logits) != len(new):
            raise DumpError(f"generate returned {len(out.logits)} logits for {len(new)} new tokens")
        lps = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, new)]
        return new, lps, _returned_cache(out)

    def prefill(self, full, n: int):
        """Reference: one forward of `full`; logprobs of its last n tokens."""
        with torch.no_grad():
            logits = _logits(self.model(self.tensor(full), use_cache=False))[0].float()
        lp = torch.log_softmax(logits[-n - 1 : -1], -1)
        return lp.gather(-1, torch.tensor(full[-n:], device=lp.device)[:, None])[:, 0].tolist()

    def warm(self, ids):
        with torch.no_grad():
            return _returned_cache(self.model(self.tensor(ids), use_cache=True))


def _match(run: _Runner, i: int, prompt: list, turn: int):
    new, dec, _ = run.generate(prompt)
    return {
        "index": i,
        "prompt_len": len(prompt),
        "output_len": len(new),
        "cached_tokens": 0,
        "hit": True,
        "decode_lp": dec,
        "prefill_lp": run.prefill(prompt + new, len(new)),
    }


def _prefill_cache_hit(run: _Runner, i: int, prompt: list, turn: int):
    cache = run.warm(prompt[:-1])
    cached = _cache_len(cache)
    if cached is None:
        raise _NotApplicable("model(..., use_cache=True) returned no past_key_values")
    new, dec, _ = run.generate(prompt, cache=cache)
    hit = cached == len(prompt) - 1
    return {
        "index": i,
        "prompt_len": len(prompt),
        "output_len": len(new),
        "cached_tokens": cached,
        "hit": hit,
        "decode_lp": dec,
        "prefill_lp": run.prefill(prompt + new, len(new)) if hit else None,
    }


def _decode_cache_hit(run: _Runner, i: int, prompt: list, turn: int):
    first, _, cache = run.generate(prompt)
    cached = _cache_len(cache)
    if cached is None:
        raise _NotApplicable("generate(..., return_dict_in_generate=True) returned no past_key_values")
    second = prompt + first + [turn if turn is not None else prompt[-1]]
    new, dec, _ = run.generate(second, cache=cache)
    hit = cached > len(prompt) + 1
    return {
        "index": i,
        "prompt_len": len(prompt),
        "turn2_len": len(second),
        "output_len": len(new),
        "cached_tokens": cached,
        "hit": hit,
        "decode_lp": dec,
        "prefill_lp": run.prefill(second + new, len(new)) if hit else None,
    }


RUNNERS = {"match": _match, "prefill_cache_hit": _prefill_cache_hit, "decode_cache_hit": _decode_cache_hit}


def describe_model(model) -> dict:
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None) or type(model).__name__
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    except (AttributeError, StopIteration, TypeError):
        dtype = None
    return {
        "engine": "in-process",
        "model": str(name),
        "model_class": type(model).__name__,
        "tp": 1,
        "dtype": dtype,
        "device": str(_device(model)),
    }


def check_model(
    model,
    prompts: Iterable,
    *,
    max_new_tokens: int = 32,
    helpers: Iterable[str] = kl.HELPERS,
    threshold: Optional[float] = None,
    thresholds_file: Optional[str] = None,
    temperature: float = 0.0,
    seed: int = 0,
    turn_token: Optional[int] = None,
    min_hit_rate: float = 0.5,
    tokenizer=None,
    log: Log = lambda _m: None,
) -> dict:
    """Run the helpers on an in-process model; the same result dict as kl_helpers.check_server.

    prompts: token-id lists (or 1-D tensors), or texts when `tokenizer` (anything with
    .encode(text) -> ids) is given. threshold / thresholds_file: as for the server check
    (the file is keyed by the model's name_or_path, tp=1).
    """
    from .thresholds import resolve_thresholds

    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise DumpError("text prompts need a tokenizer (tokenizer=...); or give token ids")
            p = tokenizer.encode(p)
        p = p.tolist() if hasattr(p, "tolist") else list(p)
        if p and isinstance(p[0], list):  # a [1, L] batch of one
            p = p[0]
        if not p:
            raise DumpError("an empty prompt")
        ids.append([int(t) for t in p])
    if not ids:
        raise DumpError("no prompts")
    target = describe_model(model)
    limits = resolve_thresholds(threshold, thresholds_file, target)
    run = _Runner(model, max_new_tokens, temperature, seed)
    helpers = list(helpers)
    lengths = [len(p) for p in ids]
    result = {
        "kind": "dumpdiff-kl",
        "target": target,
        "prompts": {"source": "given", "count": len(ids), "min_len": min(lengths), "max_len": max(lengths)},
        "settings": {
            "max_samples": len(ids),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "min_hit_rate": min_hit_rate,
            "helpers": helpers,
        },
        "threshold": limits,
        "helpers": {},
        "timings": {},
        "notes": [
            "in-process: one prompt at a time (batch 1); the decode run is model.generate, the reference "
            "one forward of prompt+output"
        ],
    }
    for name in helpers:
        if name not in RUNNERS:
            raise DumpError(f"unknown helper {name!r}; choose from {', '.join(kl.HELPERS)}")
        limit = limits["helpers"].get(name, limits["value"])
        t0 = time.monotonic()
        log(f"kl: {name}: {len(ids)} prompts x {max_new_tokens} new tokens (in-process) ...")
        try:
            rows = [RUNNERS[name](run, i, p, turn_token) for i, p in enumerate(ids)]
            summary = kl.summarize_helper(name, rows, limit, min_hit_rate=min_hit_rate)
        except _NotApplicable as exc:
            summary = kl.summarize_helper(name, [], limit, cache_applicable=False)
            summary["notes"] = [f"not applicable to this model: {exc}"]
        worst = summary.get("worst")
        if worst is not None:
            summary["worst_prompt_ids"] = ids[worst]
        result["timings"][name] = round(time.monotonic() - t0, 3)
        result["helpers"][name] = summary
        log(f"kl: {name}: {summary['status']} avg_kl_div={summary['avg_kl_div']}")
    result["verdict"] = kl.classify(result["helpers"], uncalibrated=limits["source"] == "default")
    return result
