"""Command-line mistakes a user makes: each is one line on stderr, exit 2, caught before the work.

And the conveniences around them: a bare `dumpdiff` prints its help on stdout, -o's extension
picks the format, and a report written to a file still says its verdict in a line on stderr.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import dump_pair, dumpdiff, load_model, make_tiny_llama, prompt_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def dumps(model_dir, tmp_path_factory):
    model = load_model(model_dir, torch.float32)
    ref, dec, _ = dump_pair(model, tmp_path_factory.mktemp("dumps"), prompt_ids(12), new_tokens=4)
    return ref, dec


def one_line(result, *needles):
    code, out, err = result
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("dumpdiff: error: "), (code, out, err)
    for needle in needles:
        assert needle in err, err


def test_usage_errors_are_one_line():
    """click's own usage error was four lines (usage, try, blank line, error)."""
    one_line(
        dumpdiff("first-divergence", "--bogus", "a", "b"),
        "No such option '--bogus'",
        "see dumpdiff first-divergence --help",
    )
    one_line(dumpdiff("first-divergence", "a"), "Missing argument 'TEST'")
    one_line(dumpdiff("nope"), "No such command 'nope'", "see dumpdiff --help")
    one_line(dumpdiff("first-divergence", "a", "b", "--atol", "-1"), "--atol", "x>=0")


def test_bare_dumpdiff_prints_its_help_on_stdout():
    code, out, err = dumpdiff()
    assert code == 0 and "Usage: dumpdiff" in out and "first-divergence" in out and err == ""
    code, out, err = dumpdiff("--version")
    assert code == 0 and out.startswith("dumpdiff ")


@pytest.mark.parametrize("command", [("ctl", "get_state"), ("kl",), ("localize",)], ids=["ctl", "kl", "localize"])
@pytest.mark.parametrize("url", ["notaurl", "localhost:30000", "http://127.0.0.1:abc"])
def test_a_server_address_without_a_scheme_or_port_is_named(command, url):
    """It was "internal error ValueError: unknown url type"."""
    one_line(dumpdiff(*command, "--url", url, timeout=60), "not a server address", "http://HOST:PORT")


@pytest.mark.parametrize("name", ["DUMPDIFF_HASH_THREADS", "DUMPDIFF_INDEX_PROCESSES"])
@pytest.mark.parametrize("value", ["abc", "-1"])
def test_a_bad_analyzer_setting_is_named(dumps, name, value):
    """HASH_THREADS=abc was an internal error; INDEX_PROCESSES=abc or -1 was silently ignored."""
    one_line(dumpdiff("index", "--rebuild", dumps[0], env={name: value}), name, "whole number")


def test_output_path_is_checked_before_the_work(dumps, tmp_path):
    """`kl -o` into a missing folder ran the whole check (minutes) and then lost the result."""
    one_line(dumpdiff("first-divergence", *dumps, "-o", tmp_path / "nope" / "r.md"), "no folder")
    one_line(
        dumpdiff("kl", "--url", "http://127.0.0.1:9", "-o", tmp_path / "nope" / "kl.json", timeout=60), "no folder"
    )  # before any connection: the error is the folder, not the server


def test_output_extension_picks_the_format_and_the_verdict_is_said(dumps, tmp_path):
    code, out, err = dumpdiff("first-divergence", *dumps, "-o", tmp_path / "r.json", "--no-progress")
    assert code == 1 and out == ""
    assert json.loads((tmp_path / "r.json").read_text())["divergence"] is True
    assert f"wrote {tmp_path / 'r.json'} (divergence, first at model.layers." in err
    code, out, err = dumpdiff("first-divergence", *dumps, "-o", tmp_path / "r.html", "--no-progress")
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    code, out, err = dumpdiff("first-divergence", *dumps, "-o", tmp_path / "r2.json", "--format", "md", "--no-progress")
    assert (tmp_path / "r2.json").read_text().startswith("## dumpdiff")  # an explicit --format wins


def test_repro_refuses_another_model_and_a_file_for_a_folder(dumps, model_dir, tmp_path):
    """Another model's weights replayed "bit for bit" and blamed the machine's kernels; another
    shape wrote a bundle whose script failed; --out onto a file said "File exists"."""
    ref, dec = dumps
    call = "model.layers.0.mlp.down_proj#0"
    (tmp_path / "afile").write_text("")
    one_line(dumpdiff("repro", ref, dec, "--out", tmp_path / "afile", "--no-progress"), "is a file; give a folder")
    other_weights = make_tiny_llama(tmp_path / "seed1", seed=1)
    one_line(
        dumpdiff(
            "repro", ref, dec, "--out", tmp_path / "r1", "--model", other_weights, "--call", call, "--no-progress"
        ),
        "of their scale away from the dumped ones",
        "give the model the dump was made",
    )
    other_shape = make_tiny_llama(tmp_path / "wide", hidden_size=128)
    one_line(
        dumpdiff("repro", ref, dec, "--out", tmp_path / "r2", "--model", other_shape, "--call", call, "--no-progress"),
        "give the model the dump was made",
    )
    code, out, err = dumpdiff(
        "repro", ref, dec, "--out", tmp_path / "r3", "--model", model_dir, "--call", call, "--no-progress"
    )
    assert code == 0 and "checked bit for bit" in out, err


def test_import_sglang_of_a_file_says_it_is_not_a_folder(tmp_path):
    (tmp_path / "afile").write_text("")
    one_line(dumpdiff("import-sglang", tmp_path / "afile", tmp_path / "out"), "not a directory")


@pytest.mark.parametrize(
    "command",
    ["first-divergence", "report", "index", "ctl", "repro", "import-sglang", "kl", "kl calibrate", "localize"],
)
def test_every_help_page_says_its_exit_status_and_gives_an_example(command):
    code, out, err = dumpdiff(*command.split(), "--help")
    assert code == 0 and out.startswith(f"Usage: dumpdiff {command}"), err
    assert "exit" in out.lower() and "example" in out.lower(), out


def commands_section(help_text: str) -> str:
    return help_text.split("\nCommands:\n", 1)[1]


def test_command_summaries_are_whole_and_name_kl_calibrate():
    """click cut each docstring's first sentence mid-phrase ("Name the first operator whose
    inputs match and whose..."), and nothing at the top level led to `kl calibrate`."""
    code, out, _ = dumpdiff("--help")
    listed = commands_section(out)
    assert code == 0 and "..." not in listed, listed
    assert "`kl calibrate`" in listed.split("\n  kl ", 1)[1].split("\n  localize", 1)[0], listed
    code, out, _ = dumpdiff("kl", "--help")
    assert code == 0 and "..." not in commands_section(out) and "calibrate" in commands_section(out)


def test_repro_help_says_when_the_script_needs_transformers():
    """It said repro.py needs torch and safetensors only; a class that is not a known leaf op is
    rebuilt through the model: the script imports transformers and loads the model directory."""
    code, out, _ = dumpdiff("repro", "--help")
    words = " ".join(out.split())
    assert code == 0 and "needs torch and safetensors only. Any other class" in words, words
    assert "imports transformers and loads that model directory" in words


def test_an_output_extension_that_names_no_format_is_refused(dumps, tmp_path):
    """`-o report.foo` wrote text into report.foo, and `kl -o kl.html` text into kl.html."""
    one_line(
        dumpdiff("first-divergence", *dumps, "-o", tmp_path / "report.foo", "--no-progress"),
        "-o ",
        "report.foo",
        "the extension .foo names no format",
        ".md",
        ".json",
        ".html",
        ".txt",
        "--format",
    )
    one_line(
        dumpdiff("kl", "--url", "http://127.0.0.1:9", "-o", tmp_path / "kl.html", timeout=60),
        "the extension .html names no format",
        ".json",
    )  # before any connection
    assert not list(tmp_path.iterdir())
    code, _, err = dumpdiff(
        "first-divergence", *dumps, "-o", tmp_path / "report.foo", "--format", "md", "--no-progress"
    )
    assert code == 1 and (tmp_path / "report.foo").read_text().startswith("## dumpdiff"), err  # named: written
    code, _, err = dumpdiff("first-divergence", *dumps, "-o", tmp_path / "report", "--no-progress")
    assert code == 1 and (tmp_path / "report").read_text().startswith("dumpdiff first-divergence:"), err


def test_noise_naming_the_reference_itself_is_refused(dumps):
    """`--noise A` with A the reference: every floor was 0 and the report said "floor from a repeat run"."""
    ref, dec = dumps
    one_line(
        dumpdiff("first-divergence", ref, dec, "--noise", ref + "/", "--no-progress"),
        "--noise",
        "is REFERENCE itself",
        "a second, independent dump of the reference run",
    )
    one_line(dumpdiff("report", ref, dec, "--noise", dec, "--no-progress"), "is TEST itself")


def test_json_output_says_its_format_and_version(dumps):
    code, out, err = dumpdiff("first-divergence", *dumps, "--format", "json", "--no-progress")
    result = json.loads(out)
    assert code == 1 and list(result)[:2] == ["format", "version"], err
    assert result["format"] == "dumpdiff-first-divergence" and result["version"] == 1
    assert result["divergence"] is True and "ranks" in result and "a" in result  # the keys before are kept


def test_reports_count_in_the_right_number_and_markdown_escapes_no_parentheses(dumps):
    """The reference (one prefill) was "1 passes"; the markdown said "\\(" for every "("."""
    code, out, _ = dumpdiff("first-divergence", *dumps, "--no-progress")
    assert code == 1 and "; 1 pass, ranks" in out and "1 passes" not in out, out
    code, md, _ = dumpdiff("report", *dumps, "--no-progress")
    assert code == 1 and "1 passes" not in md
    assert "\\(" not in md and "\\)" not in md and "(" in md
    from dumpdiff.analyzer.wording import plural

    assert [plural(1, "pass"), plural(2, "pass"), plural(1, "row", "differ"), plural(3, "row", "differ")] == [
        "1 pass",
        "2 passes",
        "1 row differs",
        "3 rows differ",
    ]
    assert [plural(1, "paired row", "have"), plural(0, "entry"), plural(2, "more call")] == [
        "1 paired row has",
        "0 entries",
        "2 more calls",
    ]


@pytest.mark.parametrize(
    "command",
    ["first-divergence", "report", "index", "ctl", "repro", "import-sglang", "kl", "kl calibrate", "localize"],
)
def test_every_command_takes_the_groups_verbose_after_its_name(command):
    """`dumpdiff first-divergence -v A B` was "No such option: -v": only `dumpdiff -v COMMAND` worked."""
    for verbose in ("-v", "--verbose"):
        code, out, err = dumpdiff(*command.split(), verbose, "--help")
        assert code == 0 and out.startswith(f"Usage: dumpdiff {command}"), err
        assert "-v, --verbose" in out


def test_verbose_after_the_command_logs_as_before_it(model_dir, tmp_path):
    """The progress details -v promises (here: that worker processes index the 39 decode steps)
    are logged wherever -v stands, and only with it."""
    model = load_model(model_dir, torch.float32)
    model.generation_config.eos_token_id = None
    ref, dec, _ = dump_pair(model, tmp_path, prompt_ids(8), new_tokens=40)
    workers = {"DUMPDIFF_INDEX_PROCESSES": "2"}
    said = "dumpdiff: indexing in 2 worker processes"
    for args in (("-v", "index", dec), ("index", dec, "-v"), ("index", "--verbose", dec)):
        code, out, err = dumpdiff(*args, "--rebuild", "--no-progress", env=workers)
        assert code == 0 and said in err, (args, err)
    code, out, err = dumpdiff("index", dec, "--rebuild", "--no-progress", env=workers)
    assert code == 0 and said not in err, err
    code, out, err = dumpdiff("first-divergence", "-v", ref, dec, "--rebuild-index", "--no-progress", env=workers)
    assert code in (0, 1) and said in err, err


def test_verbose_ends_with_its_command_in_a_library_callers_process(model_dir, tmp_path):
    """main() called from someone's code with -v left the "dumpdiff" logger at INFO: their later
    calls logged progress details nobody asked for."""
    import logging

    from dumpdiff.analyzer.cli.main import main

    model = load_model(model_dir, torch.float32)
    ref, _, _ = dump_pair(model, tmp_path, prompt_ids(8), new_tokens=2)
    logger = logging.getLogger("dumpdiff")
    before = logger.level
    for args in (["-v", "index", ref, "--no-progress"], ["index", ref, "-v", "--no-progress"]):
        assert main(args, standalone_mode=False) in (None, 0)
        assert logger.level == before, args
