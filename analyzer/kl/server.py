"""The sglang HTTP calls the KL check needs (vllm.py answers the same calls from vLLM's API)."""

from __future__ import annotations

import time
from typing import List, Optional

from ..errors import DumpError
from ..http import get_json, post_json


class Server:
    """The few sglang HTTP calls the KL check needs."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._info = None

    # -- facts -------------------------------------------------------------------------------
    def info(self) -> dict:
        if self._info is None:
            try:
                info = get_json(self.url + "/server_info", timeout=60)
            except DumpError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                info = get_json(self.url + "/get_server_info", timeout=60)
            if not isinstance(info, dict) or "model_path" not in info:
                raise DumpError(f"{self.url}/server_info: not an sglang server info reply")
            self._info = info
        return self._info

    @property
    def model(self) -> str:
        return str(self.info().get("model_path"))

    @property
    def tp(self) -> int:
        return int(self.info().get("tp_size") or 1)

    @property
    def page_size(self) -> int:
        return int(self.info().get("page_size") or 1)

    @property
    def radix_cache(self) -> bool:
        return not self.info().get("disable_radix_cache", False)

    @property
    def chunk_size(self) -> Optional[int]:
        """--chunked-prefill-size; None when chunked prefill is off (None, -1 or 0)."""
        value = self.info().get("chunked_prefill_size")
        return int(value) if isinstance(value, (int, float)) and value > 0 else None

    @property
    def kv_tokens(self) -> Optional[int]:
        value = self.info().get("max_total_num_tokens")
        return int(value) if isinstance(value, (int, float)) and value > 0 else None

    @property
    def has_tokenizer(self) -> bool:
        return not self.info().get("skip_tokenizer_init", False)

    def describe(self) -> dict:
        info = self.info()
        return {
            "url": self.url,
            "engine": "sglang",
            "version": info.get("version"),
            "model": self.model,
            "served_model_name": info.get("served_model_name"),
            "tp": self.tp,
            "dtype": info.get("dtype"),
            "device": info.get("device"),
            "radix_cache": self.radix_cache,
            "page_size": self.page_size,
            "chunked_prefill_size": self.chunk_size,
            "attention_backend": info.get("attention_backend"),
            "deterministic_inference": bool(info.get("enable_deterministic_inference")),
        }

    # -- calls -------------------------------------------------------------------------------
    def flush(self, attempts: int = 20) -> None:
        """POST /flush_cache; sglang answers 400 while requests are still running: retry."""
        for attempt in range(attempts):
            try:
                post_json(self.url + "/flush_cache?timeout=30", {}, timeout=60)
                return
            except DumpError as exc:
                if "HTTP 400" not in str(exc) or attempt == attempts - 1:
                    raise DumpError(f"could not flush the cache: {exc}") from None
                time.sleep(0.5)

    def generate(
        self,
        input_ids: List[List[int]],
        max_new_tokens: int,
        *,
        sampling: dict,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
    ) -> list:
        body = {
            "input_ids": input_ids,
            "sampling_params": {**sampling, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        if return_logprob:
            body.update(
                {"return_logprob": True, "return_text_in_logprobs": False, "logprob_start_len": logprob_start_len}
            )
        results = post_json(self.url + "/generate", body, timeout=self.timeout)
        if not isinstance(results, list) or len(results) != len(input_ids):
            raise DumpError(
                f"{self.url}/generate: expected {len(input_ids)} results, got "
                f"{type(results).__name__}{'' if not isinstance(results, list) else ' of ' + str(len(results))}"
            )
        for r in results:
            if not isinstance(r, dict) or "meta_info" not in r:
                raise DumpError(f"{self.url}/generate: a result without meta_info: {str(r)[:200]}")
        return results

    def tokenize(self, texts: List[str], add_special_tokens: bool = True) -> List[List[int]]:
        reply = post_json(
            self.url + "/tokenize", {"prompt": texts, "add_special_tokens": add_special_tokens}, timeout=120
        )
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or len(tokens) != len(texts):
            raise DumpError(f"{self.url}/tokenize: unexpected reply {str(reply)[:200]}")
        return tokens
