"""Bug-ticket reports: Markdown and HTML rendered from real dumps of a tiny random Llama.

The HTML page is opened in a real headless Chromium (marked `browser`): a screenshot must show
something, and the DOM Chromium builds must name the culprit module.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from dumpdiff.analyzer.report.html import to_html
from dumpdiff.analyzer.report.markdown import to_markdown
from helpers import dump_pair, dumpdiff, load_model, make_tiny_llama, prompt_ids


def decode_bug(module, args, output):
    """A planted decode-only bug (one token row in the pass), so a divergence is certain on any
    CPU: whether float32 GEMMs are batch-invariant depends on the CPU and its BLAS."""
    return output + 1e-3 if output.shape[-2] == 1 else output


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Dumps of prefill + decode steps and of the reference prefill of prompt + output."""
    out = tmp_path_factory.mktemp("reports")
    model = load_model(make_tiny_llama(out / "tiny-llama"))
    model.model.layers[1].mlp.down_proj.register_forward_hook(decode_bug)
    ref, dec, _ = dump_pair(model, out / "dumps", prompt_ids(12), new_tokens=4)
    return Path(ref), Path(dec)


@pytest.fixture(scope="module")
def reports(dumps, tmp_path_factory):
    """The JSON, Markdown and HTML reports of the same dumps, each written by the real CLI."""
    out = tmp_path_factory.mktemp("out")
    texts = {}
    for fmt in ("json", "md", "html"):
        target = out / f"report.{fmt}"
        code, _, err = dumpdiff("first-divergence", *dumps, "--format", fmt, "-o", target, "--no-progress")
        assert code == 1, f"--format {fmt}: exit {code}, stderr: {err}"
        texts[fmt] = target.read_text(encoding="utf-8")
    texts["html_path"] = out / "report.html"
    return texts


def test_markdown_names_culprit_and_reproduce_command(reports, dumps):
    result, md = json.loads(reports["json"]), reports["md"]
    culprit = result["culprit"]
    assert result["divergence"] and culprit
    assert f"`{culprit['module']}`" in md and f"`{culprit['call']}`" in md
    assert f"dumpdiff first-divergence {dumps[0]} {dumps[1]}" in md
    assert "- [x] " in md and "### Environment" in md and "### Reproduce" in md


def test_json_holds_what_markdown_claims(reports):
    from dumpdiff.analyzer.wording import fmt_num

    result, md = json.loads(reports["json"]), reports["md"]
    verdict = result["ranks"]["0"]
    culprit = verdict["culprit"]
    assert culprit == result["culprit"]
    assert f"{culprit['n_rows']} of {verdict['rows_compared']} compared rows" in md
    for row in culprit["rows"]:
        assert f"`{row['seq']}@{row['pos']}` ({row['kind']})" in md
    for figure in ("max_abs", "max_ulp", "rel"):
        assert f"**{fmt_num(culprit[figure])}**" in md
    assert f"**{culprit['elements_differ']} of {culprit['elements']}**" in md
    assert f"**M={culprit['shapes']['a']['M']}**" in md and f"**M={culprit['shapes']['b']['M']}**" in md
    assert f"{culprit['victims']} later calls differ" in md
    for group in verdict["groups"]:
        assert f"| {group['rows']} | `{group['call']}` |" in md
    # The timeline the HTML plots: computed from fingerprints, consistent with the verdict.
    timeline = {c["call"]: c for c in verdict["calls_timeline"]}
    assert timeline[culprit["call"]]["rows_origin"] >= culprit["n_rows"]
    assert timeline[culprit["call"]]["rows_in_differ"] == 0
    assert max(c["rows_out_differ"] for c in timeline.values()) <= verdict["rows_differing"]


def test_markdown_and_html_show_the_noise_aware_verdict(reports):
    """The planted decode-only bug is named by the noise-aware verdict; both ticket formats show
    it with its input / output error and amplification, the rule applied and the summary."""
    from dumpdiff.analyzer.report import common as rc
    from dumpdiff.analyzer.report.markdown import text
    from dumpdiff.analyzer.report.svg import esc
    from dumpdiff.analyzer.wording import fmt_num

    result, md, page = json.loads(reports["json"]), reports["md"], reports["html"]
    verdict = result["ranks"]["0"]
    noise = verdict["noise"]
    assert [c["call"] for c in noise["culprits"]] == ["model.layers.1.mlp.down_proj#0"]
    assert "### Noise-aware verdict" in md and "<h2>Noise-aware verdict</h2>" in page
    assert f"- **Rule:** {text(rc.noise_rule(noise))}" in md and f"<dd>{esc(rc.noise_rule(noise))}</dd>" in page
    assert f"derived from {noise['rule']['samples']} call errors of this run" in rc.noise_rule(noise)
    for c in noise["culprits"]:
        cells = [
            f"`{c['call']}`",
            f"`{c['cls']}`",
            f"{c['rows']} ({c['rows']} decode)",
            text(fmt_num(c["in_err"])),
            text(fmt_num(c["out_err"])),
            f"≥ {text(fmt_num(c['amplification']))}x",
        ]
        assert "| " + " | ".join(cells) + " |" in md
        html_cells = [
            f"<code>{c['call']}</code>",
            f"<code>{c['cls']}</code>",
            f"{c['rows']} ({c['rows']} decode)",
            esc(fmt_num(c["in_err"])),
            esc(fmt_num(c["out_err"])),
            f"&ge; {esc(fmt_num(c['amplification']))}x",
        ]
        assert "<td>" + "</td><td>".join(html_cells) + "</td>" in page
        for row in c["sample_rows"]:
            assert f"`{row['seq']}@{row['pos']}`" in md and f"<code>{row['seq']}@{row['pos']}</code>" in page
    jump = noise["top_jumps"][0]
    assert f"`{jump['call']}` {text(fmt_num(jump['amplification']))}x" in md
    assert "state or cache bug" in verdict["summary"]
    assert f"**Summary:** {text(verdict['summary'])}" in md and f"<b>Summary:</b> {esc(verdict['summary'])}" in page


def test_noise_and_routing_sections_escape_and_say_the_rule():
    module = "model.<root>_a#1|b`c"
    md, page = to_markdown(crafted_result(module)), to_html(crafted_result(module))
    assert "| ``model.<root>_a#1\\|b`c#0`` | `<Cls>` | 1 (1 \\<kind\\>) |" in md  # noise table: code spans, | escaped
    assert "- **Rule:** tolerance atol=1e-05, rtol=n/a" in md and "noise floor from a repeat run" in md
    assert "*(1 of 2 rows examined" not in md and "- **Rows:** 1 of 2 rows examined" in md
    assert "### Routing flips (MoE)" in md and "`<seq>@3` \\<kind\\>: \\[0, 1\\] -\\> \\[0, 2\\]" in md
    assert "<h2>Noise-aware verdict</h2>" in page and "<h2>Routing flips (MoE)</h2>" in page
    for raw in ("<Cls>", "<seq>", "<kind>", "<root>"):
        assert raw not in page, raw
    assert "<code>&lt;seq&gt;@3</code> &lt;kind&gt;: [0, 1] -&gt; [0, 2]" in page
    hostile = to_html(crafted_result("x<script>alert(1)</script>"))
    assert "<script" not in hostile.lower()


def test_html_is_self_contained(reports):
    page = reports["html"]
    assert page.count("<html") == 1 and "<script" not in page.lower()
    for fetch in ("http://", "https://", "//fonts", "@import", "url(", "<link", "<img", "<iframe"):
        # the only URL allowed is the SVG namespace, which is a name, not a fetch
        assert fetch not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), fetch
    assert "default-src 'none'" in page
    assert page.count("<svg") >= 2
    assert len(page.encode()) < 200_000


def crafted_result(module: str) -> dict:
    """A minimal result dict as analyzer/verdict/diverge.py builds it, with hostile strings in every name."""
    call = f"{module}#0"
    side = {
        "path": "/dumps/<img src=x onerror=alert(1)>",
        "label": "<u>ref</u>",
        "engine": "hf",
        "model": "m",
        "dtype": "float32",
        "device": "cpu",
        "tp_size": 1,
        "versions": {"torch": "<i>2</i>"},
        "flags": {"<flag>": "&amp;"},
        "passes": 1,
        "ranks": [0],
        "incomplete": None,
    }
    culprit = {
        "call": call,
        "module": module,
        "cls": "<Cls>",
        "rows": [{"seq": "<seq>", "pos": 3, "kind": "decode"}],
        "n_rows": 1,
        "note": f"arises in {module}",
        "victims": 2,
        "max_abs": 0.5,
        "max_ulp": 7,
        "rel": 0.1,
        "elements_differ": 3,
        "elements": 4,
        "dtype": "float32",
        "ref_absmax": 1.0,
        "tensor": f"{call}.out.0",
        "shapes": {s: {"pass": 0, "M": 1, "tensors": {"out.0": "[1, 4]"}} for s in ("a", "b")},
    }
    verdict = {
        "rows_compared": 2,
        "rows_differing": 1,
        "culprit": culprit,
        "per_row": [],
        "groups": [{"call": call, "module": module, "cls": "<Cls>", "rows": 1}],
        "not_comparable": [{"call": call, "why": "<why>"}],
        "nonfinite": [{"tensor": f"{call}.out.0", "rows": 1, "nonfinite_a": 1, "nonfinite_b": 0}],
        "summary": f"The first bit flips at {call}.",
        "calls_timeline": [
            {
                "call": call,
                "cls": "<Cls>",
                "order": 1,
                "rows": 2,
                "rows_in_differ": 0,
                "rows_out_differ": 1,
                "rows_origin": 1,
            }
        ],
        "calls_timeline_total": 1,
        "noise": {
            "rule": {"atol": 1e-5, "rtol": None, "floor_from_repeat": True},
            "rows_examined": 1,
            "rows_total": 2,
            "per_row": [],
            "culprits": [
                {
                    "call": call,
                    "module": module,
                    "cls": "<Cls>",
                    "rows": 1,
                    "kinds": {"<kind>": 1},
                    "in_err": 1e-7,
                    "out_err": 0.5,
                    "amplification": 5e6,
                    "sample_rows": [{"seq": "<seq>", "pos": 3, "kind": "decode"}],
                }
            ],
            "top_jumps": [{"call": call, "in_err": 1e-7, "out_err": 0.5, "amplification": 5e6}],
        },
        "routing_flips": [
            {
                "layer": 0,
                "call": call,
                "module": module,
                "cls": "<Cls>",
                "k": 2,
                "k_from": "router output",
                "num_experts": 4,
                "rows_compared": 2,
                "rows_differing": 1,
                "rows_flipped": 1,
                "kinds": {"decode": 1},
                "examples": [{"seq": "<seq>", "pos": 3, "kind": "<kind>", "experts_a": [0, 1], "experts_b": [0, 2]}],
            }
        ],
        "alignment": {
            "proof": [f"embedding output ({module}) ok"],
            "rows_b": 2,
            "unaligned_b": 0,
            "unkeyed_b": 0,
            "embedding": module,
        },
    }
    return {
        "a": side,
        "b": dict(side, label="<u>test</u>"),
        "ranks": {"0": verdict},
        "warnings": [f"<w>{module}"],
        "diverged_ranks": [0],
        "divergence": True,
        "culprit": culprit,
    }


def test_html_escapes_hostile_names():
    module = "model.<script>alert(1)</script>.x_y"
    page = to_html(crafted_result(module))
    assert "<script" not in page.lower()
    for raw in ("<img", "<u>", "<i>", "<Cls>", "<seq>", "<why>", "<flag>", "<w>"):
        assert raw not in page, raw
    assert html.escape(module) in page
    assert "&amp;amp;" in page  # a literal "&amp;" from the dump shows as typed, not as "&"


def test_markdown_escapes_names():
    module = "model.<root>_a#1|b`c"
    md = to_markdown(crafted_result(module))
    assert "``model.<root>_a#1|b`c#0``" in md  # a code span with a longer fence keeps it literal
    assert "``model.<root>_a#1\\|b`c#0``" in md  # in a table, | is escaped so the row keeps its cells
    assert "> **Warning:** ``<w>model.<root>_a#1|b`c``" in md  # a word with # in prose: a code span too
    assert "  - \\<u\\>ref\\</u\\>: pass 0" in md  # other prose: every special character escaped
    assert "\n#" not in md.replace("\n## ", "").replace("\n### ", "")
    mention = to_markdown(crafted_result("x @someone fixes #12"))
    assert "**Warning:** \\<w\\>x `@someone` fixes `#12`" in mention  # no ping, no issue link
    assert "**Summary:** The first bit flips at ``model.<root>_a#1|b`c#0``." in md


def test_reports_without_culprit_and_with_several_ranks():
    """No divergence, an old result without a timeline, and two ranks: every renderer copes."""
    result = crafted_result("model.layers.0.mlp")
    clean = dict(result["ranks"]["0"], rows_differing=0, culprit=None, groups=[], not_comparable=[], nonfinite=[])
    del clean["calls_timeline"]
    same = dict(result, ranks={"0": clean}, diverged_ranks=[], divergence=False, culprit=None, warnings=[])
    assert "NO DIVERGENCE" in to_markdown(same) and "NO DIVERGENCE" in to_html(same)
    two = dict(result, ranks={"0": clean, "1": result["ranks"]["0"]}, diverged_ranks=[1])
    md, page = to_markdown(two), to_html(two)
    assert "### Culprit (rank 1)" in md and "Ranks that diverge: 1" in md
    assert "Culprit (rank 1)" in page


def test_html_stays_small_on_a_huge_dump():
    """Thousands of calls and culprit groups: tables are capped, the timeline merged into buckets."""
    from dumpdiff.analyzer.report import svg as render_svg

    result = crafted_result("model.layers.0.mlp")
    verdict = result["ranks"]["0"]
    verdict["calls_timeline"] = [
        {
            "call": f"model.layers.{i // 60}.experts.{i % 60}#0",
            "cls": "Expert",
            "order": i,
            "rows": 4096,
            "rows_in_differ": i % 7,
            "rows_out_differ": i % 9,
            "rows_origin": i % 2,
        }
        for i in range(5000)
    ]
    verdict["calls_timeline_total"] = 20000
    verdict["groups"] = [{"call": f"m.{i}#0", "module": f"m.{i}", "cls": "X", "rows": i} for i in range(1000)]
    page = to_html(result)
    assert page.count("<tr>") < 2 * 200 + 40
    assert "800 more culprit groups not shown (first 200 of 1000)" in page
    assert "15000 more calls not shown (first 5000 of 20000)" in page
    assert page.count("<g><title>") <= render_svg.MAX_COLUMNS + render_svg.MAX_BARS
    assert len(page.encode()) < 400_000


# ---- a real browser ----


def find_chromium():
    """Chromium from Debian's package; installed on demand when we are root (CI machines are)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and installing it needs root: apt-get install -y chromium")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, capture_output=True, text=True)
    if install.returncode != 0:  # stale package lists on a fresh machine: refresh once and retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        install = subprocess.run(
            ["apt-get", "install", "-y", "-q", "chromium"], env=env, capture_output=True, text=True
        )
    if install.returncode != 0:
        pytest.skip(f"could not install chromium: {install.stderr.strip()[-300:]}")
    return shutil.which("chromium")


def chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # No network of any kind: the page must render from the file alone.
    base = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run(base + list(args), capture_output=True, text=True, timeout=180)


def png_pixels(path: Path):
    """(width, height, H x W x 3 uint8 array) of a screenshot: PIL when installed, else a small
    decoder for the 8-bit RGB/RGBA PNGs Chromium writes (zlib and numpy only)."""
    import numpy as np

    try:
        from PIL import Image

        with Image.open(path) as image:
            return image.width, image.height, np.asarray(image.convert("RGB"))
    except ImportError:
        pass
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data[pos + 8 : pos + 8 + length])
        elif kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and color_type in (2, 6) and interlace == 0, f"unexpected PNG format {header}"
    bpp = 3 if color_type == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.int32)
    for y in range(height):  # undo each row's filter (PNG spec, section 9)
        ftype, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if ftype == 1:  # Sub: running sum along the row, per channel
            line = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) & 255
        elif ftype == 2:  # Up
            line = (line + prev) & 255
        elif ftype in (3, 4):  # Average, Paeth: each byte needs its decoded left neighbour
            line, up = line.tolist(), prev.tolist()
            for i in range(len(line)):
                a = line[i - bpp] if i >= bpp else 0
                if ftype == 3:
                    line[i] = (line[i] + (a + up[i]) // 2) & 255
                else:
                    b, c = up[i], up[i - bpp] if i >= bpp else 0
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            line = np.array(line, np.int32)
        out[y], prev = line, line
    return width, height, out.reshape(height, width, bpp)[:, :, :3]


@pytest.mark.browser
def test_html_renders_in_headless_chromium(reports, tmp_path):
    binary = find_chromium()
    page = reports["html_path"]
    culprit = json.loads(reports["json"])["culprit"]

    shot = tmp_path / "report.png"
    proc = chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri())
    assert shot.exists(), f"no screenshot: {proc.stderr[-800:]}"
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1200, 1600)
    flat = pixels.reshape(-1, 3)
    colours = len({bytes(px) for px in flat[::7]})  # a sample is plenty to tell text and charts from blank
    non_white = float((flat != 255).any(axis=1).mean())
    assert colours > 20, f"screenshot looks blank: {colours} colours"
    assert non_white > 0.02, f"screenshot looks blank: {non_white:.1%} non-white"

    dom = chromium(binary, tmp_path / "profile-dom", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-800:]
    assert culprit["module"] in dom.stdout and "<svg" in dom.stdout


def test_report_command_writes_markdown_by_default(reports, dumps, tmp_path):
    target = tmp_path / "ticket.md"
    code, out, err = dumpdiff("report", *dumps, "-o", target, "--no-progress")
    assert code == 1 and out == "" and "wrote" in err
    assert target.read_text(encoding="utf-8") == reports["md"]  # the same report first-divergence writes


@pytest.mark.parametrize("examined,total", [(200, 634), (40, 40)])
def test_the_summary_says_when_its_row_count_is_of_a_sample(examined, total):
    """The noise-aware verdict reads at most 512 rows; the summary's count of rows with a real
    error is of those, and says so when they are a sample."""
    from dumpdiff.analyzer.verdict.diverge import summarize

    culprit = {
        "call": "model.layers.0.self_attn.attn#0",
        "cls": "RadixAttention",
        "rows": 38,
        "kinds": {"decode": 34, "extend": 4},
        "out_err": 0.2,
        "in_err": 0.0,
        "amplification": 1e4,
    }
    text = summarize(
        {"culprit": None, "noise": {"culprits": [culprit], "rows_examined": examined, "rows_total": total}}
    )
    sampled = f"on 38 rows of the {examined} sampled (of {total}) (34 decode, 4 extend)"
    assert (sampled in text) == (examined < total) and "on 38 rows" in text


def test_text_report_escapes_control_characters_and_keeps_a_newline_name_whole(tmp_path):
    """A module named with a terminal escape and a newline, around a planted decode-only op: the
    text report writes the escape as \\x1b (it drove the terminal: title, colours, clear screen),
    and the call keeps its whole name (with the newline, its tensors were not parsed as that
    call's: it compared no output, and its parent took the blame)."""
    name = "e\x1b[2Jx\ny"
    model = load_model(make_tiny_llama(tmp_path / "tiny-llama"), torch.bfloat16)  # bit-identical but for the plant
    inner = model.model.layers[1].mlp.down_proj
    inner.register_forward_hook(lambda module, args, out: out * 1.1 if out.shape[-2] == 1 else None)
    wrapper = type("Wrap", (torch.nn.Module,), {"forward": lambda self, x: getattr(self, name)(x)})()
    wrapper.add_module(name, inner)
    model.model.layers[1].mlp.down_proj = wrapper
    ref, dec, _ = dump_pair(model, tmp_path / "dumps", prompt_ids(12), new_tokens=4)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert code == 1 and "\x1b" not in out and "e\\x1b[2Jx" in out, err
    code, out, _ = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    timeline = {c["call"]: c for c in json.loads(out)["ranks"]["0"]["calls_timeline"]}
    assert timeline[f"model.layers.1.mlp.down_proj.{name}#0"]["rows_out_differ"] > 0  # its outputs are its own


@pytest.mark.parametrize("target", ["fifo", "folder", "empty", "missing folder"])
def test_o_writes_only_regular_files(dumps, tmp_path, target):
    """-o replaced the target by rename: a named pipe or a device became a plain file."""
    from dump_surgery import one_line_error

    path = {"fifo": tmp_path / "pipe", "folder": tmp_path, "empty": "", "missing folder": tmp_path / "no" / "r.md"}[
        target
    ]
    if target == "fifo":
        os.mkfifo(path)
    one_line_error(
        dumpdiff("first-divergence", *dumps, "--no-progress", "-o", path),
        "no folder" if target == "missing folder" else "not a regular file to write",
    )
    if target == "fifo":
        assert not os.path.isfile(path)


def test_reproduce_command_carries_the_options_that_change_the_verdict(dumps):
    """Pasting the report's command gave another verdict: it dropped --atol, --strict-only and
    the like; nor did it keep --fail-on, which decides a CI gate's exit status."""
    code, md, err = dumpdiff(
        "first-divergence",
        *dumps,
        "--format",
        "md",
        "--no-progress",
        "--strict-only",
        "--trust-alignment",
        "--atol",
        "0.001",
    )
    assert code == 1, err
    assert f"dumpdiff first-divergence {dumps[0]} {dumps[1]} --trust-alignment --atol 0.001 --strict-only" in md
    code, md, err = dumpdiff("first-divergence", *dumps, "--format", "md", "--no-progress", "--fail-on", "state-bug")
    assert code in (0, 1), err  # a CI gate's exit status: the pasted command must give the same
    assert f"dumpdiff first-divergence {dumps[0]} {dumps[1]} --fail-on state-bug\n" in md


def test_long_request_ids_are_shortened_in_reports_and_kept_whole_in_json(tmp_path):
    """sglang names sequences by 32-hex request ids: a culprit's six rows ran past 400 characters.
    Text, markdown and html show each by its shortest prefix (>= 8) that no other name shares,
    and say so; JSON keeps the names whole. Real dumps of a padded batch, renamed in every pass."""
    from dump_surgery import edit_pass_meta
    from helpers import dump_padded_batch

    model = load_model(make_tiny_llama(tmp_path / "tiny-llama"))
    model.model.layers[1].mlp.down_proj.register_forward_hook(decode_bug)
    _, ref, dec = dump_padded_batch(model, tmp_path / "dumps")
    rids = {}  # 32-hex request ids that share their first 8 characters: 9 are needed to tell them apart

    def rename(meta):
        rid = lambda seq: rids.setdefault(seq, "5e2b8c11" + f"{len(rids):x}" + "0a" * 11 + "f")  # noqa: E731
        meta["tokens"]["seq"] = [rid(s) for s in meta["tokens"]["seq"]]
        for entry in meta.get("seqs", []):
            entry["seq"] = rid(entry["seq"])

    for dump in (ref, dec):
        for name in sorted(os.listdir(os.path.join(dump, "rank0"))):
            if name.endswith(".safetensors"):
                edit_pass_meta(os.path.join(dump, "rank0", name), rename)
    code, out, err = dumpdiff("first-divergence", ref, dec, "--no-progress")
    assert code == 1, err
    culprit_rows = next(line for line in out.splitlines() if line.startswith("  token rows:"))
    shown = {rid[:9] + ".." for rid in rids.values()}
    assert any(name in culprit_rows for name in shown) and not any(rid in out for rid in rids.values()), culprit_rows
    assert "shown by their first 9" in out and "--format json gives them whole" in out
    code, out, _ = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", "json")
    rows = json.loads(out)["ranks"]["0"]["culprit"]["rows"]
    assert rows and all(row["seq"] in rids.values() for row in rows)
    for fmt in ("md", "html"):
        code, out, _ = dumpdiff("first-divergence", ref, dec, "--no-progress", "--format", fmt)
        assert any(name in out for name in shown) and not any(rid in out for rid in rids.values()), fmt
