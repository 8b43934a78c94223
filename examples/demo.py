"""The whole dumpdiff job on a built-in tiny model, on CPU, with no downloads.

1. make a tiny random Llama (float32) locally;
2. dump run B: a prefill of the prompt followed by decode steps (model.generate);
3. dump run A: the reference, one prefill of prompt + generated output;
4. run `dumpdiff first-divergence A B` and print its report.

On CPU, float32 prefill and decode really differ (a GEMM over 1 row vs over many rows), so the
report shows a real culprit without any planted bug.

    python examples/demo.py [--out demo-out] [--layers 4] [--prompt-len 24] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dumpdiff import dumper  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    model_dir = make_tiny_llama(os.path.join(args.out, "tiny-llama"), num_hidden_layers=args.layers)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    dump_root = os.path.join(args.out, "dumps")

    # One handle, two experiments: configure() switches where the next passes go.
    handle = dumper.install(model, dumper.DumperConfig(dir=dump_root, cleanup_previous=True))
    with torch.no_grad():
        handle.configure(enable=True, exp_name="decode")
        output = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        handle.configure(exp_name="prefill")
        model(output)  # the reference: one prefill of prompt + output
    handle.remove()
    print(
        f"dumped {dump_root}/decode (prefill + {args.new_tokens - 1} decode steps) and {dump_root}/prefill",
        file=sys.stderr,
    )

    command = ["dumpdiff", "first-divergence", os.path.join(dump_root, "prefill"), os.path.join(dump_root, "decode")]
    print("$ " + " ".join(command), file=sys.stderr)
    cli = [sys.executable, "-m", "dumpdiff.analyzer.cli"] + command[1:]
    code = subprocess.call(cli)
    # diff(1) convention: 1 means "divergence found", which is what the demo shows.
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main())
