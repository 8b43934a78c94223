"""Shared test helpers: real tiny HF models, real dumps, the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from dumpdiff import dumper  # noqa: E402
from tiny_models import make_tiny_llama, make_tiny_qwen3_moe  # noqa: E402,F401


def load_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def prompt_ids(length: int, seed: int = 0, vocab: int = 1024) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def dump_pair(model, root, prompt, new_tokens: int = 6, setup=None, **config):
    """Dump 'dec' (generate: prefill + decode) and 'ref' (one prefill of prompt+output)."""
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), cleanup_previous=True, **config))
    try:
        with torch.no_grad():
            handle.configure(enable=True, exp_name="dec")
            output = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
            handle.configure(exp_name="ref")
            model(output)
    finally:
        handle.remove()
    return os.path.join(root, "ref"), os.path.join(root, "dec"), output


def left_padded(prompts):
    """(ids, attention mask) of token-id lists left-padded with id 0 to one width."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    return ids, mask


def dump_padded_batch(
    model, root, lengths=(5, 9, 13), new_tokens: int = 5, prompts=None, config: Optional[dict] = None, **generate_kwargs
):
    """Dump 'dec' (one left-padded batch of prompts of these lengths, or these token-id lists;
    pad id 0, generated together) and 'ref' (each prompt+output alone, unpadded), on the model's
    device; ``config``: more DumperConfig settings. Returns (prompts, ref, dec)."""
    prompts = prompts or [prompt_ids(n, seed=n)[0].tolist() for n in lengths]
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_padded(prompts))
    width = ids.shape[1]
    handle = dumper.install(model, dumper.DumperConfig(dir=str(root), enable=True, exp_name="dec", **(config or {})))
    try:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **generate_kwargs
            )
            handle.configure(exp_name="ref")
            for prompt, row in zip(prompts, out):
                model(torch.tensor([prompt + row[width:].tolist()], device=device))
    finally:
        handle.remove()
    return prompts, os.path.join(root, "ref"), os.path.join(root, "dec")


def dumpdiff(*args, env: Optional[dict] = None, timeout: int = 300, process: bool = False):
    """Run the `dumpdiff` program with these arguments; returns (exit code, stdout, stderr).

    In this process by default (click's test runner: the program's own entry point, its exit
    code, stdout and stderr apart, its warnings included), which spares each call the start of a
    Python. ``process``: in a process of its own, for what only a real process shows (start-up
    imports, signals, a timeout)."""
    if process:
        proc = subprocess.run(
            [sys.executable, "-m", "dumpdiff.analyzer.cli", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            timeout=timeout,
        )
        return proc.returncode, proc.stdout, proc.stderr
    return _in_process([str(a) for a in args], env)


def _in_process(args, env):
    import logging

    from click.testing import CliRunner

    from dumpdiff.analyzer.cli.main import entry

    logger = logging.getLogger("dumpdiff")
    saved = sys.argv, os.getcwd(), logger.handlers[:], logger.propagate, logger.level
    with CliRunner().isolation(env=env) as (out, err, _):
        handler = logging.StreamHandler(sys.stderr)  # the program's log lines, as its own basicConfig writes them
        handler.setFormatter(logging.Formatter("dumpdiff: %(message)s"))
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logger.level or logging.WARNING)
        sys.argv = ["dumpdiff", *args]
        os.chdir(ROOT)
        try:
            entry()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.argv = saved[0]
            os.chdir(saved[1])
            logger.handlers, logger.propagate = saved[2], saved[3]
            logger.setLevel(saved[4])
        return code, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")


def report_json(command: str, a, b, *extra):
    """The JSON report of `dumpdiff COMMAND A B`, checked against its published schema (every key
    declared, each type right)."""
    code, out, err = dumpdiff(command, a, b, "--format", "json", "--no-progress", *extra)
    assert code in (0, 1), f"exit {code}: {err}"
    result = json.loads(out)
    check_schema(result, command)
    return code, result


def first_divergence_json(a, b, *extra):
    return report_json("first-divergence", a, b, *extra)


def assert_every_row_aligned(verdict: dict, rows_b: int):
    """A server workflow's rank verdict: all ``rows_b`` token rows of the run under test paired by
    token ids and positions, none unkeyed, and the embedding output proved bit-identical."""
    align = verdict["alignment"]
    assert align["unaligned_b"] == 0 and align["unkeyed_b"] == 0
    assert align["rows_b"] == rows_b
    assert "bit-identical" in align["proof"][1]


_VALIDATORS: dict = {}


def check_schema(document, name: str):
    """Validate ``document`` against docs/schemas/<name>.schema.json; the first error, if any, fails."""
    import jsonschema

    if name not in _VALIDATORS:
        with open(os.path.join(ROOT, "docs", "schemas", f"{name}.schema.json")) as handle:
            _VALIDATORS[name] = jsonschema.Draft202012Validator(json.load(handle))
    error = jsonschema.exceptions.best_match(_VALIDATORS[name].iter_errors(document))
    assert error is None, f"{name} schema: at {'/'.join(map(str, error.absolute_path))}: {error.message[:300]}"
