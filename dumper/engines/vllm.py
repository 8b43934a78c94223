"""vLLM adapter: pass metadata from the V1 model runner that calls the model's forward.

vLLM's model forward takes only ``input_ids`` and ``positions`` (flat [T]: each scheduled
request's new tokens, request after request). Who those rows belong to lives in the model
runner's state, filled just before the forward: ``input_batch.req_ids`` (the order of the
requests), ``query_start_loc`` (where each request's rows start), ``num_computed_tokens_cpu``
(tokens a request already has in the KV cache: a prefix-cache hit, an earlier chunk, earlier
decode steps) and ``requests[rid]`` (its prompt and output ids, for the prefix the pass skips).
Sequences are keyed by vLLM's request id; the analyzer aligns on token ids. This module imports
nothing from vLLM at import time: it reads runner fields by name.
"""

from __future__ import annotations

from typing import List

from ..passinfo import PassInfo, UndescribedPass, WarmupPass, int_list


def _ids_and_positions(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    return ids, pos


def pass_mode(computed: List[int], prompt_lens: List[int], lengths: List[int]) -> str:
    """prefill: every request starts at 0; extend: prompt rows after cached or earlier-chunk
    rows; decode: one generated token each; mixed: prompt rows and decode rows together."""
    decoding = [c >= p for c, p in zip(computed, prompt_lens)]
    if all(decoding):
        return "decode" if all(n == 1 for n in lengths) else "extend"
    if any(decoding):
        return "mixed"
    return "prefill" if not any(computed) else "extend"


class VllmAdapter:
    engine = "vllm"

    def __init__(self, runner):
        self.runner = runner

    def pass_info(self, model, args, kwargs) -> PassInfo:
        runner = self.runner
        batch = runner.input_batch
        n_reqs = int(batch.num_reqs)
        if n_reqs == 0:  # a profiling or warm-up run: no request is scheduled
            raise WarmupPass("no request in this forward")
        ids_tensor, pos_tensor = _ids_and_positions(args, kwargs)
        if ids_tensor is None or pos_tensor is None:
            raise UndescribedPass(
                "the forward got no input_ids/positions (prompt embeddings or a pipeline "
                "stage after the first: its rows cannot be tied to token ids)"
            )
        ids, pos = int_list(ids_tensor), int_list(pos_tensor)
        rids = list(batch.req_ids[:n_reqs])
        starts = [int(v) for v in runner.query_start_loc.np[: n_reqs + 1]]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        computed = [int(v) for v in batch.num_computed_tokens_cpu[:n_reqs]]
        prompt_lens = [int(v) for v in batch.num_prompt_tokens[:n_reqs]]
        if starts[-1] > len(ids) or any(pos[start] != c for start, c, n in zip(starts, computed, lengths) if n):
            # The runner's state is not this forward's (speculative drafts, a runner we do not know)
            raise UndescribedPass(
                f"the model runner's batch ({sum(lengths)} rows, computed tokens {computed}) "
                f"does not match this forward's {len(ids)} rows"
            )
        seq, last_rows = [], []
        for rid, n in zip(rids, lengths):
            seq += [rid] * n
            last_rows.append(len(seq) - 1)
        seq += [""] * (len(ids) - len(seq))  # padding rows no request owns
        info = PassInfo(
            mode=pass_mode(computed, prompt_lens, lengths),
            token_shape=[len(ids)],
            ids=ids,
            pos=pos,
            seq=seq,
            valid=[bool(s) for s in seq],
            last_rows=last_rows,
        )
        info.extra = {
            "rids": rids,
            "prefix_lens": computed,
            "extend_lens": lengths,
            "seq_lens": [c + n for c, n in zip(computed, lengths)],
            "prompt_lens": prompt_lens,
        }
        requests = getattr(runner, "requests", {})
        for rid in rids:
            state = requests.get(rid)
            if state is not None and state.prompt_token_ids is not None:
                info.history[rid] = lambda s=state: list(s.prompt_token_ids) + list(s.output_token_ids)
        return info

    def after_pass(self, model, info, output):
        pass

    def run_info(self, model) -> dict:
        config = getattr(self.runner, "vllm_config", None)
        model_config = getattr(config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        parallel = getattr(config, "parallel_config", None)
        cache = getattr(config, "cache_config", None)
        sched = getattr(config, "scheduler_config", None)
        return {
            "model": getattr(model_config, "model", None) or type(model).__name__,
            "model_type": getattr(hf_config, "model_type", None),
            "num_layers": getattr(hf_config, "num_hidden_layers", None),
            "dtype": str(getattr(model_config, "dtype", "")).replace("torch.", "") or None,
            "device": str(getattr(self.runner, "device", "")),
            "tp_size": getattr(parallel, "tensor_parallel_size", None),
            "tp_rank": _tp_rank(),
            "flags": {
                "enforce_eager": str(getattr(model_config, "enforce_eager", None)),
                "enable_prefix_caching": str(getattr(cache, "enable_prefix_caching", None)),
                "block_size": str(getattr(cache, "block_size", None)),
                "enable_chunked_prefill": str(getattr(sched, "enable_chunked_prefill", None)),
                "max_num_batched_tokens": str(getattr(sched, "max_num_batched_tokens", None)),
                "attention_backend": str(getattr(getattr(config, "attention_config", None), "backend", None)),
            },
        }


def _tp_rank():
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialized (a single process): rank 0
        return 0


def compile_problem(vllm_config) -> str | None:
    """None when Python hooks will see every pass; else the one line naming the flag to add."""
    compilation = getattr(vllm_config, "compilation_config", None)
    if compilation is None:
        return None
    on = []
    mode = getattr(compilation, "mode", None)
    if mode is not None and int(mode) != 0:  # CompilationMode.NONE
        on.append(f"torch.compile (compilation mode {getattr(mode, 'name', mode)})")
    graphs = getattr(compilation, "cudagraph_mode", None)
    if graphs is not None and getattr(graphs, "name", str(graphs)) != "NONE":
        on.append(f"CUDA graphs ({getattr(graphs, 'name', graphs)})")
    if not on:
        return None
    return (
        f"dumpdiff: dumping needs every forward pass to run eagerly, but {' and '.join(on)} "
        "would hide the model's modules from Python hooks; restart vLLM with --enforce-eager, or unset DUMPER_*"
    )
