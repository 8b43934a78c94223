"""`dumpdiff compare`: two runs of one model in other engines, tensor-parallel sizes or dtypes."""

from __future__ import annotations

import sys

import click

from .common import EXIT_DIFFERENT, EXIT_SAME, emit, guarded, output_format, report_arguments


@click.command("compare", short_help="Judge each op of one run against another run of the same model.")
@report_arguments
@click.option(
    "--map",
    "mapping",
    default=None,
    metavar="FILE",
    help="Mapping rules (JSON, or TOML with [[rule]] tables) for modules the built-in rules do not map.",
)
@click.option("--trust-alignment", is_flag=True, help="Skip the embedding-output check of the alignment proof.")
@click.option("--allow-mismatch", is_flag=True, help="Compare dumps whose model type or layer count differ.")
@click.option("--rebuild-index", is_flag=True, help="Rebuild the parquet indexes even when they are fresh.")
@click.option(
    "--rows",
    "max_rows",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Token row pairs whose values are read (an even sample per row kind beyond this).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars on stderr.")
@guarded
def compare_cmd(
    reference, test, mapping, fmt, output, trust_alignment, allow_mismatch, rebuild_index, max_rows, no_progress
):
    """Judge each op of TEST by the error it adds beyond its precision, against REFERENCE.

    REFERENCE and TEST are dumps of two runs of one model's weights on the same prompts: an
    HF model and an sglang or vLLM port of it, tp=1 and tp=2, float32 and bfloat16. Bit
    identity cannot be asked of them, so each op is judged by how far its output error (against
    the reference, relative to the row, in epsilons of the coarser of the two output types)
    exceeds the error its inputs brought in:

    \b
      jump = output error / max(input error, 1 epsilon)
      named when the jump is over 5x the same op's largest in the other layers (at least 8x;
      30x without such peers; 100 epsilons of a float32 output from bit-identical inputs)
      and the output is at least 8 epsilons off

    Token rows are paired by their token ids from position 0 and the pairing is proved: ids and
    positions equal, and the embedding output bit-identical (same dtype) or, across dtypes,
    the finer run's embedding rounded to the coarser type equal to the coarser one's bits
    (within 2 units in the last place where the embedding scales its lookup, as Gemma's).

    Tensors are paired by name after the mapping rules: built in, an engine's
    fused qkv_proj and gate_up_proj are cut into HF's q/k/v_proj and gate/up_proj
    (by the widths the dump records, else those the other run holds, or 'sizes' in
    a mapping file), its attention core's output is o_proj's input, its norms that
    return (out, residual) give HF's norm input as the residual, and a call's single
    float input (output) pairs with the other's whatever the slot is called. Ranks
    are read together: a tensor every rank holds alike is read from the first, shards
    are laid side by side in rank order, partial sums (a row-parallel output reduced
    after its hook) are summed. A module with no counterpart on the other side stops
    the command with a line naming it: write a mapping file (docs/compare.md); one the
    other run's DUMPER_FILTER left out is skipped, with a warning. Rows where an MoE
    router chose other experts in the two runs are not judged in its block.

    \b
    Exit status:
      0  every op within its precision
      1  an op strays beyond its precision (the report names the first and the one that adds the most)
      2  trouble: bad dumps, an unprovable alignment, unmapped modules (one line on stderr)
    Example: dumpdiff compare /tmp/dumper/hf /tmp/dumper/sglang
             dumpdiff compare f32/ bf16/ --format md -o precision.md
    """
    fmt = output_format(fmt, output)
    from ..report.across import headline, render
    from ..verdict.across import compare

    result = compare(
        reference,
        test,
        mapping=mapping,
        trust_alignment=trust_alignment,
        allow_mismatch=allow_mismatch,
        progress=not no_progress,
        rebuild_index=rebuild_index,
        max_rows=max_rows,
    )
    emit(render(result, fmt), output, headline=headline(result))
    sys.exit(EXIT_DIFFERENT if result["divergence"] else EXIT_SAME)
