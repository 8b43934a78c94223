"""The noise-aware verdict's false alarms on clean runs, and its power on planted decode-only bugs.

    python benchmarks/noise_corpus.py --device cpu --out /tmp/corpus [--quick] [--only clean|planted]
                                      [--dtypes float32,bfloat16] [--keep]
    python benchmarks/noise_corpus.py --out /tmp/corpus --reanalyze [--match ID-PART] [--jobs 2]
                                      # rerun only the analyzer over the kept dumps, rewrite, reprint
    python benchmarks/noise_corpus.py --from /tmp/corpus/results.jsonl  # reprint the tables
    python benchmarks/noise_corpus.py --device cpu --shapes cuda --out DIR  # GPU sizes, CPU kernels

Each run builds a random-weight HF model (or the trained byte-level Llama), generates (the decode
dump) and prefills each prompt+output once (the reference dump), then runs
``python -m dumpdiff.analyzer.cli first-divergence ref dec --format json``. The clean corpus varies
architecture, size, batch (1, or 3 left-padded), prompt length and dtype; a clean run the verdict
calls "state-bug" is a false alarm. The planted corpus puts one decode-only bug
(tests/plants.py) at layer L and checks the verdict names layers.L.self_attn / .mlp.

One JSON line per run in OUT/results.jsonl (rewritten by id, so --only clean then --only planted
fill one file); dumps under OUT/dumps/<id>/{ref,dec}, deleted after analysis unless --keep. The
tables go to stdout, progress to stderr. The trained model is cached under OUT/models (--models).

Measured on 2 busy CPU cores: the full CPU corpus (226 runs) took 13 + 7 minutes with --keep (12 GB
of dumps) plus the trained model's training once; --reanalyze of all 226 took 2 minutes. On an
H100 the 122 runs of size s (--match .s.) took 6 minutes; size m dumps are about 5 GB a run there
(--last-rows keeps them small).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from byte_llama import python_source, train  # noqa: E402
from helpers import dump_padded_batch, load_model, prompt_ids  # noqa: E402
from plants import PLANTS, expected_module, plant  # noqa: E402

CLEAN_ARCHS = ("llama", "qwen3", "gemma2", "qwen3_moe", "mamba", "jamba")  # jamba: attention + mamba + MoE
PLANT_ARCHS = ("llama", "qwen3", "gemma2", "qwen3_moe")  # those with layers[L].self_attn and a KV cache
# (hidden, layers, heads, kv heads): CPU keeps the corpus to minutes on 2 cores, the GPU gets real kernels.
SIZES = {"cpu": {"s": (64, 3, 4, 2), "m": (256, 6, 8, 4)}, "cuda": {"s": (1024, 8, 16, 8), "m": (2048, 16, 16, 8)}}
LENGTHS = {
    "cpu": {"short": (40, 52, 64), "long": (400, 430, 460)},
    "cuda": {"short": (180, 200, 220), "long": (400, 425, 450)},
    "trained": {"short": (60, 100, 140), "long": (150, 180, 200)},
}  # it was trained on 256 positions
NEW_TOKENS = {"cpu": 8, "cuda": 12}
DT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclass
class Spec:
    id: str
    arch: str
    size: str
    dtype: str
    batch: int
    span: str
    seed: int
    plant: Optional[str] = None
    layer: Optional[int] = None


SHAPES = None  # --shapes: the sizes of this kind of device, whatever device runs them


def shapes_of(device: str) -> str:
    """Which sizes, lengths and decode steps a run takes: the device's own, or --shapes."""
    return SHAPES or ("cuda" if device.startswith("cuda") else "cpu")


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the corpus


def plan(device: str, quick: bool, only: Optional[str], dtypes: list) -> list:
    """Every run, with a seed of its own. --quick: size s, a few archs, one plant per kind."""
    kind = shapes_of(device)
    sizes = ("s",) if quick else ("s", "m")
    runs = []
    if only != "planted":
        archs = ("llama", "qwen3_moe", "mamba") if quick else CLEAN_ARCHS
        combos = list(itertools.product(archs, sizes, dtypes, (1, 3), ("short", "long")))
        if quick:  # one batch/length combination per (arch, dtype), taken in turn
            combos = [c for i, c in enumerate(combos) if i % 4 == (i // 4) % 4]
        combos += (
            []
            if quick
            else [("trained", "s", d, b, s) for d, (b, s) in itertools.product(dtypes, ((1, "long"), (3, "short")))]
        )
        for seed, (arch, size, dtype, batch, span) in enumerate(combos):
            runs.append(Spec(f"{arch}.{size}.{DT[dtype]}.b{batch}.{span}", arch, size, dtype, batch, span, seed))
    if only != "clean":
        archs = ("llama",) if quick else PLANT_ARCHS + ("trained",)
        combos = [
            (k, a, s, d)
            for k, a, s, d in itertools.product(PLANTS, archs, sizes, dtypes)
            if not (a == "trained" and s != "s")
        ]
        if quick:
            combos = [c for i, c in enumerate(combos) if c[3] == dtypes[(i // len(dtypes)) % len(dtypes)]]
        shapes = list(itertools.product(("short", "long"), (1, 3)))
        turn = collections.Counter()  # each (size, dtype) cycles through the 4 shapes: none is tied to one
        for i, (plant_kind, arch, size, dtype) in enumerate(combos):
            seed = 1000 + i
            layers = 3 if arch == "trained" else SIZES[kind][size][1]
            span, batch = shapes[turn[size, dtype] % 4]
            turn[size, dtype] += 1
            layer = 1 + seed % (layers - 1)
            runs.append(
                Spec(
                    f"{arch}.{size}.{DT[dtype]}.b{batch}.{span}.{plant_kind}.L{layer}",
                    arch,
                    size,
                    dtype,
                    batch,
                    span,
                    seed,
                    plant_kind,
                    layer,
                )
            )
    return runs


def arch_config(arch: str, size: str, device: str):
    from transformers import AutoConfig

    kind = shapes_of(device)
    hidden, layers, heads, kv = SIZES[kind][size]
    attn = dict(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=hidden * 11 // 4)
    head = dict(head_dim=hidden // heads)
    extra = {
        "llama": attn,
        "qwen3": {**attn, **head},
        "gemma2": {**attn, **head, "sliding_window": 64 if kind == "cpu" else 128},
        "qwen3_moe": {
            **attn,
            **head,
            "moe_intermediate_size": hidden // 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "mamba": dict(state_size=16, expand=2, conv_kernel=4),
        "jamba": {
            **attn,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
    }[arch]
    return AutoConfig.for_model(
        arch,
        vocab_size=2048 if kind == "cpu" else 32000,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=1024,
        **extra,
    )


def build(spec: Spec, args):
    """(model on the device in the run's dtype, prompts as token-id lists)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    kind = shapes_of(args.device)
    lengths = LENGTHS["trained" if spec.arch == "trained" else kind][spec.span]
    lengths = [n + spec.seed % 7 for n in (lengths if spec.batch == 3 else lengths[1:2])]
    if spec.arch == "trained":
        folder = trained_llama(args.models or os.path.join(args.out, "models"), args.device)
        model = load_model(folder, dtype).to(args.device)
        data, pick = python_source(), torch.Generator().manual_seed(spec.seed)
        starts = torch.randint(0, len(data) - 256, (len(lengths),), generator=pick).tolist()
        return model, [data[s : s + n].tolist() for s, n in zip(starts, lengths)]
    torch.manual_seed(spec.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(arch_config(spec.arch, spec.size, args.device))
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # always the full number of new tokens
    vocab = model.config.vocab_size
    return model, [prompt_ids(n, seed=spec.seed * 10 + j, vocab=vocab)[0].tolist() for j, n in enumerate(lengths)]


# ---------------------------------------------------------------- the trained model


def trained_llama(models: str, device: str) -> str:
    """tests/byte_llama.py's model (40 s on two idle CPU cores, 15 minutes on two busy ones), saved
    once under ``models`` (--models, default OUT/models) and reused."""
    folder = os.path.join(models, "trained-llama")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    log(f"training the byte-level Llama into {folder} (minutes on a CPU) ...")
    model, loss = train(python_source(), torch.Generator().manual_seed(1), device)
    log(f"trained: loss {loss:.2f} (uniform bytes would be 5.6)")
    model.cpu().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- one run


def analyze(root: str) -> dict:
    """The analyzer's verdict on root/{ref,dec}, reduced to what the tables need."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dumpdiff.analyzer.cli",
            "first-divergence",
            os.path.join(root, "ref"),
            os.path.join(root, "dec"),
            "--format",
            "json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if proc.returncode not in (0, 1):
        return {"exit": proc.returncode, "kind": None, "error": proc.stderr.strip()[-600:]}
    result = json.loads(proc.stdout)
    verdict = result["ranks"].get("0") or next(iter(result["ranks"].values()))
    noise = verdict.get("noise") or {}
    return {
        "exit": proc.returncode,
        "kind": result.get("kind"),
        "rows_differing": verdict.get("rows_differing"),
        "strict": (result.get("culprit") or {}).get("call"),
        "culprits": [
            {"call": c["call"], **({"gap_before": c["gap_before"]} if c.get("gap_before") else {})}
            for c in noise.get("culprits", [])
        ],
        "top_jumps": noise.get("top_jumps", [])[:4],
        "suspects": noise.get("suspects"),
        "summary": verdict.get("summary"),
        "error": None,
    }


def named(rec: dict) -> Optional[str]:
    """For a planted run: 'right' (a culprit's call or gap_before is in layers.L. and the planted
    module), 'elsewhere' (a state bug named, not there), 'missed', or 'error'."""
    if not rec.get("plant"):
        return None
    if rec.get("exit") not in (0, 1):
        return "error"
    if rec.get("kind") != "state-bug":
        return "missed"
    where = f"layers.{rec['layer']}."
    for c in rec.get("culprits", []):
        for name in (c["call"], c.get("gap_before") or ""):
            if where in name and rec["module"] in name:
                return "right"
    return "elsewhere"


def run_one(spec: Spec, args) -> dict:
    root = os.path.join(args.out, "dumps", spec.id)
    shutil.rmtree(root, ignore_errors=True)
    rec = {**asdict(spec), "device": args.device, "module": spec.plant and expected_module(spec.plant)}
    start = time.time()
    try:
        model, prompts = build(spec, args)
        rec.update(layers=model.config.num_hidden_layers, prompt_lens=[len(p) for p in prompts])
        hooks = plant(model, spec.plant, spec.layer) if spec.plant else []
        new_tokens = NEW_TOKENS[shapes_of(args.device)]
        dump_padded_batch(
            model,
            root,
            prompts=prompts,
            new_tokens=new_tokens,
            config={"cleanup_previous": True, "last_rows": args.last_rows},
        )
        for hook in hooks:
            hook.remove()
        del model
        rec["dump_s"] = round(time.time() - start, 1)
        rec.update(analyze(root))
    except Exception as exc:  # one broken run is a row of the table, not the end of the corpus
        rec.update(exit=-1, kind=None, error=f"{type(exc).__name__}: {exc}"[:600])
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    rec["named"], rec["seconds"] = named(rec), round(time.time() - start, 1)
    return rec


# ---------------------------------------------------------------- results


def read_results(path: str) -> list:
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # a run killed while writing its record: it runs again
    by_id = {}  # a run recorded twice (merged folders): its last record
    for line in lines:
        record = json.loads(line)
        by_id.pop(record["id"], None)
        by_id[record["id"]] = record
    return list(by_id.values())


def write_results(path: str, records: list):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def reanalyze(args) -> list:
    """Rerun only the analyzer over the kept dumps; the runs without dumps keep their old verdict."""
    path = os.path.join(args.out, "results.jsonl")
    records = read_results(path)

    def again(rec):
        root = os.path.join(args.out, "dumps", rec["id"])
        if args.match not in rec["id"] or not os.path.isdir(os.path.join(root, "dec")):
            return rec
        start = time.time()
        rec = {**rec, **analyze(root)}
        rec["named"] = named(rec)
        log(f"{rec['id']}: {rec['kind']} {rec['named'] or ''} ({time.time() - start:.1f} s)")
        return rec

    with ThreadPoolExecutor(args.jobs) as pool:
        records = list(pool.map(again, records))
    write_results(path, records)
    return records


def pct(n: int, total: int) -> str:
    return f"{100 * n / total:5.1f}%" if total else "    -"


def jump_text(rec: dict) -> str:
    jumps = rec.get("top_jumps") or []
    if not jumps:
        return "-"
    j = jumps[0]
    line = f" (line {j['line']:.3g}x)" if j.get("line") is not None else ""
    return f"{j['call']} {j['amplification']:.3g}x{line}"


def culprit_text(rec: dict) -> str:
    return (
        ", ".join(
            c["call"] + (f" before {c['gap_before']}" if c.get("gap_before") else "") for c in rec.get("culprits") or []
        )
        or "-"
    )


def print_tables(records: list):
    clean = [r for r in records if not r.get("plant")]
    print(f"CLEAN RUNS ({len(clean)})")
    print(f"{'device':8} {'dtype':9} {'runs':>5} {'none':>5} {'b-var':>6} {'state-bug':>10} {'error':>6}")
    groups = collections.defaultdict(list)
    for r in clean:
        groups[(r["device"], r["dtype"])].append(r)
    for (device, dtype), rs in sorted(groups.items()):
        kinds = collections.Counter(r.get("kind") or "error" for r in rs)
        print(
            f"{device:8} {dtype:9} {len(rs):5} {kinds['none']:5} {kinds['batch-variance']:6} {kinds['state-bug']:10} "
            f"{kinds['error'] + kinds['not-judged']:6}"
        )
    false = [r for r in clean if r.get("kind") == "state-bug"]
    print(f"false state bugs: {len(false)} of {len(clean)}")
    for r in false:
        print(f"  {r['id']} ({r['device']}): named {culprit_text(r)}; top jump {jump_text(r)}")
    worst = max(
        (r for r in clean if r.get("top_jumps")),
        default=None,
        key=lambda r: r["top_jumps"][0]["amplification"] / (r["top_jumps"][0].get("line") or math.inf),
    )
    if worst:
        print(f"closest clean run to its line: {worst['id']}: {jump_text(worst)}")
    for r in clean:
        if r.get("kind") is None:
            print(f"  error {r['id']}: {r.get('error')}")

    planted = [r for r in records if r.get("plant")]
    print(f"\nPLANTED RUNS ({len(planted)}): named at the right place / elsewhere / missed")
    print(
        f"{'plant':12} {'dtype':9} {'device':7} {'runs':>5} {'right':>7} {'elsewhere':>10} {'missed':>7} {'error':>6}"
    )
    groups = collections.defaultdict(list)
    for r in planted:
        groups[(r["plant"], r["dtype"], r["device"])].append(r)
    order = {p: i for i, p in enumerate(PLANTS)}
    for (kind, dtype, device), rs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1:])):
        got = collections.Counter(named(r) for r in rs)
        print(
            f"{kind:12} {dtype:9} {device:7} {len(rs):5} {pct(got['right'], len(rs)):>7} "
            f"{pct(got['elsewhere'], len(rs)):>10} {pct(got['missed'], len(rs)):>7} {got['error']:6}"
        )
    for r in planted:
        verdict = named(r)
        if verdict == "elsewhere":
            print(f"  elsewhere {r['id']}: named {culprit_text(r)}")
        elif verdict == "missed":
            print(f"  missed {r['id']}: {r.get('kind')}; top jump {jump_text(r)}")
        elif verdict == "error":
            print(f"  error {r['id']}: {r.get('error')}")


@contextlib.contextmanager
def size_m_slot(slots: str):
    """Hold one of N lock files under DIR ("DIR:N") for the run; "" holds nothing."""
    if not slots:
        yield
        return
    folder, count = slots.rsplit(":", 1)
    os.makedirs(folder, exist_ok=True)
    while True:
        for k in range(int(count)):
            with open(os.path.join(folder, f"slot{k}"), "w") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                yield
                return
        time.sleep(2)


# ---------------------------------------------------------------- command line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--out", help="results folder: OUT/results.jsonl, OUT/dumps/<id>/, OUT/models/")
    ap.add_argument("--quick", action="store_true", help="a handful of runs, to check the set-up")
    ap.add_argument("--only", choices=["clean", "planted"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--keep", action="store_true", help="keep the dumps (for --reanalyze)")
    ap.add_argument("--last-rows", type=int, default=0, help="DUMPER_LAST_ROWS for both dumps (0: every row)")
    ap.add_argument("--models", help="where the trained model is cached (default OUT/models)")
    ap.add_argument("--match", default="", help="only the runs whose id contains this")
    ap.add_argument("--from", dest="from_file", help="only reprint the tables of this results.jsonl")
    ap.add_argument("--reanalyze", action="store_true", help="rerun the analyzer over OUT/dumps and reprint")
    ap.add_argument(
        "--shapes",
        choices=["cpu", "cuda"],
        help="run the sizes of this kind of device (default: the device's): --device cpu --shapes cuda "
        "puts the GPU-sized models through CPU kernels",
    )
    ap.add_argument("--jobs", type=int, default=2, help="analyzer processes at once for --reanalyze")
    ap.add_argument("--resume", action="store_true", help="keep OUT/results.jsonl's runs and skip them")
    ap.add_argument(
        "--size-m-slots",
        default="",
        help="DIR:N: at most N runs of size m at once among every process given the same DIR "
        "(parallel slices on one disk: a size m run's dumps take several GB)",
    )
    args = ap.parse_args(argv)
    global SHAPES
    SHAPES = args.shapes
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no progress bars nor kernel fall-back notes in the log
    hf_logging.disable_progress_bar()
    if args.from_file:
        return print_tables(read_results(args.from_file))
    if not args.out:
        ap.error("--out is required")
    if args.reanalyze:
        return print_tables(reanalyze(args))
    dtypes = args.dtypes.split(",")
    runs = [s for s in plan(args.device, args.quick, args.only, dtypes) if args.match in s.id]
    path = os.path.join(args.out, "results.jsonl")
    os.makedirs(args.out, exist_ok=True)
    ids = {s.id for s in runs}
    earlier = read_results(path) if os.path.exists(path) else []
    records = [r for r in earlier if r["id"] not in ids or args.resume]
    if args.resume:  # a call cut short by a time limit goes on where it stopped
        done = {r["id"] for r in earlier}
        runs = [s for s in runs if s.id not in done]
    write_results(path, records)
    start = time.time()
    log(f"{len(runs)} runs on {args.device} -> {path}")
    for i, spec in enumerate(runs, 1):
        with size_m_slot(args.size_m_slots if spec.size == "m" else ""):
            rec = run_one(spec, args)
        records.append(rec)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(
            f"[{i}/{len(runs)}] {spec.id}: {rec.get('kind') or 'error ' + str(rec.get('error'))[:200]}"
            f"{' ' + rec['named'] if rec['named'] else ''} ({rec['seconds']} s)"
        )
    log(f"corpus done in {time.time() - start:.0f} s")
    print_tables(records)


if __name__ == "__main__":
    main()
