"""sglang adapter: pass metadata from the ForwardBatch that sglang hands every model forward.

Token rows are sglang's flat layout [T]: each request's extend (or single decode) tokens,
request after request. Sequences are keyed by request id, stable across a request's passes.
For a prefix-cache hit (an extend that starts at the cached prefix length) the request's own
token ids say what the skipped prefix was; the plugin remembers the batch's requests.
This module imports nothing from sglang: it reads ForwardBatch fields by name.
"""

from __future__ import annotations

from ..passinfo import PassInfo, int_list

_latest_requests: dict = {}  # rid -> sglang Req of the batch being built (set by the plugin)


def remember_requests(reqs) -> None:
    _latest_requests.clear()
    _latest_requests.update({req.rid: req for req in reqs})


def find_forward_batch(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if type(value).__name__ == "ForwardBatch":
            return value
    return None


_as_list = int_list


def _mode_name(forward_mode) -> str:
    for name in ("decode", "mixed", "extend", "idle"):
        check = getattr(forward_mode, f"is_{name}", None)
        if check is not None and check():
            return {"extend": "extend", "idle": "unknown"}.get(name, name)
    return "unknown"


# LogitsProcessorOutput's input_* logprobs (asked for with return_logprob and
# logprob_start_len): the decode run's prefill scores its last prompt row against no real next
# token, the reference's against the first output token; compared row by row, a clean run read
# as a 6e5x jump at logits_processor.
_NEXT_TOKEN_SCORES = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


class SglangAdapter:
    engine = "sglang"

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner

    def capture_shape(self, model, args, kwargs) -> list:
        """[T] of a forward captured into a CUDA graph (a batch size's static buffers), from the
        ForwardBatch's shapes alone: its values are not a real batch's at capture."""
        batch = find_forward_batch(args, kwargs)
        if batch is None:
            raise ValueError("dumper: sglang model forward captured without a ForwardBatch")
        return [int(batch.input_ids.shape[0])]

    def pass_info(self, model, args, kwargs) -> PassInfo:
        batch = find_forward_batch(args, kwargs)
        if batch is None:
            raise ValueError("dumper: sglang model forward called without a ForwardBatch")
        ids = _as_list(batch.input_ids)
        pos = _as_list(batch.positions)
        n_seqs = int(batch.batch_size)
        rids = list(batch.rids) if getattr(batch, "rids", None) is not None else [f"req{i}" for i in range(n_seqs)]
        mode = _mode_name(batch.forward_mode)
        if mode == "decode":
            lengths, prefix = [1] * n_seqs, _as_list(batch.seq_lens)
            prefix = [p - 1 for p in prefix]
        else:
            lengths = _as_list(getattr(batch, "extend_seq_lens_cpu", None) or batch.extend_seq_lens)
            prefix = _as_list(getattr(batch, "extend_prefix_lens_cpu", None) or batch.extend_prefix_lens)
        if mode == "extend" and not any(prefix):
            mode = "prefill"
        seq, last_rows = [], []
        for rid, length in zip(rids, lengths):
            seq += [rid] * length
            last_rows.append(len(seq) - 1)
        if len(seq) != len(ids):  # padded buffers (graphs, DP) carry rows no request owns
            seq += [""] * (len(ids) - len(seq))
        info = PassInfo(
            mode=mode,
            token_shape=[len(ids)],
            ids=ids,
            pos=pos,
            seq=seq[: len(ids)],
            valid=[bool(s) for s in seq[: len(ids)]],
            last_rows=last_rows,
        )
        info.extra = {
            "seq_lens": _as_list(batch.seq_lens),
            "prefix_lens": prefix,
            "extend_lens": lengths,
            "rids": rids,
            "forward_mode": str(getattr(batch.forward_mode, "name", batch.forward_mode)),
        }
        for rid in rids:
            req = _latest_requests.get(rid)
            if req is not None:
                info.history[rid] = lambda r=req: list(r.origin_input_ids) + list(r.output_ids)
        return info

    def after_pass(self, model, info, output) -> None:
        pass

    def rows_not_aligned(self, cls: str, name: str) -> str | None:
        """Why a tensor whose first dim has the pass's token rows still holds no row per token
        row (None: it does)."""
        if cls == "LogitsProcessor" and any(f".out.{field}" in name for field in _NEXT_TOKEN_SCORES):
            return "entry i scores token i+1, which a pass of the prompt alone does not have at its last row"
        return None

    def run_info(self, model) -> dict:
        runner = self.model_runner
        info = {"model": type(model).__name__}
        if runner is None:
            return info
        args = getattr(runner, "server_args", None)
        config = getattr(getattr(runner, "model_config", None), "hf_config", None)
        info.update(
            {
                "model": getattr(args, "model_path", None) or type(model).__name__,
                "model_type": getattr(config, "model_type", None),
                "num_layers": getattr(config, "num_hidden_layers", None),
                "dtype": str(getattr(getattr(runner, "model_config", None), "dtype", "")).replace("torch.", "") or None,
                "device": str(getattr(runner, "device", "")),
                "tp_size": getattr(runner, "tp_size", None) or getattr(args, "tp_size", None),
                "tp_rank": getattr(runner, "tp_rank", None),
                "flags": {k: str(getattr(args, k, None)) for k in FLAGS_OF_INTEREST if hasattr(args, k)},
            }
        )
        return info


def _graph_backend(server_args, phase: str) -> str:
    """The resolved backend if sglang resolved one, else what the flags say (newest first)."""
    config = getattr(server_args, "cuda_graph_config", None)
    backend = getattr(getattr(config, phase, None), "backend", None)
    if backend is None:
        backend = getattr(server_args, f"cuda_graph_backend_{phase}", None)
    if backend is None:
        off = getattr(server_args, "disable_cuda_graph", False) or getattr(
            server_args, f"disable_{phase}_cuda_graph", False
        )
        backend = "disabled" if off else "default (on)"
    return str(getattr(backend, "value", backend))


FLAGS_OF_INTEREST = (
    "attention_backend",
    "sampling_backend",
    "chunked_prefill_size",
    "disable_radix_cache",
    "enable_deterministic_inference",
    "cuda_graph_config",
    "kv_cache_dtype",
    "quantization",
    "random_seed",
)


def cuda_graph_problem(server_args, device: str) -> str | None:
    """None when hooks will see every pass; else the message naming the flags to add."""
    if not str(device).startswith("cuda"):
        return None
    on = [phase for phase in ("decode", "prefill") if _graph_backend(server_args, phase) != "disabled"]
    if getattr(server_args, "enable_piecewise_cuda_graph", False) and not getattr(
        server_args, "disable_piecewise_cuda_graph", False
    ):
        on.append("piecewise")
    if not on:
        return None
    return (
        "dumpdiff: dumping needs every forward pass to run eagerly, but CUDA graphs are on for "
        f"{', '.join(on)} (Python hooks do not run inside graph replay, the dump would hold only "
        "the embedding); restart the server with --cuda-graph-backend-decode disabled "
        "--cuda-graph-backend-prefill disabled (older sglang: --disable-cuda-graph "
        "--disable-prefill-cuda-graph --disable-piecewise-cuda-graph), or unset DUMPER_*"
    )
