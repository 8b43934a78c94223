"""Prompts for the KL check: a JSONL file, or seeded synthetic token ids.

A JSONL line is one prompt, any of:

    [1, 2045, 318]                  token ids
    {"input_ids": [1, 2045, 318]}   token ids
    "The capital of France is"      text (tokenized by the server: needs its tokenizer)
    {"text": "..."} / {"prompt": "..."}

Texts are tokenized by the server's own /tokenize (so the ids are exactly what it would
see); a server started with --skip-tokenizer-init has no tokenizer, and texts are refused.
"""

from __future__ import annotations

import json
from typing import Callable, List, Optional

import numpy as np

from ..errors import DumpError


def read_jsonl(path: str) -> list:
    """Each line: a list of ints (ids) or a string (text); returns them in order."""
    return [prompt for _, prompt in read_numbered(path)]


def read_numbered(path: str) -> list:
    """The prompts of a JSONL file as (line number, prompt) pairs: errors found later (an id out
    of the vocabulary) can still name the line."""
    prompts = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise DumpError(f"{path}: cannot read the prompts file ({exc.strerror}); check the path") from None
    with handle:
        try:
            lines = list(handle)
        except UnicodeDecodeError:
            raise DumpError(
                f"{path}: not UTF-8 text; the prompts file is JSONL, one prompt per line, e.g. [1, 2045, 318]"
            ) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise DumpError(
                f"{path}:{number}: not JSON ({exc}); the prompts file is JSONL, one prompt per line, "
                "e.g. [1, 2045, 318]"
            ) from None
        if isinstance(item, dict):
            item = next((item[k] for k in ("input_ids", "text", "prompt") if k in item), None)
        if (
            isinstance(item, list)
            and item
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)
        ):
            prompts.append((number, item))
        elif isinstance(item, str) and item:
            prompts.append((number, item))
        else:
            raise DumpError(
                f"{path}:{number}: a prompt is a non-empty list of token ids, a string, or "
                '{"input_ids": [...]} / {"text": "..."}'
            )
    if not prompts:
        raise DumpError(f"{path}: no prompts")
    return prompts


def check_vocab(prompts: list, vocab_size: int, vocab_from: str) -> None:
    """Refuse a token id the model has no embedding row for: sent, it crashes the server's
    embedding lookup, and the check then only sees a server that stopped answering.
    ``prompts``: (where, prompt) pairs, where as "FILE:LINE"; text prompts are the server's
    tokenizer's to get right."""
    for where, prompt in prompts:
        bad = next((t for t in prompt if t >= vocab_size), None) if isinstance(prompt, list) else None
        if bad is not None:
            raise DumpError(
                f"{where}: token id {bad} is out of the model's vocabulary (vocab size {vocab_size}, from "
                f"{vocab_from}); give ids below {vocab_size}"
            )


def resolve(prompts: list, tokenize: Optional[Callable[[List[str]], List[List[int]]]], source: str) -> List[List[int]]:
    """Turn texts into ids with `tokenize` (None: the server has no tokenizer -> error)."""
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return [list(p) for p in prompts]
    if tokenize is None:
        raise DumpError(
            f"{source} holds text prompts but the server has no tokenizer (--skip-tokenizer-init); "
            "give token ids ([1, 2045, ...] per line) or start the server with its tokenizer"
        )
    ids = iter(tokenize(texts))
    out = [next(ids) if isinstance(p, str) else list(p) for p in prompts]
    empty = [i for i, p in enumerate(out) if not p]
    if empty:
        raise DumpError(f"{source}: prompt {empty[0]} tokenizes to nothing")
    return out


def synthetic(n: int, length: int, vocab_size: int, seed: int = 0, low: int = 3) -> List[List[int]]:
    """n seeded prompts of random ids in [low, vocab_size), lengths 0.5x..1.5x `length`
    (as sglang's KL prompts vary), and every prompt starting with a different token.

    Distinct first tokens matter: prompts sent in one batch that share a first token (a BOS)
    can restore it from the radix cache (cached_tokens = 1), and then the "no cache" helper
    and the reference prefill would not be cache-free.
    """
    if vocab_size - low < n:
        raise DumpError(f"vocab size {vocab_size} is too small for {n} prompts with distinct first tokens")
    rng = np.random.default_rng(seed)
    firsts = rng.choice(np.arange(low, vocab_size), size=n, replace=False)
    prompts = []
    for first in firsts:
        size = max(2, int(round(length * rng.uniform(0.5, 1.5))))
        prompts.append([int(first)] + [int(t) for t in rng.integers(low, vocab_size, size=size - 1)])
    return prompts


def vocab_size_of(model_path: Optional[str]) -> Optional[int]:
    """vocab_size from the model's config.json when the model path is a local folder."""
    import os

    if not model_path:
        return None
    path = os.path.join(model_path, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None
