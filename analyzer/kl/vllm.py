"""The KL check's server calls against vLLM's OpenAI-compatible server.

``VllmServer`` answers what server.Server answers (facts, flush, generate), and returns
results in the shape the helpers read (output_ids, meta_info.output_token_logprobs,
input_token_logprobs, cached_tokens), so the helpers and their verdicts are the engine's
neither. Over vLLM's public API only:

- facts: /v1/models (model path, ``owned_by: vllm``), /version, and the engine config from
  /server_info (served with VLLM_SERVER_DEV_MODE=1) or else the cache_config_info gauge of
  /metrics;
- generate: one POST /v1/completions per prompt, sent together so the engine batches them;
  ``prompt_logprobs`` gives every prompt token's logprob (the reference prefill);
- cached tokens: usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details);
- flush: POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

from ..errors import DumpError
from ..http import get_json, post_json
from .server import Server

NEEDS_DEV_MODE = (
    "vLLM serves /reset_prefix_cache only in development mode: restart the server with "
    "VLLM_SERVER_DEV_MODE=1 in its environment (the KL check empties the prefix cache between runs)"
)
NEEDS_DETAILS = (
    "vLLM reports a request's cached tokens only with --enable-prompt-tokens-details: restart the "
    "server with it (the cache-hit helpers check that the prefix came back from the cache)"
)


def is_vllm(url: str) -> bool:
    """True when /v1/models says vLLM serves the model (sglang's server does not say so)."""
    try:
        models = get_json(url.rstrip("/") + "/v1/models", timeout=30)
    except DumpError:
        return False
    data = models.get("data") if isinstance(models, dict) else None
    return bool(data) and isinstance(data[0], dict) and data[0].get("owned_by") == "vllm"


class VllmServer(Server):
    """server.Server's facts and calls, over vLLM's API; info() holds the same keys."""

    engine = "vllm"

    def info(self) -> dict:
        if self._info is None:
            models = get_json(self.url + "/v1/models", timeout=60)
            entry = models["data"][0]
            info = {
                "served_model_name": entry.get("id"),
                "model_path": entry.get("root") or entry.get("id"),
                "max_model_len": entry.get("max_model_len"),
            }
            try:
                info["version"] = (get_json(self.url + "/version", timeout=30) or {}).get("version")
            except DumpError:
                pass
            info.update(self._engine_config())
            self._info = info
        return self._info

    def _engine_config(self) -> dict:
        """sglang's names for vLLM's settings: a block is a page, the prefix cache a radix
        cache, and a step's token budget the prefill chunk (chunked prefill is on in V1)."""
        try:
            config = get_json(self.url + "/server_info?config_format=json", timeout=60)["vllm_config"]
        except (DumpError, KeyError, TypeError):
            return _config_from_metrics(self.url)
        cache, sched = config.get("cache_config") or {}, config.get("scheduler_config") or {}
        model, parallel = config.get("model_config") or {}, config.get("parallel_config") or {}
        blocks, size = cache.get("num_gpu_blocks"), cache.get("block_size")
        return {
            "page_size": size,
            "disable_radix_cache": cache.get("enable_prefix_caching") is False,
            "max_total_num_tokens": blocks * size if blocks and size else None,
            "chunked_prefill_size": sched.get("max_num_batched_tokens")
            if sched.get("enable_chunked_prefill") is not False
            else None,
            "tp_size": parallel.get("tensor_parallel_size"),
            "dtype": str(model.get("dtype") or "") or None,
            "skip_tokenizer_init": model.get("skip_tokenizer_init"),
        }

    def describe(self) -> dict:
        info = self.info()
        return {
            "url": self.url,
            "engine": "vllm",
            "version": info.get("version"),
            "model": self.model,
            "served_model_name": info.get("served_model_name"),
            "tp": self.tp,
            "dtype": info.get("dtype"),
            "device": None,
            "radix_cache": self.radix_cache,
            "page_size": self.page_size,
            "chunked_prefill_size": self.chunk_size,
            "attention_backend": None,
            "deterministic_inference": False,
        }

    # -- calls -------------------------------------------------------------------------------
    def flush(self, attempts: int = 20):
        """POST /reset_prefix_cache; vLLM refuses ({"success": false}) while requests hold blocks."""
        for _ in range(attempts):
            try:
                reply = post_json(self.url + "/reset_prefix_cache", {}, timeout=60)
            except DumpError as exc:
                if "HTTP 404" in str(exc):
                    raise DumpError(NEEDS_DEV_MODE) from None
                raise DumpError(f"could not reset the prefix cache: {exc}") from None
            if reply is not False and not (isinstance(reply, dict) and reply.get("success") is False):
                return
            time.sleep(0.5)
        raise DumpError(f"{self.url}/reset_prefix_cache kept refusing; are other requests running on the server?")

    def generate(
        self,
        input_ids: List[List[int]],
        max_new_tokens: int,
        *,
        sampling: dict,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
    ) -> list:
        """One completion per prompt, sent at once; results as sglang's /generate shapes them.
        max_new_tokens 0 (a prefill alone) asks for one token and reports none."""
        params = {k: v for k, v in sampling.items() if k != "sampling_seed"}
        if "sampling_seed" in sampling:
            params["seed"] = sampling["sampling_seed"]

        def one(prompt):
            body = {
                "model": self.info()["served_model_name"],
                "prompt": [list(prompt)],
                "max_tokens": max(1, max_new_tokens),
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                **params,
            }
            if return_logprob and logprob_start_len == 0:
                body["prompt_logprobs"] = 1
            reply = post_json(self.url + "/v1/completions", body, timeout=self.timeout)
            return _as_result(reply, prompt, max_new_tokens, f"{self.url}/v1/completions")

        if not input_ids:
            return []
        with ThreadPoolExecutor(max_workers=len(input_ids)) as pool:
            return list(pool.map(one, input_ids))

    def tokenize(self, texts: List[str], add_special_tokens: bool = True) -> List[List[int]]:
        out = []
        for text in texts:
            reply = post_json(
                self.url + "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens}, timeout=120
            )
            tokens = reply.get("tokens") if isinstance(reply, dict) else None
            if not isinstance(tokens, list):
                raise DumpError(f"{self.url}/tokenize: unexpected reply {str(reply)[:200]}")
            out.append(tokens)
        return out


def _token_id(token: str, where: str) -> int:
    match = re.fullmatch(r"token_id:(-?\d+)", str(token))
    if not match:
        raise DumpError(f"{where}: output token {token!r} is not 'token_id:N' (return_tokens_as_token_ids)")
    return int(match.group(1))


def _as_result(reply, prompt: list, max_new_tokens: int, where: str) -> dict:
    try:
        choice = reply["choices"][0]
        logprobs = choice["logprobs"] or {}
    except (KeyError, IndexError, TypeError):
        raise DumpError(f"{where}: not a completion reply: {str(reply)[:200]}") from None
    details = (reply.get("usage") or {}).get("prompt_tokens_details")
    if not isinstance(details, dict):
        raise DumpError(NEEDS_DETAILS)
    ids = [_token_id(t, where) for t in logprobs.get("tokens") or []]
    values = logprobs.get("token_logprobs") or []
    meta = {
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "output_token_logprobs": [[v, i] for v, i in zip(values, ids)][:max_new_tokens],
    }
    prompt_lps = choice.get("prompt_logprobs")
    if prompt_lps is not None:
        meta["input_token_logprobs"] = [_prompt_entry(entry, token) for entry, token in zip(prompt_lps, prompt)]
    return {"output_ids": ids[:max_new_tokens], "meta_info": meta}


def _prompt_entry(entry, token: int) -> list:
    """[logprob of the prompt token, its id]; vLLM keys each position's dict by token id."""
    if entry is None:  # the first token: nothing before it to predict it
        return [None, token]
    scored = entry.get(str(token)) if isinstance(entry, dict) else None
    if not isinstance(scored, dict):  # the check then says the positions do not line up
        return [None, next(iter(entry), None) if isinstance(entry, dict) else None]
    return [scored.get("logprob"), token]


def _config_from_metrics(url: str) -> dict:
    """Block size and prefix caching from the cache_config_info gauge (no dev mode needed)."""
    try:
        text = get_json(url + "/metrics", timeout=30)
    except DumpError:
        return {}
    line = next((ln for ln in str(text).splitlines() if ln.startswith("vllm:cache_config_info{")), "")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    out = {}
    if labels.get("block_size", "").isdigit():
        out["page_size"] = int(labels["block_size"])
    if labels.get("enable_prefix_caching") in ("True", "False"):
        out["disable_radix_cache"] = labels["enable_prefix_caching"] == "False"
    if labels.get("num_gpu_blocks", "").isdigit() and "page_size" in out:
        out["max_total_num_tokens"] = int(labels["num_gpu_blocks"]) * out["page_size"]
    return out


def connect(url: str, timeout: float = 600.0):
    """The KL client for the engine at ``url``: sglang when its server info answers, else vLLM
    when /v1/models says so; else sglang's error (it names what was asked)."""
    sglang = Server(url, timeout)
    try:
        sglang.info()
        return sglang
    except DumpError:
        if not is_vllm(url):
            raise
    return VllmServer(url, timeout)
