"""Greedy decoding of an HF causal LM with each decode step one CUDA graph replay, dumped.

A static KV cache and static input buffers (token ids, positions, cache slot) are captured once
into a CUDA graph; every decode step fills the buffers and replays the graph, as an engine's
graph runner does. With the dumper installed and DUMPER_GRAPH_BUFFER_BYTES set, the capture
records the selected tensors into static device buffers and each replay is written as a pass,
like an eager decode step (docs/models-and-engines.md: CUDA graphs).

    python examples/hf_cuda_graph.py MODEL_PATH --out /tmp/dumper
    dumpdiff first-divergence /tmp/dumper/eager /tmp/dumper/graph

Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from typing import Optional

import torch


class GraphDecoder:
    """Prefill eagerly, then decode greedily: one graph replay per step (``graphs=False``: the same
    steps run eagerly through the same static buffers, the run to compare with)."""

    def __init__(self, model, batch: int, max_len: int, handle=None, graphs: bool = True) -> None:
        from transformers import StaticCache

        self.model, self.handle, self.graphs = model, handle, graphs
        device = next(model.parameters()).device
        self.cache = _static_cache(StaticCache, model, batch, max_len, device)
        if has_sliding_layers(self.cache):
            # its length is a Python int a replay does not advance: replays go wrong once the window fills
            raise ValueError(
                f"{type(model).__name__} has sliding-window attention layers, whose static cache a CUDA "
                "graph replay does not keep; this recipe replays full-attention models only"
            )
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None

    def step_inputs(self) -> dict:
        return dict(
            input_ids=self.ids,
            position_ids=self.pos,
            cache_position=self.slot,
            past_key_values=self.cache,
            use_cache=True,
        )

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up on a side stream, then capture one decode step. Done before the prefill:
        ``generate`` empties the cache the warm-up wrote to (in place: the graph keeps its
        addresses)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(**self.step_inputs())
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        recording = self.handle.capture(self.graph) if self.handle is not None else torch.cuda.graph(self.graph)
        with recording:
            self.logits = self.model(**self.step_inputs()).logits

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, steps: int, batch_rows: Optional[int] = None) -> torch.Tensor:
        """``prompt``: [batch, P] token ids (one length); returns the [batch, steps + 1] new tokens.
        ``batch_rows``: batch entries that are real requests, the rest padding (trimmed from the dump)."""
        batch, length = prompt.shape
        self.cache.reset()  # zeroed in place, its length too
        positions = torch.arange(length, device=prompt.device)
        out = self.model(
            input_ids=prompt,
            position_ids=positions.expand(batch, length),
            cache_position=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        token = out.logits[:, -1].argmax(-1)
        tokens = [token]
        for step in range(steps):
            self.ids.copy_(token[:, None])
            self.pos.fill_(length + step)
            self.slot.fill_(length + step)
            if self.graphs:
                if self.handle is not None:
                    self.handle.replay(self.graph, batch_rows=batch_rows)
                else:
                    self.graph.replay()
                logits = self.logits
            else:
                logits = self.model(**self.step_inputs()).logits
            token = logits[:, -1].argmax(-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1)


def has_sliding_layers(cache) -> bool:
    """Whether an HF cache holds a sliding-window layer (transformers 5's cache layers say so)."""
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _static_cache(cls, model, batch: int, max_len: int, device):
    """An HF StaticCache on the model's device and dtype: transformers 5 sizes it from the first
    update; earlier versions (4.4x-4.5x) take the batch, device and dtype up front."""
    params = inspect.signature(cls.__init__).parameters
    if "max_batch_size" in params or "batch_size" in params:
        sized = {"max_batch_size": batch} if "max_batch_size" in params else {"batch_size": batch}
        return cls(config=model.config, max_cache_len=max_len, device=device, dtype=model.dtype, **sized)
    return cls(config=model.config, max_cache_len=max_len)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from dumpdiff import dumper

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", default="/tmp/dumper")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--buffer-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model).cuda().eval()
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    config = dumper.DumperConfig(dir=args.out, graph_buffer_bytes=args.buffer_bytes, cleanup_previous=True)
    for name, graphs in (("eager", False), ("graph", True)):
        handle = dumper.install(model, config)
        with contextlib.ExitStack() as stack:
            stack.callback(handle.remove)
            decoder = GraphDecoder(model, args.batch, args.prompt + args.steps + 1, handle, graphs)
            if graphs:
                decoder.capture()
            handle.configure(enable=True, exp_name=name)
            print(name, decoder.generate(prompt, args.steps).tolist())
    print(f"dumpdiff first-divergence {args.out}/eager {args.out}/graph")


if __name__ == "__main__":
    main()
