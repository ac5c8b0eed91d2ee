"""The README and the docs tell the truth: every `$ parashift ...` command they show parses, runs and
exits 0, prints every line shown under it in the same format (numbers, strategies and the binding
constraint may differ: timings and machine-fitted cost models vary), and the deterministic lines
(planning and simulation results) are exactly what the command prints. A command shown on several
pages runs once. The docs site builds with `mkdocs build --strict`, and the README's links resolve."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parashift.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"


def nav_pages() -> list[Path]:
    """The docs pages in the order mkdocs.yml's nav lists them (every page listed once)."""
    names = re.findall(r"^\s*-\s*[^:]+:\s*(\S+\.md)\s*$", MKDOCS.read_text(), flags=re.M)
    return [ROOT / "docs" / n for n in names]


PAGES = [README] + nav_pages()


def _page_name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def page_commands(page: Path) -> list[str]:
    """A page's shell commands (lines starting `$ parashift `), continuation lines joined, in order."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("$ parashift "):
            cmd = lines[i][2:]
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            out.append(normalize(cmd))
        i += 1
    return out


def page_blocks(page: Path) -> list[tuple[str, list[str]]]:
    """Each command of a page's shell blocks (continuations joined) with the output lines shown under it."""
    out: list[tuple[str, list[str]]] = []
    lines = page.read_text().splitlines()
    current: "list[str] | None" = None
    i, fence = 0, None          # the open fence line ("```" for shell blocks, "```python" ...)
    while i < len(lines):
        line = lines[i]
        in_block = fence == "```"
        if line.startswith("```"):
            fence = line if fence is None else None
            current = None                       # output belongs to a command of the same block
        elif in_block and line.startswith("$ parashift "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            current = []
            out.append((normalize(cmd), current))
        elif in_block and current is not None and line.strip():
            current.append(line)
        i += 1
    return out


def normalize(cmd: str) -> str:
    """One spelling per command: runs of spaces squeezed (continuation lines leave some)."""
    return " ".join(cmd.split())


def collect(pages: list[Path]) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
    """The distinct commands of ``pages`` in first-shown order, every output line shown under each
    (from every page that shows it), and the pages that show each."""
    order: list[str] = []
    shown: dict[str, list[str]] = {}
    where: dict[str, list[str]] = {}
    for page in pages:
        for cmd, lines in page_blocks(page):
            if cmd not in shown:
                order.append(cmd)
                shown[cmd] = []
                where[cmd] = []
            shown[cmd] += [ln for ln in lines if ln not in shown[cmd]]
            where[cmd].append(_page_name(page))
    return order, shown, where


COMMANDS, BLOCKS, SHOWN_ON = collect(PAGES)

_NUM = r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?"
_BINDING = r"(?:compute|communication|bubble|memory|unknown)"
_SCHEDULE = r"\(?(?:gpipe|1f1b|interleaved-1f1b|zb-h1|zb-2p|zb-v|dualpipev)\)?"


def line_format(line: str) -> "re.Pattern | None":
    """A README output line as a pattern: numbers, strategies (tokens with '='), schedules and the
    binding constraint are wildcards; a runner-up's 'lost on' text is free; whitespace is elastic.
    None for lines that are not output formats ('...') or depend on timing (a late preemption)."""
    line = line.rstrip().removesuffix("  LATE")
    if line.strip() in ("...", "") or line.strip().startswith("FAILED:"):
        return None
    toks = line.split()
    if "=" in toks[0] and toks[0].endswith(":"):          # "<strategy>: what it lost on"
        return re.compile(r"^\s*\S+=\S*: .+")
    parts = []
    for t in toks:
        if "=" in t:
            parts.append(r"\S+")
        elif re.fullmatch(_SCHEDULE, t):
            parts.append(_SCHEDULE)
        elif re.fullmatch(r"compute|communication|bubble", t):
            parts.append(_BINDING)
        else:
            parts.append(re.sub(re.escape("NUM"), _NUM, re.escape(re.sub(_NUM, "NUM", t))))
    return re.compile(r"\s+".join(parts))

# lines the README and docs show that must come out exactly (simulation and planning are deterministic)
EXPECTED = {
    "parashift models": ["llama2-70b  68.98B", "qwen3-235b-a22b 235.09B"],
    "parashift schedule": ["stage 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
                           "stage 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"],
    "parashift simulate --model llama2-70b": ["step time      6.9277 s", "bubble         17.2 %"],
    "parashift plan --model llama2-70b": ["kept in place   828.36 GiB", "moved           328.10 GiB", "verified: every destination"],
    "parashift plan-trace": ["hot-switch          1.578e+09",
                             "18 devices       338,552 tok/s  dp=16,tp=1,pp=1,zero=2,mbs=4"],
    "parashift search --model gpt3-1.3b": ["200 trials (69 feasible, 69 simulated)",
                                           "best           dp=32,tp=1,pp=1,zero=2,mbs=2",
                                           "peak memory    10.16 GiB per device; bound by compute",
                                           "devices        uses 32 of 38 (6 idle",
                                           "dp=32,tp=1,pp=1,zero=2,mbs=2,recompute=selective: 4.9% slower: +10.6 ms compute",
                                           "dp=32,tp=1,pp=1,zero=3,mbs=2,recompute=selective: 7.9% slower: "
                                           "+10.6 ms compute, +6.4 ms exposed communication"],
    "parashift replay": ["starting on 2 devices with dp=2,tp=1,pp=1,zero=1"],
}


def test_readme_shows_the_two_commands_and_the_tour():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    readme = set(page_commands(README))
    assert {shlex.split(c)[1] for c in readme} >= {"models", "simulate", "search", "run", "replay"}
    assert len(text.splitlines()) <= 260, "the README is a front door: move reference material to docs/"


def test_readme_and_docs_show_every_planning_and_running_command():
    assert {shlex.split(c)[1] for c in COMMANDS} >= {"models", "clusters", "schedule", "simulate", "plan", "run",
                                                       "search", "search-rl", "plan-trace", "replay", "calibrate"}
    for page in PAGES:        # every command sits in a plain ``` block, where its output is read
        assert [c for c, _ in page_blocks(page)] == page_commands(page), _page_name(page)
    assert sum(len(v) for v in BLOCKS.values()) > 50


def test_a_command_shown_twice_is_collected_once(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("```\n$ parashift models\n  tiny-gpt 0.18M\n$ parashift traces --json\n```\n")
    b.write_text("text\n```\n$ parashift  models\n  llama2-70b  68.98B\n  tiny-gpt 0.18M\n```\n"
                 "```python\n$ parashift run\n```\n")
    order, shown, where = collect([a, b])
    assert order == ["parashift models", "parashift traces --json"]
    assert shown["parashift models"] == ["  tiny-gpt 0.18M", "  llama2-70b  68.98B"]
    assert len(where["parashift models"]) == 2


def test_every_nav_page_exists_and_every_docs_page_is_in_the_nav():
    listed = {p.name for p in nav_pages()}
    assert all(p.is_file() for p in nav_pages())
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}
    assert len(listed) == len(nav_pages())


def test_line_formats_accept_other_figures_and_reject_other_shapes():
    f = line_format("  step time      0.1845 s = compute 67.1 ms + exposed communication 82.0 ms + bubble 35.5 ms")
    assert f.search("  step time 1.2 s = compute 1,067.1 ms + exposed communication 2.0 ms + bubble 0.0 ms")
    assert not f.search("  step time 1.2 s = compute 67.1 ms")
    g = line_format("  peak memory    2.79 MiB per device; bound by communication")
    assert g.search("  peak memory 12.00 MiB per device; bound by compute") and not g.search("peak 2 MiB")
    h = line_format("tiny-gpt under dp=2,tp=1,pp=2,mbs=2,schedule=zb-h1 (zb-h1) on 4 processes")
    assert h.search("tiny-gpt under dp=4,tp=1,pp=1,zero=2 (1f1b) on 4 processes")
    assert line_format("...") is None and line_format("  FAILED: preempt at 3.40 s") is None


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_shown_command_parses(cmd):
    argv = shlex.split(cmd)[1:]
    build_parser(argv).parse_args(argv)  # exits (SystemExit) on a flag the CLI does not know


def test_every_shown_command_runs_in_order(tmp_path, monkeypatch, capfd):
    """Run each distinct command once, in page order (the README, then the docs in nav order), in one
    folder (search writes the plan.json that run executes, calibrate writes the cost.json that
    simulate reads), in-process through the CLI's entry point (the live jobs still start their own
    worker processes; capfd also hears what those print)."""
    from parashift.cli import main
    monkeypatch.chdir(tmp_path)
    for shipped in ("examples", "data"):     # the configs, tokenizer and text the pages name
        (tmp_path / shipped).symlink_to(ROOT / shipped)
    for cmd in COMMANDS:
        argv = shlex.split(cmd)[1:]
        rc = main(argv)
        out, err = capfd.readouterr()
        assert rc == 0, f"{cmd}\n{err[-2000:]}"
        printed = [ln.rstrip().removesuffix("  LATE") for ln in (out + "\n" + err).splitlines()]
        for shown in BLOCKS[cmd]:
            fmt = line_format(shown)
            assert fmt is None or any(fmt.search(ln) for ln in printed), (
                f"{cmd}: {SHOWN_ON[cmd]} show {shown!r}, no printed line has its format\n{out}\n{err[-1500:]}")
        for prefix, lines in EXPECTED.items():
            if cmd.startswith(prefix) and (not prefix.startswith("parashift plan") or argv[0] == "plan"):
                squeeze = re.sub(r" +", " ", out)
                for line in lines:
                    assert re.sub(r" +", " ", line) in squeeze, f"{cmd}: {SHOWN_ON[cmd]} show {line!r}\n{out}"


def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict` fails on any warning: a page missing from the nav, a broken link or anchor."""
    pytest.importorskip("mkdocs")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert (tmp_path / "site" / "strategies" / "index.html").is_file()


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc spell it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown file whose target file, or anchor in a Markdown target, is missing."""
    bad = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                                  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md":
            heads = {slug(h) for h in re.findall(r"^#+\s+(.+?)\s*$", dest.read_text(), flags=re.M)}
            if anchor not in heads:
                bad.append(target)
    return bad


def test_readme_and_report_links_resolve(tmp_path):
    files = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))]
    assert {p.name: broken_links(p) for p in files} == {p.name: [] for p in files}
    bad = tmp_path / "bad.md"
    bad.write_text("# Top\n[a](missing.md) [b](#top) [c](#nowhere) [d](https://example.com) ![i](x.png)\n")
    assert broken_links(bad) == ["missing.md", "#nowhere"]
    assert slug("The GPU path: written for NCCL, never run on a GPU") == "the-gpu-path-written-for-nccl-never-run-on-a-gpu"


def test_strategies_page_has_one_row_per_strategy_key_with_its_default():
    import dataclasses

    from parashift import Strategy
    rows = re.findall(r"^\| `(\w+)` \|(.*)\|\s*$", (ROOT / "docs" / "strategies.md").read_text(), flags=re.M)
    keys = [k for k, _ in rows]
    fields = {f.name: f.default for f in dataclasses.fields(Strategy) if not f.name.startswith("_")}
    assert sorted(keys) == sorted(fields) and len(keys) == len(set(keys))
    for key, rest in rows:                         # columns: meaning | values | default | constraints
        default = rest.split("|")[2].strip()
        want = ("off" if fields[key] is False else "on") if isinstance(fields[key], bool) else f"{fields[key]}"
        assert default.strip("`").startswith(want), f"{key}: the page says {default!r}, the code {fields[key]!r}"
