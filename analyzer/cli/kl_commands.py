"""`dumpdiff kl`, `dumpdiff kl calibrate` and `dumpdiff localize`: the KL consistency check of a
live server, its thresholds, and the jump from a dirty helper to the culprit op.

Registered on the main group by add_kl_commands(main).
"""

from __future__ import annotations

import json
import sys

import click

from ..http import DEFAULT_URL
from .common import emit as _emit
from .common import fail, guarded
from .common import output_format as _output_format

KL_FORMATS = ("text", "md", "json")


def _progress(quiet: bool):
    return (lambda _m: None) if quiet else (lambda m: click.echo(f"dumpdiff: {m}", err=True))


def _helpers(text: str):
    from ..kl.score import HELPERS

    names = [h.strip() for h in text.split(",") if h.strip()]
    bad = [h for h in names if h not in HELPERS]
    if bad or not names:
        raise click.BadParameter(f"{','.join(bad) or text!r}: choose from {','.join(HELPERS)}")
    return names


def prompt_options(func):
    """The options every command that runs the helpers shares."""
    options = [
        click.option(
            "--url",
            default=DEFAULT_URL,
            show_default=True,
            envvar="DUMPDIFF_KL_URL",
            help="The sglang or vLLM server, detected from its API (env DUMPDIFF_KL_URL).",
        ),
        click.option(
            "--prompts",
            "prompts_file",
            default=None,
            type=click.Path(dir_okay=False, path_type=str),
            help="JSONL: per line a list of token ids, or a text (needs the server's tokenizer). "
            "Default: seeded synthetic token ids.",
        ),
        click.option(
            "--max-samples",
            default=32,
            show_default=True,
            type=click.IntRange(1),
            help="Prompts to use (as sglang's KL tests).",
        ),
        click.option(
            "--max-new-tokens",
            default=512,
            show_default=True,
            type=click.IntRange(1),
            help="Tokens generated per prompt (ignore_eos: exactly this many).",
        ),
        click.option(
            "--prompt-len",
            default=256,
            show_default=True,
            type=click.IntRange(2),
            help="Synthetic prompts: mean length (each 0.5x..1.5x).",
        ),
        click.option(
            "--seed",
            default=0,
            show_default=True,
            type=int,
            help="Seed of the synthetic prompts, and sampling_seed where the server honours it.",
        ),
        click.option(
            "--vocab-size",
            default=None,
            type=click.IntRange(4),
            help="The model's vocabulary size: synthetic prompts take ids below it, and --prompts ids at or "
            "above it are refused before anything is sent (default: the model's config.json when "
            "readable; else synthetic ids below 1000 and no check).",
        ),
        click.option(
            "--temperature",
            default=0.0,
            show_default=True,
            type=click.FloatRange(0),
            help="Sampling temperature of every request (0: greedy).",
        ),
        click.option(
            "--helpers",
            "helpers",
            default="match,prefill_cache_hit,decode_cache_hit",
            show_default=True,
            callback=lambda _c, _p, v: _helpers(v),
            help="Comma-separated helpers to run.",
        ),
        click.option(
            "--min-hit-rate",
            default=0.5,
            show_default=True,
            type=click.FloatRange(0, 1),
            help="A cache-hit helper needs cache hits on more than this fraction of prompts.",
        ),
        click.option(
            "--turn-token",
            default=None,
            type=click.IntRange(0),
            help="decode_cache_hit: the token appended to turn 1 (default: the tokenizer's ',' "
            "when the server has one, else each prompt's last token).",
        ),
        click.option(
            "--timeout",
            default=600.0,
            show_default=True,
            type=click.FloatRange(1),
            help="Seconds to wait for one /generate reply.",
        ),
        click.option("-q", "--quiet", is_flag=True, help="No progress on stderr."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _check_kwargs(kw: dict) -> dict:
    keys = (
        "prompts_file",
        "max_samples",
        "max_new_tokens",
        "prompt_len",
        "seed",
        "vocab_size",
        "temperature",
        "helpers",
        "min_hit_rate",
        "turn_token",
        "timeout",
    )
    return {k: kw[k] for k in keys}


@click.group(
    "kl",
    invoke_without_command=True,
    context_settings={"max_content_width": 100},
    short_help="KL check of a live server; `kl calibrate` sets thresholds.",
)
@prompt_options
@click.option(
    "--threshold",
    default=None,
    type=click.FloatRange(0),
    help="avg_kl_div above this is dirty (overrides the thresholds file).",
)
@click.option(
    "--thresholds",
    "thresholds_file",
    default=None,
    type=click.Path(dir_okay=False, path_type=str),
    help="Thresholds per (model, tp) [default: ./dumpdiff-kl-thresholds.json].",
)
@click.option(
    "--format", "fmt", type=click.Choice(KL_FORMATS), default="text", show_default=True, help="Output format."
)
@click.option(
    "-o",
    "--output",
    default=None,
    metavar="FILE",
    help="Write the result to FILE (- for stdout); its extension (.md, .json, .txt; another one is an "
    "error) picks the format unless --format is given.",
)
@click.pass_context
@guarded
def kl_group(ctx, fmt, output, threshold, thresholds_file, quiet, **kw) -> None:
    """Score every generated token twice - as a decode output and as a prefill input - and say
    whether prefill and decode disagree because of batch-variance or a state bug.

    \b
    Three helpers, as sglang's own KL tests (each flushes the cache first):
      match              generate; flush; one prefill of prompt+output (no cache at all)
      prefill_cache_hit  prefill the prompt to warm the radix cache; generate (the prompt
                         must come back from the cache: meta_info.cached_tokens); flush;
                         reference prefill
      decode_cache_hit   turn 1 generates; turn 2 = prompt+output+one token on the warm
                         cache (it must restore turn 1's output); flush; reference prefill
    Per token logr = prefill_lp - decode_lp and k3 = exp(logr) - 1 - logr; a helper's
    avg_kl_div is the mean over prompts of per-prompt means, and it is dirty above the
    threshold. Tokens are aligned by position (the ids sglang reports next to logprobs are
    only checked: it reports id vocab_size-1 as 0).

    \b
    A vLLM server is detected from /v1/models and asked over /v1/completions with
    prompt_logprobs; start it with VLLM_SERVER_DEV_MODE=1 (the cache reset) and
    --enable-prompt-tokens-details (its cached tokens).

    \b
    Prefills from scratch (references, match's decode run, warm-up, turn 1) go in groups that
    fit one chunk of the server's --chunked-prefill-size (from /server_info): a chunked
    prefill reads its earlier chunks back from the KV cache, so it is not cache-free. A
    reference longer than a chunk is chunked anyway; the verdict takes that into account.

    \b
    Verdict (two conditions; match is the no-cache path):
      match dirty, no cache-hit helper clean  batch_invariance: localize it with the dumper
      match clean, a cache-hit helper dirty   state_bug in that cache-restore path
      match dirty, a cache-hit helper clean   no_cache_only: batch-variance near the threshold
      dirty, but match did not run, or        over_threshold: the two cannot be told apart
        match's references were chunked
      none dirty                              pass
      A cache-hit helper that got no cache hits did not test its path, and chunked
      references may hide a cache bug on both sides: either way the check cannot pass
      (inconclusive).

    \b
    Thresholds: --threshold, else the entry for the server's model and tp (from
    /server_info) in --thresholds, else 1e-3 with a note. `dumpdiff kl calibrate` writes
    the entry.

    \b
    Exit status: 0 pass, 1 a helper is over its threshold, 2 trouble (server unreachable,
    misaligned logprobs) or inconclusive (cache hits did not happen, or references were
    chunked and nothing is over the threshold; the table is printed).

    \b
    Example: dumpdiff kl --url http://127.0.0.1:30000 --max-samples 8 --max-new-tokens 128 -o kl.md
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..kl.helpers import check_server
    from ..kl.render import render
    from ..kl.score import exit_status

    fmt = _output_format(fmt, output)
    result = check_server(
        kw.pop("url"), threshold=threshold, thresholds_file=thresholds_file, log=_progress(quiet), **_check_kwargs(kw)
    )
    _emit(render(result, fmt), output, headline=f"verdict {result['verdict']['kind']}")
    code = exit_status(result["verdict"])
    if code == 2:
        fail(f"inconclusive: {result['verdict']['text']}")
    sys.exit(code)


@kl_group.command(
    "calibrate",
    context_settings={"max_content_width": 100},
    short_help="Propose and write the KL threshold for the server's model.",
)
@prompt_options
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    help="Runs of all helpers; synthetic prompts change seed each run (seed, seed+1, ...).",
)
@click.option(
    "--margin",
    default=10.0,
    show_default=True,
    type=click.FloatRange(1),
    help="Proposed threshold = margin x the largest avg_kl_div observed.",
)
@click.option(
    "--floor",
    default=1e-9,
    show_default=True,
    type=click.FloatRange(0),
    help="The proposal when every token was bit-identical (stray-ulp floor).",
)
@click.option(
    "--thresholds",
    "thresholds_file",
    default="dumpdiff-kl-thresholds.json",
    show_default=True,
    type=click.Path(dir_okay=False, path_type=str),
    help="The file to write or update.",
)
@click.option("--dry-run", is_flag=True, help="Propose only; do not write the file.")
@click.option("--force", is_flag=True, help="Write even when a cache-hit helper looks like a state bug.")
@click.option(
    "--format", "fmt", type=click.Choice(KL_FORMATS), default="text", show_default=True, help="Output format."
)
@guarded
def calibrate_cmd(repeats, margin, floor, thresholds_file, dry_run, force, fmt, quiet, **kw) -> None:
    """Propose (and write) the KL threshold for the server's model and tp.

    Runs the helpers --repeats times on a known-good engine and proposes margin x the largest
    avg_kl_div seen (and at least the largest single-token k3 seen); when every token of every
    run was bit-identical it proposes the floor (1e-9), so that one stray ulp does not fail the
    check.
    The entry for the model_path and tp_size of /server_info is written to --thresholds
    (created, or updated in place), with what was observed; commit that file.

    A cache-hit helper that got no cache hits cannot be calibrated. One whose avg_kl_div is
    over 100x match's worst single token is not written: that is the signature of a state
    bug, and calibrating on it would bake the bug into the threshold (--force writes anyway).

    \b
    Exit status: 0 proposed (and written), 1 not written because a cache-hit helper looks
    like a state bug, 2 trouble (server unreachable, no cache hits).

    \b
    Example: dumpdiff kl calibrate --url http://127.0.0.1:30000 --repeats 3 --dry-run
    """
    from ..errors import DumpError
    from ..kl.helpers import check_server, read_local
    from ..kl.score import CACHE_HELPERS, STATE_ON_TOP_FACTOR
    from ..kl.thresholds import load as load_thresholds
    from ..kl.thresholds import propose, update

    url = kw.pop("url")
    log = _progress(quiet)
    options = _check_kwargs(kw)
    load_thresholds(thresholds_file)  # a broken file must stop us before the runs, not after them
    read_local(prompts_file=options["prompts_file"], threshold=float("inf"), vocab_size=options["vocab_size"])
    runs = []
    for r in range(repeats):
        log(f"calibrate: run {r + 1} of {repeats}")
        options["seed"] = kw["seed"] + (r if not kw["prompts_file"] else 0)
        run = check_server(url, threshold=float("inf"), log=log, **options)
        lacking = [n for n, h in run["helpers"].items() if h["status"] in ("no_cache_hit", "empty")]
        if lacking:
            raise DumpError(
                f"run {r + 1}: {', '.join(lacking)} got no cache hits; cannot calibrate a path that was not exercised"
            )
        runs.append(run)
    proposal = propose(runs, margin=margin, floor=floor)
    target = runs[0]["target"]
    # A state bug's signature: the average cache-hit token is far worse than the worst
    # no-cache token. (1e-15: below that, float32 stray ulps averaged over many tokens.)
    seen = proposal["observed_avg_kl_div"]
    base = max(seen.get("match", 0.0), proposal["observed_max_kl"].get("match", 0.0), 1e-15)
    suspicious = [n for n in CACHE_HELPERS if "match" in seen and seen.get(n, 0.0) > STATE_ON_TOP_FACTOR * base]
    written = None
    if not dry_run and (force or not suspicious):
        written = update(
            thresholds_file,
            target,
            proposal,
            {
                "repeats": repeats,
                "margin": margin,
                "floor": floor,
                "prompts": runs[0]["prompts"]["source"],
                "max_samples": kw["max_samples"],
                "max_new_tokens": kw["max_new_tokens"],
            },
        )
    result = {
        "kind": "dumpdiff-kl-calibration",
        "target": target,
        "proposal": proposal,
        "suspicious": suspicious,
        "file": thresholds_file,
        "written_key": written,
        "runs": [
            {
                n: {
                    "avg_kl_div": h["avg_kl_div"],
                    "max_kl": h["max_kl"],
                    "bit_identical": h["bit_identical"],
                    "tokens": h["tokens"],
                }
                for n, h in run["helpers"].items()
            }
            for run in runs
        ],
        "timings": [sum(run["timings"].values()) for run in runs],
    }
    if fmt == "json":
        from ..kl.render import to_json

        click.echo(to_json(result), nl=False)
    else:
        click.echo(_calibration_text(result, fmt == "md"), nl=False)
    sys.exit(1 if suspicious and not force else 0)


def _calibration_text(result: dict, md: bool) -> str:
    from ..kl.render import g

    p, t = result["proposal"], result["target"]
    bullet = "- " if md else "  "
    lines = [
        ("## " if md else "") + f"dumpdiff kl calibrate: proposed kl_div = {g(p['kl_div'])}",
        f"{bullet}model {t['model']}  tp={t['tp']}  {t.get('dtype')}  ({t.get('engine')} {t.get('version') or ''})",
        f"{bullet}rule: {p['rule']}",
        f"{bullet}runs: {len(result['runs'])}; tokens {p['tokens']}, bit-identical {p['bit_identical']}",
        f"{bullet}largest avg_kl_div seen: " + ", ".join(f"{n} {g(v)}" for n, v in p["observed_avg_kl_div"].items()),
        f"{bullet}largest per-token k3 seen: " + ", ".join(f"{n} {g(v)}" for n, v in p["observed_max_kl"].items()),
    ]
    if result["suspicious"]:
        lines.append(
            f"{bullet}WARNING: {', '.join(result['suspicious'])} over 100x dirtier than match's worst token: "
            "a state bug? "
            + ("written anyway (--force)" if result["written_key"] else "not written (--force to write)")
        )
    if result["written_key"]:
        lines.append(f"{bullet}wrote {result['file']}: entry {result['written_key']!r}")
    elif not result["suspicious"]:
        lines.append(f"{bullet}not written (--dry-run)")
    return "\n".join(lines) + "\n"


@click.command(
    "localize",
    context_settings={"max_content_width": 100},
    short_help="Dump a dirty KL helper's worst prompt; name the culprit.",
)
@prompt_options
@click.option(
    "--helper",
    type=click.Choice(["match", "prefill_cache_hit", "decode_cache_hit"]),
    default=None,
    help="Replay this helper (default: the one the verdict points at).",
)
@click.option(
    "--kl-result",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=str),
    help="Take helper and worst prompt from the JSON `dumpdiff kl --format json -o FILE` wrote, instead of "
    "a fresh check.",
)
@click.option("--prompt-ids", default=None, help="Replay these token ids (JSON list) instead of a worst prompt.")
@click.option("--threshold", default=None, type=click.FloatRange(0), help="As for `dumpdiff kl`.")
@click.option(
    "--thresholds",
    "thresholds_file",
    default=None,
    type=click.Path(dir_okay=False, path_type=str),
    help="As for `dumpdiff kl`.",
)
@click.option("--exp-prefix", default=None, help="Dump names <prefix>-dec and <prefix>-ref [default: kl-<time>-<pid>].")
@click.option(
    "--dumper-url",
    default=None,
    help="The dumper's own control endpoint, for a numeric DUMPER_SERVER_PORT (vLLM: "
    "http://127.0.0.1:PORT) [default: --url].",
)
@click.option("--strict-only", is_flag=True, help="Only the bit-level verdict of first-divergence.")
@click.option(
    "--format", "fmt", type=click.Choice(KL_FORMATS), default="text", show_default=True, help="Output format."
)
@click.option(
    "-o",
    "--output",
    default=None,
    metavar="FILE",
    help="Write the result to FILE (- for stdout); its extension (.md, .json, .txt; another one is an "
    "error) picks the format unless --format is given.",
)
@click.pass_context
@guarded
def localize_cmd(
    ctx,
    helper,
    kl_result,
    prompt_ids,
    threshold,
    thresholds_file,
    exp_prefix,
    dumper_url,
    strict_only,
    fmt,
    output,
    quiet,
    **kw,
) -> None:
    """Replay the worst prompt of a dirty KL helper with dumping on and name the culprit op.

    The server must run dumpdiff's dumper with its HTTP control, idle until asked:

    \b
      DUMPER_ENABLE=0 DUMPER_SERVER_PORT=reuse DUMPER_DIR=/tmp/dumper \\
        python -m sglang.launch_server ... (CUDA graphs disabled)

    Runs the KL check (or reads --kl-result), takes the helper the verdict points at (a dirty
    cache-hit helper for a state bug, match for batch-variance) and its worst prompt, and
    replays it: the cache state the helper needs is rebuilt first (warm-up, or turn 1; never
    dumped), the decode run is dumped into DUMPER_DIR/<prefix>-dec, then after a flush the
    reference prefill into DUMPER_DIR/<prefix>-ref. DUMPER_DIR comes from /dumper/get_state
    and must be readable here. first-divergence then names the strict culprit (first bit
    flip: where batch-variance starts) and the noise-aware culprit (where a real error is
    introduced: the state bug). The reading of them follows the dumps' pass modes: extend
    passes read a cached prefix, so a reference with any (prompt+output longer than
    --chunked-prefill-size) is not cache-free, and the reading says so.

    On vLLM (no /dumper route on its server) start it with DUMPER_SERVER_PORT=<port> and
    --enforce-eager, and give --dumper-url http://127.0.0.1:<port>.

    Exit status: 0 no divergence (or nothing to localize), 1 culprit found, 2 trouble.

    \b
    Example: dumpdiff localize --url http://127.0.0.1:30000 --kl-result kl.json -o culprit.md
    """
    from ..kl.localize import localize, to_markdown, to_text
    from ..kl.render import to_json

    fmt = _output_format(fmt, output)
    url = kw.pop("url")
    options = _check_kwargs(kw)
    prompt = None
    if prompt_ids:
        try:
            prompt = json.loads(prompt_ids)
            assert isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        except (ValueError, AssertionError):
            raise click.BadParameter("a JSON list of token ids, e.g. [1, 5, 9]", param_hint="--prompt-ids") from None
    loaded = read_kl_result(kl_result) if kl_result else None
    check_options = {k: v for k, v in options.items() if k not in ("temperature", "seed", "max_new_tokens", "helpers")}
    check_options.update(threshold=threshold, thresholds_file=thresholds_file)
    # With --kl-result, replay as many tokens as that check generated unless told otherwise.
    given = ctx.get_parameter_source("max_new_tokens") != click.core.ParameterSource.DEFAULT
    new_tokens = kw["max_new_tokens"] if given or not loaded else None
    result = localize(
        url,
        helper=helper,
        kl_result=loaded,
        prompt=prompt,
        turn_token=kw["turn_token"],
        exp_prefix=exp_prefix,
        max_new_tokens=new_tokens,
        temperature=kw["temperature"],
        seed=kw["seed"],
        check_options=check_options,
        noise_aware=not strict_only,
        dumper_url=dumper_url,
        log=_progress(quiet),
    )
    text = {"json": lambda r: to_json(r, "dumpdiff-localize"), "md": to_markdown}.get(fmt, to_text)(result)
    _emit(text, output, headline="divergence" if result.get("divergence") else "no divergence")
    sys.exit(1 if result.get("divergence") else 0)


def read_kl_result(path: str) -> dict:
    """The result `dumpdiff kl --format json -o FILE` wrote, checked for what localize reads from
    it (the verdict, the helpers' worst prompts, the settings), so that a wrong file is one line
    naming it, not a JSON decoder's error or a missing key deep in the replay."""
    from ..errors import DumpError

    expected = "give the file `dumpdiff kl --format json -o FILE` wrote"
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
    except ValueError as exc:  # a JSONL prompts file ("Extra data"), a text report, a binary file
        raise DumpError(f"--kl-result {path}: not one JSON document ({exc}); {expected}") from None
    if not isinstance(loaded, dict) or loaded.get("kind") != "dumpdiff-kl":
        kind = loaded.get("kind") or loaded.get("format") if isinstance(loaded, dict) else None
        raise DumpError(
            f"--kl-result {path}: not the JSON of a KL check{f' (it is {kind})' if kind else ''}; {expected}"
        )
    if not all(isinstance(loaded.get(k), dict) for k in ("verdict", "helpers", "settings")):
        raise DumpError(f"--kl-result {path}: a KL check result without its verdict, helpers or settings; {expected}")
    return loaded


def add_kl_commands(main) -> None:
    main.add_command(kl_group)
    main.add_command(localize_cmd)
