"""What every dumpdiff command shares: exit codes, one-line failures, where results are written.

A failure is one line on stderr starting with 'dumpdiff: error:' and exit code 2, never a
traceback (DUMPDIFF_DEBUG=1 shows one); a result is written whole or not at all.
"""

from __future__ import annotations

import functools
import os
import sys

import click

from ..errors import DumpError
from ..wording import escape_controls

EXIT_SAME, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2
FORMATS = ("text", "md", "json", "html")
FAIL_ON_STATE_BUG = "state-bug"
FAIL_ON = ("divergence", FAIL_ON_STATE_BUG)  # what first-divergence exits 1 for


def report_arguments(func):
    """REFERENCE and TEST, --format and -o: the arguments of a command that compares two dumps
    and writes a report (first-divergence, compare)."""
    for decorator in reversed(
        (
            click.argument("reference", type=click.Path(path_type=str)),
            click.argument("test", type=click.Path(path_type=str)),
            click.option(
                "--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True, help="Output format."
            ),
            click.option(
                "-o",
                "--output",
                default=None,
                metavar="FILE",
                help="Write the report to FILE (written whole or not at all; - for stdout); its extension "
                "(.md, .json, .html, .txt; another one is an error) picks the format unless --format is given.",
            ),
        )
    ):
        func = decorator(func)
    return func


def guarded(func):
    """Turn every failure into one line and exit code 2: no traceback, no partial result."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except DumpError as exc:
            fail(str(exc))
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            fail("interrupted")
        except OSError as exc:
            if os.environ.get("DUMPDIFF_DEBUG"):
                raise
            fail(f"{exc.strerror or exc} ({exc.filename or 'i/o'}); check the path, permissions and free disk space")
        except Exception as exc:  # noqa: BLE001 - the promise is one line, exit 2
            if os.environ.get("DUMPDIFF_DEBUG"):
                raise
            if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
                fail(
                    "this needs torch, which is not installed here (a dump with MoE routers, a fingerprint dump "
                    "against a full one); install it (pip install torch: the CPU build is enough)"
                )
            fail(f"internal error {type(exc).__name__}: {exc} (rerun with DUMPDIFF_DEBUG=1 and report it)")

    return wrapper


def fail(message: str) -> None:
    click.echo(f"dumpdiff: error: {escape_controls(message)}", err=True)
    sys.exit(EXIT_TROUBLE)


EXTENSION_FORMATS = {".md": "md", ".markdown": "md", ".json": "json", ".html": "html", ".htm": "html", ".txt": "text"}


def output_format(fmt: str, output: str = None) -> str:
    """The --format to write, after checking -o before any work (a long `kl` run must not end in
    "cannot write"): the one given, else the one -o's extension names (r.html is html; r.foo is
    an error), else the default."""
    if output is None or output == "-":
        return fmt
    _writable_target(output)
    ctx = click.get_current_context()
    if ctx.get_parameter_source("fmt") != click.core.ParameterSource.DEFAULT:
        return fmt  # asked for by name: written whatever the file is called
    choices = next((p.type.choices for p in ctx.command.params if p.name == "fmt"), ())
    extension = os.path.splitext(output)[1].lower()
    if not extension:
        return fmt  # no extension claims a format: the command's own
    named = EXTENSION_FORMATS.get(extension)
    if named not in choices:  # writing another format than the name says would mislead whoever opens it
        known = ", ".join(e for e, f in EXTENSION_FORMATS.items() if f in choices)
        raise DumpError(
            f"-o {output}: the extension {extension} names no format of this command; use one of "
            f"{known}, or give --format"
        )
    return named


def _writable_target(output: str) -> str:
    """The file -o writes (a link: its file); DumpError when it is not a regular file or its
    folder cannot take it."""
    target = os.path.realpath(output) if os.path.islink(output) else output
    if not target or (os.path.exists(target) and not os.path.isfile(target)):
        raise DumpError(f"-o {output!r}: not a regular file to write; give a file path (or - for stdout)")
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise DumpError(f"-o {output}: no folder {folder}; create it first or give another path")
    if not os.access(folder, os.W_OK):
        raise DumpError(f"-o {output}: the folder {folder} is not writable; give another path")
    return target


def emit(text: str, output: str = None, headline: str = None) -> None:
    """Write the whole result at once (to a temp file then rename): never a partial file. Only a
    regular file (or a new one) is replaced: renaming over a device or a named pipe would turn
    it into a file. ``headline``: the verdict in a line, said on stderr when the result goes to a file."""
    if output is None or output == "-":
        click.echo(text, nl=False)
        return
    shown = output
    output = _writable_target(output)
    tmp = f"{output}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, output)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise DumpError(
            f"-o {shown}: cannot write it ({exc.strerror or exc}); check the folder exists and is writable"
        ) from None
    click.echo(f"dumpdiff: wrote {shown}" + (f" ({headline})" if headline else ""), err=True)
