"""The dumpdiff command line. Exit codes follow diff(1): 0 no divergence, 1 divergence, 2 trouble.

Results go to stdout, logs and progress bars to stderr. Any trouble is one line on stderr
starting with 'dumpdiff: error:' and exit code 2; set DUMPDIFF_DEBUG=1 for a traceback.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import sys

import click

from ..errors import DumpError, require_torch
from ..http import DEFAULT_URL
from .common import (
    EXIT_DIFFERENT,
    EXIT_SAME,
    FAIL_ON,
    FAIL_ON_STATE_BUG,
    emit,
    fail,
    guarded,
    output_format,
    report_arguments,
)


def _verbose(ctx, param, verbose: bool) -> None:
    """-v/--verbose, before or after the command's name: the analyzer's progress details (INFO of
    the "dumpdiff" logger). A level on that logger, not on the root one, because the command's -v
    is parsed after main() has configured logging; put back when the command ends, so a library
    caller's later calls of main() are not left verbose."""
    if verbose:
        logger = logging.getLogger("dumpdiff")
        ctx.call_on_close(functools.partial(logger.setLevel, logger.level))
        logger.setLevel(logging.INFO)


# The group's options that every command takes too: `dumpdiff first-divergence -v A B` was "No
# such option". Each is a click.Option whose callback does the work (no value reaches a function).
SHARED_OPTIONS = (
    click.Option(
        ["-v", "--verbose"],
        is_flag=True,
        expose_value=False,
        callback=_verbose,
        help="Log progress details to stderr (before or after the command).",
    ),
)


class SharedOptionsGroup(click.Group):
    """A group whose SHARED_OPTIONS every command added to it (and to its subgroups) takes too."""

    def add_command(self, cmd: click.Command, name: str = None) -> None:
        _share_options(cmd)
        super().add_command(cmd, name)


def _share_options(cmd: click.Command) -> None:
    taken = {opt for param in cmd.params for opt in param.opts}
    cmd.params += [copy.copy(option) for option in SHARED_OPTIONS if not taken & set(option.opts)]
    for sub in getattr(cmd, "commands", {}).values():  # kl calibrate
        _share_options(sub)


@click.group(
    cls=SharedOptionsGroup,
    params=list(SHARED_OPTIONS),
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="dumpdiff", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx) -> None:
    """dumpdiff - find the operator that makes prefill and decode disagree.

    \b
    Typical session:
      DUMPER_ENABLE=1 DUMPER_EXP_NAME=ref  <run the reference prefill of prompt+output>
      DUMPER_ENABLE=1 DUMPER_EXP_NAME=dec  <run prefill + decode of the same prompt>
      dumpdiff first-divergence /tmp/dumper/ref /tmp/dumper/dec

    \b
    Exit status (as diff(1)):
      0  no divergence    1  divergence found    2  trouble (bad input, unprovable alignment)
      first-divergence --fail-on state-bug: 1 only for a state bug, 0 for float noise alone

    \b
    Environment:
      DUMPDIFF_INDEX_PROCESSES  worker processes indexing decode steps and, in pieces, large
                                passes (default: CPU count less one, at most 8; 0: none)
      DUMPDIFF_HASH_THREADS     hashing threads per large pass (default: CPU count, at most 8)
      DUMPDIFF_KL_URL           the sglang or vLLM server of `dumpdiff kl`, `localize` and the pytest plugin
      DUMPDIFF_DEBUG=1          a traceback instead of the one-line error, for a bug report
    """
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="dumpdiff: %(message)s")
    if ctx.invoked_subcommand is None:  # a bare `dumpdiff`: the help, on stdout, as asked for
        click.echo(ctx.get_help())


def render(result: dict, fmt: str) -> str:
    from ..report import text as report

    if fmt == "json":
        return report.to_json(result) + "\n"
    if fmt == "md":
        from ..report.markdown import to_markdown

        return to_markdown(result)
    if fmt == "html":
        from ..report.html import to_html

        return to_html(result)
    return report.to_text(result)


# short_help: the line of the top-level list, which click would cut from the docstring mid-phrase
@main.command("first-divergence", short_help="Name the first operator where prefill and decode disagree.")
@report_arguments
@click.option("--rank", type=int, default=None, help="Compare only this rank (default: every rank).")
@click.option("--trust-alignment", is_flag=True, help="Skip the embedding-output check of the alignment proof.")
@click.option("--allow-mismatch", is_flag=True, help="Compare dumps whose model, dtype or tp size differ.")
@click.option("--rebuild-index", is_flag=True, help="Rebuild the parquet indexes even when they are fresh.")
@click.option(
    "--atol",
    type=click.FloatRange(min=0),
    default=None,
    help="Noise-aware rule: absolute tolerance instead of the derived threshold.",
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=None,
    help="Noise-aware rule: relative tolerance instead of the derived threshold.",
)
@click.option(
    "--noise",
    "noise_repeat",
    default=None,
    metavar="REFERENCE2",
    help="A second dump of the reference run: its differences are the noise floor.",
)
@click.option("--strict-only", is_flag=True, help="Only the bit-level verdict; read no tensor bytes but the culprit's.")
@click.option(
    "--fail-on",
    type=click.Choice(FAIL_ON),
    default="divergence",
    show_default=True,
    help="What exits 1: any row that differs, or only a state bug the noise-aware verdict names "
    "(a CI gate that float noise passes; not with --strict-only).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars on stderr.")
@guarded
def first_divergence_cmd(
    reference,
    test,
    fmt,
    output,
    rank,
    trust_alignment,
    allow_mismatch,
    rebuild_index,
    atol,
    rtol,
    noise_repeat,
    strict_only,
    fail_on,
    no_progress,
) -> None:
    """Name the first operator whose inputs match and whose output does not.

    REFERENCE is usually the dump of one prefill of prompt+output; TEST the dump of the prefill
    and decode steps of the same prompt. Token rows are paired by their token ids from
    position 0 (request ids never cross runs); the pairing is proved (ids, positions, and a
    bit-identical embedding output) before any verdict, else the command stops with exit 2
    (also when none of TEST's decode rows has a partner: the reference must hold the tokens
    the decode run generated).

    For each paired row the hooked calls are walked in completion order: the first call whose
    token-aligned inputs are bit-identical and whose output is not is the culprit; calls after
    it whose inputs differ are victims. Prints the module, the rows, the shapes on each side
    (M = token rows in the pass), max abs / ulp / relative error and the victim count.

    \b
    Two verdicts, because engines are rarely batch-invariant:
      strict       where the first bit flips: the batch-variance kernel to fix
      noise-aware  where a real error is introduced: output error far beyond the input error
                   (amplification over a threshold derived from the run, or --atol/--rtol,
                   or the differences of a repeat run given with --noise): the state bug

    The report's kind (JSON "kind"; the headline in words): none, batch-variance (rows differ,
    no error introduced beyond float noise), state-bug (the noise-aware verdict names a call or
    code not dumped), not-judged (--strict-only); over several ranks, the worst.

    \b
    Exit status:
      --fail-on divergence (default, as diff(1)):
        0  no divergence          1  rows differ (batch-variance or state bug)
      --fail-on state-bug (a CI gate; the report is printed whole all the same):
        0  no divergence, or float noise alone (batch-variance)
        1  the noise-aware verdict names an introduced error (a state bug) on some rank
      2  trouble, under either (one line on stderr); so is --fail-on state-bug with
         --strict-only, which makes no noise-aware verdict to judge by
    Example: dumpdiff first-divergence /tmp/dumper/ref /tmp/dumper/dec -o culprit.md
    CI:      dumpdiff first-divergence ref/ dec/ --fail-on state-bug --format json -o verdict.json
    """
    if strict_only and fail_on == FAIL_ON_STATE_BUG:
        raise DumpError(
            "--fail-on state-bug needs the noise-aware verdict, which --strict-only leaves out; drop one of them"
        )
    fmt = output_format(fmt, output)
    _check_noise_repeat(noise_repeat, reference, test)
    from ..dump.readahead import will_need
    from ..index.files import saved_index_files

    will_need(saved_index_files([reference, test]))  # fetched from storage while numpy and pyarrow import
    from ..verdict.diverge import first_divergence

    result = first_divergence(
        reference,
        test,
        trust_alignment=trust_alignment,
        allow_mismatch=allow_mismatch,
        progress=not no_progress,
        rebuild_index=rebuild_index,
        rank=rank,
        atol=atol,
        rtol=rtol,
        noise_repeat=noise_repeat,
        noise_aware=not strict_only,
    )
    # the options that change the verdict or the exit status, so the report's Reproduce command gives the same
    result["options"] = [
        *(["--rank", str(rank)] if rank is not None else []),
        *(["--trust-alignment"] if trust_alignment else []),
        *(["--allow-mismatch"] if allow_mismatch else []),
        *(["--atol", repr(atol)] if atol is not None else []),
        *(["--rtol", repr(rtol)] if rtol is not None else []),
        *(["--noise", noise_repeat] if noise_repeat else []),
        *(["--strict-only"] if strict_only else []),
        *(["--fail-on", fail_on] if fail_on != FAIL_ON[0] else []),
    ]
    emit(render(result, fmt), output, headline=headline(result))
    sys.exit(exit_status(result, fail_on))


def exit_status(result: dict, fail_on: str) -> int:
    """--fail-on divergence: 1 when rows differ. state-bug: 1 only for a state bug (or a rank
    left unjudged, which may hide one: a gate must not pass what it did not look at)."""
    if fail_on == FAIL_ON_STATE_BUG:
        from ..verdict.kinds import NOT_JUDGED, STATE_BUG

        return EXIT_DIFFERENT if result["kind"] in (STATE_BUG, NOT_JUDGED) else EXIT_SAME
    return EXIT_DIFFERENT if result["divergence"] else EXIT_SAME


def _check_noise_repeat(noise_repeat, reference: str, test: str) -> None:
    """--noise naming REFERENCE itself (or TEST) is refused, not warned about: its differences to
    the reference would be all zero (or the divergence itself), so every floor would be zero (or
    hide the culprit), and a report saying "floors from a repeat run" would mislead; a warning
    scrolls past while the report is kept. A byte-identical copy is not refused: an independent,
    deterministic repeat run is byte-identical too, and its zero floors are the truth."""
    if not noise_repeat:
        return
    for path, role in ((reference, "REFERENCE"), (test, "TEST")):
        try:
            same = os.path.samefile(noise_repeat, path)
        except OSError:  # a path that is not there: said by the comparison itself
            continue
        if same:
            raise DumpError(
                f"--noise {noise_repeat} is {role} itself; give a second, independent dump of the "
                "reference run (the same prompt+output prefilled again), or leave --noise out"
            )


def headline(result: dict) -> str:
    """The verdict in a few words: what `-o` says on stderr next to the file it wrote."""
    if not result["divergence"]:
        return "no divergence"
    strict = result.get("culprit") or {}
    from ..report.common import noise_culprit
    from ..verdict.phrases import noise_place_parts

    real = noise_culprit(result)
    words = "divergence" + (f", first at {strict['call']}" if strict.get("call") else "")
    return words + (", error introduced " + "".join(piece for piece, _ in noise_place_parts(real)) if real else "")


def _report_command() -> click.Command:
    """`dumpdiff report A B`: first-divergence with a bug-ticket format (markdown) by default."""
    params = [copy.copy(p) for p in first_divergence_cmd.params]
    for param in params:
        if param.name == "fmt":
            param.default = "md"
    return click.Command(
        "report",
        params=params,
        callback=first_divergence_cmd.callback,
        short_help="The first-divergence report for a ticket (md by default).",
        help="""Write the first-divergence report for a bug ticket.

    The same analysis and exit status as `dumpdiff first-divergence`, in markdown by default
    (`--format html` for a self-contained page with plots, `json` for everything the report
    claims). Example: dumpdiff report ref/ dec/ --format html -o culprit.html""",
    )


main.add_command(_report_command())


@main.command("index", short_help="Build the parquet index of each dump (row fingerprints).")
@click.argument("dumps", nargs=-1, required=True, metavar="DUMP...", type=click.Path(path_type=str))
@click.option("--rebuild", is_flag=True, help="Rebuild even when the index is fresh.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@guarded
def index_cmd(dumps, rebuild, no_progress) -> None:
    """Build the parquet index of each DUMP (one row per tensor row, with its fingerprint).

    The index is written to DUMP/index/ (or ~/.cache/dumpdiff/index/ when DUMP is read-only)
    as tokens, seqs, calls, tensors and rows tables, readable by pandas and duckdb. Later
    commands reuse it while the dump's manifest is unchanged. Every DUMP is checked before
    any is indexed; give both dumps of a comparison to pay the start-up once.

    Each dump is read once, in file order; memory stays bounded: a tensor whose token rows lead
    (nearly all) is streamed 2 MB of rows at a time (a wider row alone) through one buffer per
    hashing thread, the kernel reading 64 MB ahead; any other is read whole (256 MB read ahead
    and 256 MB kept for reuse in this process, 64 MB and 64 MB in each worker process). On a
    host with spare cores, worker processes index the decode steps and hash the large passes in pieces
    (DUMPDIFF_INDEX_PROCESSES sets how many; 0 or 2 if the system is short of memory).

    \b
    Exit status: 0 indexed, 2 trouble (a damaged dump: one line on stderr).
    Example: dumpdiff index /tmp/dumper/ref /tmp/dumper/dec
    """
    from ..dump.load import open_dump, show
    from ..index.store import load_indexes
    from ..wording import plural

    opened = [open_dump(dump) for dump in dumps]
    for index in load_indexes(opened, rebuild=rebuild, progress=not no_progress):
        counts = [
            plural(len(index.cols(table)), what)
            for table, what in (
                ("tokens", "token row"),
                ("calls", "call"),
                ("tensors", "tensor"),
                ("rows", "tensor row"),
            )
        ]
        click.echo(f"{show(index.where)}: {', '.join(counts)}")


@main.command("focus", short_help="Print the DUMPER_* settings of a run that dumps tensors around the culprit.")
@click.argument("reference", type=click.Path(path_type=str))
@click.argument("test", type=click.Path(path_type=str))
@click.option(
    "--env-file", default=None, metavar="FILE", help="Also write the settings to FILE (sourceable by a shell)."
)
@click.option("--trust-alignment", is_flag=True, help="Skip the embedding-output check of the alignment proof.")
@click.option("--no-progress", is_flag=True, help="No progress bars on stderr.")
@guarded
def focus_cmd(reference, test, env_file, trust_alignment, no_progress):
    """From the strict verdict on REFERENCE and TEST (fingerprint dumps, typically), print the
    DUMPER_* settings of a second run of both sides that dumps full tensors only where the
    verdict needs them: the culprit, its parent and the calls just before and after it, those
    ops in every layer, the embedding, and only the positions of the rows that differ. The
    new dumps then give error figures, the noise-aware verdict and repro as full dumps do.

    \b
    Exit status: 0 settings printed, 1 no divergence (nothing to focus on), 2 trouble.
    Example: dumpdiff focus /tmp/dumper/ref /tmp/dumper/dec --env-file focus.env
    """
    from ..report.focus import focus_settings
    from ..report.focus import render as render_focus
    from ..verdict.diverge import first_divergence

    result = first_divergence(
        reference, test, trust_alignment=trust_alignment, progress=not no_progress, noise_aware=False
    )
    if not result["culprit"]:
        click.echo(
            "no divergence: nothing to focus on"
            if not result["divergence"]
            else "rows differ but no call is named (see first-divergence): nothing to focus on",
            err=True,
        )
        sys.exit(1)
    text = render_focus(focus_settings(result), result)
    if env_file:
        try:
            with open(env_file, "w") as handle:
                handle.write(text)
        except OSError as exc:
            raise DumpError(f"--env-file {env_file}: cannot write it ({exc.strerror or exc})") from None
    click.echo(text, nl=False)


def _parse_setting(text: str):
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r}: settings are KEY=VALUE, e.g. enable=true exp_name=dec")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw  # a bare word is a string: exp_name=dec


@main.command("ctl", short_help="Configure, reset or query a running dumper over HTTP.")
@click.argument("method", type=click.Choice(["configure", "reset", "get_state"]))
@click.argument("settings", nargs=-1)
@click.option(
    "--url",
    default=DEFAULT_URL,
    show_default=True,
    help="The server (DUMPER_SERVER_PORT=reuse) or the dumper's own endpoint (numeric DUMPER_SERVER_PORT).",
)
@guarded
def ctl_cmd(method, settings, url) -> None:
    """Control a running dumper: the same calls as `curl -X POST URL/dumper/METHOD -d JSON`.

    \b
    Examples:
      dumpdiff ctl configure enable=true exp_name=dec
      dumpdiff ctl configure enable=false
      dumpdiff ctl get_state
      dumpdiff ctl reset
    Values are JSON when they parse as JSON (true, 3, "x"), else strings. Prints the JSON reply,
    one entry per rank. Exit status: 0 done, 2 trouble (server unreachable, a setting refused).
    """
    from ..http import post_json

    body = dict(_parse_setting(s) for s in settings)
    reply = post_json(url.rstrip("/") + f"/dumper/{method}", body, timeout=120)
    click.echo(json.dumps(reply, indent=2, default=str))


@main.command("repro", short_help="Write the culprit call's inputs and a script replaying it.")
@click.argument("reference", type=click.Path(path_type=str))
@click.argument("test", type=click.Path(path_type=str))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=str),
    help="Folder for the inputs, the weights and repro.py (created if missing).",
)
@click.option(
    "--model",
    "model_path",
    default=None,
    type=click.Path(path_type=str),
    help="HF model dir (AutoModelForCausalLM) the dump was made from: the culprit's parameters come from it.",
)
@click.option(
    "--call", default=None, help="Replay this call (module#index, or a module path) instead of the strict culprit."
)
@click.option("--rank", type=int, default=None, help="Look at this rank only (default: the first rank that diverges).")
@click.option("--trust-alignment", is_flag=True, help="Skip the embedding-output check of the alignment proof.")
@click.option("--allow-mismatch", is_flag=True, help="Compare dumps whose model, dtype or tp size differ.")
@click.option("--no-progress", is_flag=True, help="No progress bars on stderr.")
@guarded
def repro_cmd(reference, test, out_dir, model_path, call, rank, trust_alignment, allow_mismatch, no_progress) -> None:
    """Write the culprit call's inputs at both shapes and a standalone script that replays it.

    \b
    OUT/inputs_a.safetensors   the call's inputs in REFERENCE's pass (the full batch, M=N)
    OUT/inputs_b.safetensors   its inputs in TEST's pass (e.g. a decode step, M=1)
    OUT/outputs_*.safetensors  the outputs the engine dumped, to check the replay against
    OUT/call.json              the call, its rows, shapes and scalar arguments on each side
    OUT/weights.safetensors    the module's parameters, copied from --model
    OUT/repro.py               python OUT/repro.py: replays the op at both shapes (and each
                               reference row alone, M=1), prints max abs / ulp differences,
                               exit 1 when the outputs differ

    Known leaf ops (nn.Linear, nn.Embedding, RMSNorm, LayerNorm, activations, torch SDPA) replay
    standalone: repro.py needs torch and safetensors only. Any other class is rebuilt through
    --model and called: repro.py then also imports transformers and loads that model directory
    (python OUT/repro.py --model PATH where it has moved). Exit 0 when the bundle is complete,
    2 when no replay can be written (the error says what is missing; inputs are kept).

    \b
    Example: dumpdiff repro ref/ dec/ --out /tmp/culprit --model /models/llama && python /tmp/culprit/repro.py
    """
    require_torch("repro")
    from ..report.repro import describe, make_repro

    result = make_repro(
        reference,
        test,
        out_dir,
        model=model_path,
        call=call,
        rank=rank,
        trust_alignment=trust_alignment,
        allow_mismatch=allow_mismatch,
        progress=not no_progress,
    )
    click.echo(describe(result), nl=False)


from .kl_commands import add_kl_commands  # noqa: E402  (dumpdiff kl, kl calibrate, localize)

add_kl_commands(main)

from .compare import compare_cmd  # noqa: E402  (dumpdiff compare)

main.add_command(compare_cmd)


@main.command("import-sglang", short_help="Convert a dump of sglang's built-in dumper for dumpdiff.")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@guarded
def import_sglang_cmd(src, dst) -> None:
    """Convert a dump of sglang's built-in dumper (.pt files) into a dumpdiff dump.

    \b
    SRC  <DUMPER_DIR>/<exp_name> of sglang.srt.debug_utils.dumper (non-intrusive mode 'all')
    DST  a new folder: one pass per (rank, step), engine "sglang-builtin"
    Files are read with torch.load(weights_only=True) only; a file it refuses is skipped and
    counted. Then: dumpdiff first-divergence DST_REF DST_DEC. Exit 0 when written, 2 on trouble.

    \b
    Example: dumpdiff import-sglang /tmp/sglang_dump/ref ref && dumpdiff import-sglang /tmp/sglang_dump/dec dec
    """
    require_torch("import-sglang")
    from ..dump.sglang_import import import_sglang

    result = import_sglang(src, dst)
    click.echo(result.describe(), nl=False)


def entry() -> None:
    """The `dumpdiff` program (console script, ``python -m dumpdiff.analyzer.cli``). The process is ours, so
    glibc may keep freed memory for the next arrays (analyzer/index/memtune.py); ``main`` called from
    someone else's code leaves their process's allocator as it is."""
    from ..index import memtune
    from ..index.settings import hash_threads, index_processes

    memtune.allow()
    try:
        try:
            index_processes()
            hash_threads()
        except DumpError:  # a bad DUMPDIFF_* setting: said by every command, but not by --help or --version
            if not {"-h", "--help", "--version"} & set(sys.argv[1:]) and len(sys.argv) > 1:
                raise
        code = main(standalone_mode=False, prog_name="dumpdiff")
    except DumpError as exc:
        fail(str(exc))
    except click.UsageError as exc:  # click's own is four lines: usage, try, blank, error
        where = exc.ctx.command_path if exc.ctx is not None else "dumpdiff"
        fail(f"{exc.format_message().rstrip('.')} (see {where} --help)")
    except click.ClickException as exc:
        fail(exc.format_message())
    except click.Abort:
        fail("interrupted")
    sys.exit(code if isinstance(code, int) else EXIT_SAME)


if __name__ == "__main__":
    entry()
