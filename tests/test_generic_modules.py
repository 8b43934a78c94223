"""The dumper on plain torch.nn.Module models (no HF, no engine): unusual calls must never break
the model or record wrong bytes, and a model with its own KV cache must be dumped so that its
decode rows pair with a reference prefill."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import torch
from test_dumper_units import Toy, read_pass

from dumpdiff import dumper
from dumpdiff.dumper import format as fmt
from dumpdiff.dumper.config import DumperConfig
from helpers import dumpdiff, first_divergence_json

D, V = 16, 50


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x, cache, start):
        q, k, v = self.qkv(x).chunk(3, -1)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
            cache["k"], cache["v"] = k, v
        mask = torch.arange(k.shape[1])[None, :] > (torch.arange(q.shape[1])[:, None] + start)
        return self.o(((q @ k.transpose(1, 2)) / math.sqrt(D)).masked_fill(mask, float("-inf")).softmax(-1) @ v)


class MLP(torch.nn.Module):
    bug = False

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        return y * 1.001 if self.bug and x.shape[1] == 1 else y  # planted: wrong on one-row (decode) passes


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = torch.nn.LayerNorm(D), Attn(), torch.nn.LayerNorm(D), MLP()

    def forward(self, x, cache, start):
        x = x + self.attn(self.n1(x), cache, start)
        return x + self.mlp(self.n2(x))


class TinyLM(torch.nn.Module):
    """A language model of one's own: learned positions, a dict KV cache per layer, forward(ids,
    caches, start) as in llama's reference code."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(V, D), torch.nn.Embedding(64, D)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(D, V)

    def forward(self, ids, caches=None, start=0):
        x = self.embed(ids) + self.pos(torch.arange(start, start + ids.shape[1])[None])
        for i, block in enumerate(self.layers):
            x = block(x, None if caches is None else caches[i], start)
        return self.head(x)


class NoStartLM(TinyLM):
    """The same model keeping its position itself: its forward tells no positions."""

    def forward(self, ids, caches=None):
        start = caches[0]["k"].shape[1] if caches and "k" in caches[0] else 0
        return super().forward(ids, caches, start)


def generate_and_reference(model, root, prompt, new_tokens, with_start=True):
    """Greedy decode with the model's own cache (dumped as 'dec'), then one prefill of
    prompt+output (dumped as 'ref')."""
    handle = dumper.install(model, DumperConfig(dir=str(root), cleanup_previous=True))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            caches = [{} for _ in model.layers]
            out = prompt
            logits = model(prompt, caches, 0) if with_start else model(prompt, caches)
            for _ in range(new_tokens):
                out = torch.cat([out, logits[:, -1:].argmax(-1)], 1)
                step = out[:, -1:]
                logits = model(step, caches, out.shape[1] - 1) if with_start else model(step, caches)
            handle.configure(exp_name="ref")
            model(out)
    finally:
        handle.remove()
    return root / "ref", root / "dec"


def test_an_lm_of_ones_own_aligns_by_its_start_argument(tmp_path):
    """The generic adapter reads the forward's start argument: decode steps continue the prompt's
    sequence and pair with the reference. (They were fresh one-token prefills at position 0:
    unpaired, and the planted bug went unseen.)"""
    torch.manual_seed(0)
    model = TinyLM().eval()
    model.layers[0].mlp.bug = True
    ref, dec = generate_and_reference(model, tmp_path, torch.randint(0, V, (1, 12)), 5)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert verdict["alignment"]["unaligned_b"] == 0 and verdict["rows_compared"] == 17  # 12 prompt rows, 5 steps
    assert [c["call"] for c in verdict["noise"]["culprits"]] == ["layers.0.mlp#0"]
    assert verdict["noise"]["culprits"][0]["kinds"] == {"decode": 5}


def test_an_lm_that_keeps_its_positions_itself_is_not_paired_blindly(tmp_path, caplog):
    """Its forward gets a cache but no positions: the adapter cannot place the rows. It warns at
    dump time and records them unaligned, so the comparison refuses (exit 2) instead of pairing a
    decode token with the reference row of an equal token at position 0."""
    torch.manual_seed(0)
    model = NoStartLM().eval()
    with caplog.at_level(logging.WARNING, logger="dumper"):
        ref, dec = generate_and_reference(model, tmp_path, torch.randint(0, V, (1, 12)), 5, with_start=False)
    assert "gets 'caches' but no positions" in caplog.text
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert code == 2 and "no token row of dec matches" in err, out + err


def test_token_ids_are_found_by_name_and_a_forward_without_them_runs_undumped(tmp_path, caplog):
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)

        def forward(self, attention_mask, position_ids, input_ids):
            return self.embed(input_ids) * attention_mask[..., None]

    class FloatIn(torch.nn.Module):
        def forward(self, x):
            return x * 2

    handle = dumper.install(Masked(), DumperConfig(dir=str(tmp_path), enable=True, exp_name="masked"))
    with torch.no_grad():
        handle.model(torch.ones(1, 3, dtype=torch.bool), torch.arange(3)[None], torch.tensor([[4, 5, 6]]))
    handle.remove()
    meta, _ = read_pass(tmp_path / "masked" / "rank0" / fmt.pass_file_name(0))
    assert meta["tokens"]["ids"] == [4, 5, 6] and meta["tokens"]["pos"] == [0, 1, 2]

    model = FloatIn()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="float"))
    with caplog.at_level(logging.WARNING, logger="dumper"):
        assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))  # the call works, undumped
    handle.remove()
    assert "forward not dumped: no token ids" in caplog.text


def test_inference_mode_is_dumped(tmp_path):
    """Inference tensors have no version counter (reading it raised inside the model's forward):
    they are stored, never taken for an earlier tensor."""
    torch.manual_seed(0)
    model = Toy().eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        expected, _ = model(ids)
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="inf"))
    with torch.inference_mode():
        out, _ = model(ids)
    handle.remove()
    assert torch.equal(out, expected)
    meta, tensors = read_pass(tmp_path / "inf" / "rank0" / fmt.pass_file_name(0))
    split = {c["call"]: c for c in meta["calls"]}["split#0"]
    assert "alias" not in split["tensors"]["split#0.in.0"] and torch.equal(tensors["proj#0.out.0"] + 1.0, out)


def test_a_second_threads_forward_runs_undumped_while_a_pass_is_open(tmp_path):
    entered = threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            entered.set()  # the first thread's pass is open: the main thread calls now
            time.sleep(0.2)
            return x + 1

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.slow = torch.nn.Embedding(V, D), Slow()

        def forward(self, input_ids):
            return self.slow(self.embed(input_ids))

    torch.manual_seed(0)
    model = Model().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="t"))
    other = {}
    first = threading.Thread(target=lambda: model(torch.tensor([[1, 2, 3]])))
    with torch.no_grad():
        first.start()
        assert entered.wait(30)
        entered.clear()
        other["out"] = model(torch.tensor([[7, 8, 9, 10, 11]]))
        first.join()
    handle.remove()
    assert torch.equal(other["out"], model.embed(torch.tensor([[7, 8, 9, 10, 11]])) + 1)
    meta, tensors = read_pass(tmp_path / "t" / "rank0" / fmt.pass_file_name(0))
    assert meta["tokens"]["ids"] == [1, 2, 3] and tensors["slow#0.out.0"].shape == (1, 3, D)
    assert [c["call"] for c in meta["calls"]].count("slow#0") == 1  # none of the other thread's calls
    manifest = (tmp_path / "t" / "rank0" / "manifest.jsonl").read_text().splitlines()
    assert len(manifest) == 1


def test_tensors_the_format_does_not_hold_are_skipped_not_fatal(tmp_path):
    from torch.testing._internal.two_tensor import TwoTensor

    class Odd(torch.nn.Module):
        def forward(self, x):
            return (
                x.to(torch.complex64),
                torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
                TwoTensor(x.clone(), x.clone()),
                x.to(torch.float8_e4m3fnuz),
            )

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.odd = torch.nn.Embedding(V, D), Odd()

        def forward(self, input_ids):
            self.odd(self.embed(input_ids))
            return self.embed(input_ids)

    model = Model().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="odd"))
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    handle.remove()
    assert handle.state()["stopped"] is None
    meta, _ = read_pass(tmp_path / "odd" / "rank0" / fmt.pass_file_name(0))
    skipped = {c["call"]: c.get("skipped", {}) for c in meta["calls"]}["odd#0"]
    assert set(skipped) == {f"odd#0.out.{i}" for i in range(4)} and "subclass TwoTensor" in skipped["odd#0.out.2"]
    code, out, err = dumpdiff("first-divergence", tmp_path / "odd", tmp_path / "odd", "--no-progress")
    assert code == 0, err  # the analyzer reads such a dump (a float8 variant stopped it before)


def test_compiled_scripted_removed_and_reinstalled_models(tmp_path):
    torch.manual_seed(0)
    model = Toy().eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(TypeError, match="already torch.compile'd"):
        dumper.install(torch.compile(model), DumperConfig(dir=str(tmp_path)))
    with pytest.raises(TypeError, match="TorchScript"):
        dumper.install(torch.jit.script(torch.nn.Linear(2, 2)), DumperConfig(dir=str(tmp_path)))

    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="compiled"))
    compiled = torch.compile(model)
    with torch.no_grad():
        out, _ = compiled(ids)  # dumped eagerly: the dumper's work is never traced
        expected, _ = model(ids)
    handle.remove()
    assert torch.equal(out, expected)
    meta, _ = read_pass(tmp_path / "compiled" / "rank0" / fmt.pass_file_name(0))
    assert {"<root>#0", "embed#0", "split#0", "proj#0"} <= {c["call"] for c in meta["calls"]}
    with pytest.raises(RuntimeError, match="removed"):
        handle.configure(exp_name="again")  # hung forever before

    own = model.forward = lambda input_ids: ("own", input_ids)  # the user's own patch of this instance
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path)))
    handle.remove()
    assert model.forward is own


def test_slot_names_never_collide(tmp_path):
    class Nested(torch.nn.Module):
        def forward(self, x):
            return {"a.b": x + 1, "a": {"b": x + 2}}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.nested = torch.nn.Embedding(V, D), Nested()

        def forward(self, input_ids):
            return self.nested(self.embed(input_ids))["a.b"]

    model = Model().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="slots"))
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        model(ids)
        x = model.embed(ids)
    handle.remove()
    _, tensors = read_pass(tmp_path / "slots" / "rank0" / fmt.pass_file_name(0))
    assert torch.equal(tensors["nested#0.out.a.b"], x + 1) and torch.equal(tensors["nested#0.out.a.b~1"], x + 2)


def test_every_element_type_the_dumper_stores_is_one_the_analyzer_reads():
    from dumpdiff.analyzer.dump.dtypes import BY_NAME

    assert fmt.STORED_DTYPES == set(BY_NAME)
    assert {name: BY_NAME[name].code for name in BY_NAME} == fmt.SAFETENSORS_CODES  # the writer's codes


def test_a_dump_stopped_before_its_first_pass_says_why(tmp_path):
    """DUMPER_MAX_BYTES below one pass: nothing is committed, not even run.json; the analyzer
    gives the INCOMPLETE marker's reason, not "not a dumpdiff dump"."""
    torch.manual_seed(0)
    model = Toy().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="tiny", max_bytes=100))
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]))
    handle.remove()
    code, out, err = dumpdiff("index", tmp_path / "tiny", "--no-progress")
    assert code == 2 and "dumping stopped before the first: " in err and "DUMPER_MAX_BYTES=100" in err, err


def test_installing_and_dumping_does_not_import_torch_dynamo(tmp_path):
    """The dumper runs eagerly under torch.compile without importing dynamo in a process that
    never compiles (importing it took 0.7 s in every engine process, dumping or not)."""
    import subprocess
    import sys

    script = (
        "import sys, torch, dumper; m = torch.nn.Embedding(5, 4); "
        f"h = dumper.install(m, dumper.DumperConfig(dir={str(tmp_path)!r}, enable=True)); "
        "m(torch.tensor([[1, 2]])); h.remove(); print('torch._dynamo' in sys.modules)"
    )
    from helpers import ROOT

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_generic_adapter_reads_flags_input_pos_and_packed_rows_right(tmp_path, caplog):
    """A flag such as use_cache=False is no cache (it made every row unaligned); gpt-fast's
    input_pos gives positions; positions that restart within a row (packed sequences) cannot be
    placed: unaligned, with a warning."""

    class Flags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)

        def forward(self, idx, input_pos=None, use_cache=False, output_hidden_states=True):
            return self.embed(idx)

    model = Flags()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="flags"))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dumper"):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)
        model(torch.tensor([[4]]), input_pos=torch.tensor([3]))
        assert "cannot be placed" not in caplog.text
        model(torch.tensor([[1, 2, 3, 4]]), input_pos=torch.tensor([0, 1, 0, 1]))
    handle.remove()
    metas = [read_pass(tmp_path / "flags" / "rank0" / fmt.pass_file_name(i))[0] for i in range(3)]
    assert metas[0]["mode"] == "prefill" and all(metas[0]["tokens"]["valid"])
    assert metas[1]["mode"] == "decode" and metas[1]["tokens"]["pos"] == [3] and metas[1]["tokens"]["seq"] == ["s.0"]
    assert not any(metas[2]["tokens"]["valid"]) and "positions restart" in caplog.text


def test_removing_a_handle_twice_leaves_a_newer_install_alone(tmp_path):
    model = Toy().eval()
    first = dumper.install(model, DumperConfig(dir=str(tmp_path)))
    first.remove()
    second = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="second"))
    first.remove()  # tore down the second dumper's wrapper before
    with torch.no_grad():
        model(torch.tensor([[3, 4]]))
    second.remove()
    assert (tmp_path / "second" / "rank0" / fmt.pass_file_name(0)).is_file()


HEADS = 4


class HeadNorm(torch.nn.RMSNorm):
    """RMSNorm over one head's features; ``bug``: wrong on one-token (decode) passes."""

    bug = False

    def forward(self, x):
        y = super().forward(x)
        return y * 1.01 if self.bug and x.shape[0] == HEADS else y


class FlatAttn(torch.nn.Module):
    """Attention over flat token rows [T, D] with per-head q/k norms applied as sglang's Qwen3
    does: to q.reshape(-1, head_dim), [T*heads, head_dim]."""

    def __init__(self, dim):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.q_norm, self.k_norm = HeadNorm(dim // HEADS), HeadNorm(dim // HEADS)

    def forward(self, x, cache, positions):
        tokens, dim = x.shape
        q, k, v = self.qkv(x).split(dim, -1)
        q = self.q_norm(self.split(q) if hasattr(self, "split") else q.reshape(-1, dim // HEADS))
        scaled = hasattr(self, "q_scale") and (tokens == 1 or not self.q_scale.decode_only)
        q = (self.q_scale(q) if scaled else q).view(tokens, dim)
        k = self.k_norm(k.reshape(-1, dim // HEADS)).view(tokens, dim)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k]), torch.cat([cache["v"], v])
            cache["k"], cache["v"] = k, v
        heads = lambda t: t.view(t.shape[0], HEADS, -1).transpose(0, 1)  # noqa: E731
        scores = heads(q) @ heads(k).transpose(1, 2) / math.sqrt(dim // HEADS)
        hidden = torch.arange(k.shape[0])[None, :] > positions[:, None]  # cache slot j holds position j
        out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ heads(v)
        return self.o(out.transpose(0, 1).reshape(tokens, dim))


class FlatLM(torch.nn.Module):
    """An engine-style model: one sequence as flat token rows, forward(ids [T], positions [T], caches)."""

    def __init__(self, dim=32, layers=2):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(V, dim), torch.nn.Embedding(64, dim)
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(dim) for _ in range(layers)])
        self.attns = torch.nn.ModuleList([FlatAttn(dim) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, V)

    def forward(self, ids, positions, caches=None):
        x = self.embed(ids) + self.pos(positions)
        for i, (norm, attn) in enumerate(zip(self.norms, self.attns)):
            x = x + attn(norm(x), None if caches is None else caches[i], positions)
        return self.head(x)


def flat_generate_and_reference(model, root, prompt, new_tokens, **config):
    handle = dumper.install(model, DumperConfig(dir=str(root), cleanup_previous=True, **config))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            caches = [{} for _ in model.attns]
            out = prompt
            logits = model(prompt, torch.arange(len(prompt)), caches)
            for _ in range(new_tokens):
                out = torch.cat([out, logits[-1:].argmax(-1)])
                logits = model(out[-1:], torch.tensor([len(out) - 1]), caches)
            handle.configure(exp_name="ref")
            model(out, torch.arange(len(out)))
    finally:
        handle.remove()
    return root / "ref", root / "dec"


@pytest.mark.parametrize("config", [{}, {"last_rows": 5}], ids=["all rows", "last rows"])
def test_a_per_head_norm_of_a_flat_engine_is_compared_token_by_token(tmp_path, config):
    """sglang's Qwen3 normalizes q and k per head on [T*heads, head_dim]: no dim has the pass's
    T rows, and the norms were listed as not comparable, so a bug in them was blamed on code
    around them. A norm's k*T rows are held as [T, k, head_dim], one row per token row: a
    decode-only error in layer 1's q_norm is named there, and a clean run names nothing."""
    torch.manual_seed(0)
    model = FlatLM().eval()
    prompt = torch.randint(0, V, (12,))
    ref, dec = flat_generate_and_reference(model, tmp_path / "clean", prompt, 5, **config)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert not any("_norm" in n["call"] for n in verdict["not_comparable"]), verdict["not_comparable"]
    assert verdict["noise"]["culprits"] == [], verdict["summary"]
    meta, stored = read_pass(str(dec / "rank0" / "pass-000000.safetensors"))
    q_norm = next(c for c in meta["calls"] if c["call"] == "attns.0.q_norm#0")["tensors"]["attns.0.q_norm#0.in.0"]
    assert q_norm["held_as"] == [12 * HEADS, 8] and q_norm["shape"] == [12, HEADS, 8] and q_norm["token_dims"] == [0]
    kept = 5 if config else 12  # last_rows keeps the prefill's last 5 token rows, each with all its heads
    assert list(stored["attns.0.q_norm#0.in.0"].shape) == [kept, HEADS, 8]

    model.attns[1].q_norm.bug = True
    ref, dec = flat_generate_and_reference(model, tmp_path / "bug", prompt, 5, **config)
    code, result = first_divergence_json(ref, dec)
    culprits = result["ranks"]["0"]["noise"]["culprits"]
    assert code == 1 and [c["call"] for c in culprits] == ["attns.1.q_norm#0"], result["ranks"]["0"]["summary"]
    assert culprits[0]["kinds"] == {"decode": 5}


def test_a_module_shared_by_layers_is_named_after_the_layer_it_runs_in(tmp_path):
    """One module object given to every layer (sglang builds one rotary_emb per shape) used to
    be named after the first layer: layer 1's call read 'attns.0.q_norm#1'. It is named under the
    call it runs in, so a report's names say which layer ran it."""
    torch.manual_seed(0)
    model = FlatLM().eval()
    shared = HeadNorm(8)
    for attn in model.attns:
        attn.q_norm = shared
    ref, dec = flat_generate_and_reference(model, tmp_path, torch.randint(0, V, (12,)), 3)
    meta, _ = read_pass(str(dec / "rank0" / "pass-000000.safetensors"))
    names = [c["call"] for c in meta["calls"] if "q_norm" in c["call"]]
    assert names == ["attns.0.q_norm#0", "attns.1.q_norm#0"]
    code, result = first_divergence_json(ref, dec)
    assert code in (0, 1) and result["ranks"]["0"]["alignment"]["unaligned_b"] == 0


@pytest.mark.parametrize("layer", [0, 1])
def test_a_filter_selects_a_shared_modules_calls_by_the_layer_they_run_in(tmp_path, layer):
    """DUMPER_FILTER matched a shared module by its first path only: a filter for layer 1 left
    out layer 1's call of a norm first registered under layer 0, and a filter for layer 0
    dumped layer 1's call too. Each call is selected by the name it runs under."""
    torch.manual_seed(0)
    model = FlatLM().eval()
    shared = HeadNorm(8)
    for attn in model.attns:
        attn.q_norm = shared
    ref, dec = flat_generate_and_reference(model, tmp_path, torch.randint(0, V, (12,)), 2, filter=rf"attns\.{layer}\b")
    for dump in (ref, dec):
        meta, _ = read_pass(str(dump / "rank0" / "pass-000000.safetensors"))
        assert [c["call"] for c in meta["calls"] if "q_norm" in c["call"]] == [f"attns.{layer}.q_norm#0"]


class SharedMixer(torch.nn.Module):
    """One object given to every block (as Zamba2 shares its transformer block), with a child."""

    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x)


class MixerBlock(torch.nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return x + self.shared(x)


class MixerLM(torch.nn.Module):
    def __init__(self, dim=8, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(V, dim)
        shared = SharedMixer(dim)
        self.layers = torch.nn.ModuleList([MixerBlock(shared) for _ in range(layers)])

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("filter_text", ["", r"embed|layers\.2\b"])
def test_a_shared_blocks_children_follow_the_layer_it_runs_in(tmp_path, filter_text):
    """A shared block's child was named after the block's first path: layer 2's call of its proj
    read 'layers.0.shared.proj#2', and a filter for layer 2 left it out."""
    model = MixerLM().eval()
    handle = dumper.install(model, DumperConfig(dir=str(tmp_path), enable=True, exp_name="x", filter=filter_text))
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    finally:
        handle.remove()
    meta, _ = read_pass(str(tmp_path / "x" / "rank0" / fmt.pass_file_name(0)))
    names = [c["call"] for c in meta["calls"] if ".shared" in c["call"]]
    layers = range(3) if not filter_text else [2]
    assert names == [name for k in layers for name in (f"layers.{k}.shared#0", f"layers.{k}.shared.proj#0")]


class HeadScale(torch.nn.Module):
    """Not a norm: its [T*heads, head_dim] rows are not compared. ``bug``: wrong on decode passes;
    ``decode_only``: called in decode passes only."""

    bug = decode_only = False

    def forward(self, x):
        return x * 1.01 if self.bug and x.shape[0] == HEADS else x


@pytest.mark.parametrize("decode_only", [False, True], ids=["every pass", "decode passes only"])
def test_a_gap_that_holds_a_call_not_compared_names_it(tmp_path, decode_only):
    """An error made in a dumped call that cannot be compared row by row shows as a gap between
    the compared calls around it; the report names that call, not only 'code not dumped', also
    when it runs in decode passes only (the gap's calls are read from the pass it was seen in)."""
    torch.manual_seed(0)
    model = FlatLM().eval()
    model.attns[1].q_scale = HeadScale()  # runs on q_norm's output, [T*heads, head_dim]
    model.attns[1].q_scale.bug = True
    model.attns[1].q_scale.decode_only = decode_only
    ref, dec = flat_generate_and_reference(model, tmp_path, torch.randint(0, V, (12,)), 5)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert any(n["call"] == "attns.1.q_scale#0" for n in verdict["not_comparable"])
    culprits = verdict["noise"]["culprits"]
    assert [c.get("gap_uncompared") for c in culprits] == [["attns.1.q_scale#0"]], verdict["summary"]
    assert "code not dumped or not compared (attns.1.q_scale#0)" in verdict["summary"]


class Split(torch.nn.Module):
    """Not a norm: returns its input as [T*heads, head_dim] rows. ``bug``: wrong on decode passes."""

    bug = False

    def forward(self, q):
        rows = q.reshape(-1, q.shape[-1] // HEADS)
        return rows * 1.01 if self.bug and q.shape[0] == 1 else rows


def test_a_norms_grouped_input_is_not_taken_for_the_same_rows_captured_ungrouped(tmp_path):
    """A hooked module hands the norm its [T*heads, d] output: the same storage, captured first
    ungrouped. The norm's grouped input was stored as an alias of it, read as [T, heads, d] rows
    it does not have, and the norm was named for the error its input already carried."""
    torch.manual_seed(0)
    model = FlatLM().eval()
    for attn in model.attns:
        attn.split = Split()
    model.attns[1].split.bug = True
    ref, dec = flat_generate_and_reference(model, tmp_path, torch.randint(0, V, (12,)), 5)
    code, result = first_divergence_json(ref, dec)
    calls = [c["call"] for c in result["ranks"]["0"]["noise"]["culprits"]]
    assert code == 1 and "attns.1.q_norm#0" not in calls, result["ranks"]["0"]["summary"]
    meta, _ = read_pass(str(dec / "rank0" / "pass-000000.safetensors"))
    q_norm = next(c for c in meta["calls"] if c["call"] == "attns.0.q_norm#0")["tensors"]["attns.0.q_norm#0.in.0"]
    assert "alias" not in q_norm and q_norm["held_as"] == [12 * HEADS, 8]


class BetweenLayersLM(FlatLM):
    """A decode-only error in the model's own code between its layers."""

    def forward(self, ids, positions, caches=None):
        x = self.embed(ids) + self.pos(positions)
        for i, (norm, attn) in enumerate(zip(self.norms, self.attns)):
            x = x + attn(norm(x), None if caches is None else caches[i], positions)
            x = x * 1.01 if i == 0 and len(ids) == 1 else x
        return self.head(x)


def test_a_gap_does_not_name_a_call_whose_output_was_compared(tmp_path):
    """A layer takes its KV cache as a tensor that cannot be compared, but its output is compared:
    it is the gap's last clean call, not a call the gap holds."""
    torch.manual_seed(0)
    model = BetweenLayersLM().eval()
    ref, dec = flat_generate_and_reference(model, tmp_path, torch.randint(0, V, (12,)), 5)
    code, result = first_divergence_json(ref, dec)
    verdict = result["ranks"]["0"]
    assert any(n["call"] == "attns.0#0" for n in verdict["not_comparable"])  # its cache input
    culprits = verdict["noise"]["culprits"]
    assert [(c.get("gap_after"), c.get("gap_uncompared")) for c in culprits] == [("attns.0#0", None)], verdict[
        "summary"
    ]
