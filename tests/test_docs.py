"""The docs stay true by themselves: the site builds with no broken link or anchor, README's own
links resolve, the generated tables are current, the results files are well formed, no text
names a tracker's issue number, and the code blocks marked runnable run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from types import SimpleNamespace

import pytest

from server_helpers import ServerProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import perf_tables  # noqa: E402
import results_io  # noqa: E402

MARKERS = {"<!-- runnable -->": "script", "<!-- runnable: server -->": "server"}
FENCE = "```python"


def doc_pages() -> list[str]:
    docs = os.path.join(REPO, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def runnable_blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, kind, code) of every block marked runnable."""
    out = []
    for page in doc_pages():
        with open(os.path.join(REPO, page)) as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            kind = MARKERS.get(line.strip())
            if kind and i + 1 < len(lines) and lines[i + 1].strip() == FENCE:
                end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
                out.append((page, i + 1, kind, "\n".join(lines[i + 2:end]) + "\n"))
    return out


BLOCKS = runnable_blocks()


# -- cheap checks ----------------------------------------------------------------------------
def test_every_runnable_marker_is_followed_by_a_python_fence():
    bad = []
    for page in doc_pages():
        with open(os.path.join(REPO, page)) as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if not line.strip().startswith("<!-- runnable"):
                continue
            if line.strip() not in MARKERS:
                bad.append(f"{page}:{i + 1}: unknown marker {line.strip()!r}")
            elif i + 1 >= len(lines) or lines[i + 1].strip() != FENCE:
                bad.append(f"{page}:{i + 1}: the marker is not followed by a {FENCE} fence")
            elif not any(lines[j].strip() == "```" for j in range(i + 2, len(lines))):
                bad.append(f"{page}:{i + 1}: the block is never closed")
    assert not bad, "\n".join(bad)
    kinds = {(page, kind) for page, _, kind, _ in BLOCKS}
    assert {("README.md", "script"), ("README.md", "server")} <= kinds, "the tour's examples run"


def test_site_builds_with_no_broken_link_or_anchor(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                           str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = unicodedata.normalize("NFKC", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            m = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m and not in_code:
                slug = github_slug(m.group(2))
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_links_and_anchors_exist():
    """README.md is not part of the site, so its relative links are checked here."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(REPO, path)) if path else os.path.join(REPO, "README.md")
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and (not full.endswith(".md") or anchor not in anchors_of(full)):
            bad.append(f"{target}: no such section")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", list(perf_tables.PAGES))
def test_performance_tables_are_generated_from_the_results_files(page):
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    assert perf_tables.render(text, page) == text, "run `python benchmarks/perf_tables.py`"


def test_results_files_are_well_formed():
    runs = results_io.load_all()
    assert runs
    for r in runs:
        where = r["file"]
        assert r["kind"] in ("compare", "table"), where
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", r["date"]), where
        assert r["command"] and r["commit"] and r["source"], where
        assert r["cpu"]["kind"] in results_io.CPU_KINDS and r["cpu"]["flags"], where
        if r["kind"] == "compare":
            assert r["w1"] and all({"engine", "threads", "output_tok_s"} <= set(w) for w in r["w1"]), where
            assert set(r["engines"]) >= {w["engine"] for w in r["w1"]}, where
        else:
            assert r["rows"] and all(len(row) == len(r["columns"]) for row in r["rows"]), where
    latest = results_io.latest_per_kind(runs)
    assert latest["avx512-bf16"] and latest["avx2"], "the measured kinds have a table"


def test_compare_writes_a_results_file_that_the_tables_read(tmp_path, monkeypatch):
    import compare
    monkeypatch.setattr(sys, "argv", ["benchmarks/compare.py", "--threads", "1,2"])
    args = SimpleNamespace(threads="1,2", dtypes="bfloat16", single_stream=False, num_prompts=8,
                           min_len=32, max_len=64, output_len=8, seed=0, checkpoint_dtype="float32",
                           kvflow_args="{}", w2_num_prompts=4)
    # as the run loop keeps them: "engine" is what the worker calls itself, "key" compare's name
    results = [{"engine": label, "key": e, "threads": t, "dtype": "bfloat16", "output_tok_s": v * t,
                "total_tok_s": 1.0, "wall_s": 1.0, "startup_s": 2.0, "round": 0}
               for e, label, v in (("kvflow", "kvflow", 200.0), ("vllm", "vllm-cpu", 100.0),
                                   ("llamacpp", "llama.cpp", 50.0),
                                   ("hf-static", "hf-generate-static16", 25.0))
               for t in (1, 2)]
    check = {"one_s": 1.0, "two_s": 1.0, "ratio": 1.0, "load1": 0.1, "shared": False}
    import datetime
    started = datetime.datetime(2030, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)
    summary = compare.results_file(args, started, ["kvflow", "vllm", "llamacpp", "hf-static"], results, [],
                                   check, check, {})
    assert summary["partial"] is False and summary["date"] == "2030-01-02T03:04Z"
    (tmp_path / "run.json").write_text(json.dumps(summary))
    run = results_io.latest_per_kind(results_io.load_all(str(tmp_path)))[results_io.cpu_info()["kind"]]
    table = "\n".join(perf_tables.w1_table(run))
    assert "| **kvflow** | **200.0** | 1.00x | **400.0** | 1.00x | 2.0 s |" in table
    assert "| vLLM CPU 0.32.0 | 100.0 | 2.00x | 200.0 | 2.00x | 2.0 s |" in table


def test_the_chart_is_drawn_from_the_results_files(tmp_path):
    import plot_results
    out = plot_results.plot(str(tmp_path / "w1.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_text_names_an_issue_number_or_a_session():
    """Sections, comments and names say what a thing is, not which ticket or session made it."""
    patterns = [r"\biss" r"ues? ?#?\d+", r"\bthe iss" r"ue\b", r"\biss" r"ue's\b",
                r"\b(?:this|other|development|coding) sess" r"ions?\b", r"\bsess" r"ions'"]
    files = subprocess.run(["git", "ls-files", "README.md", "docs", "benchmarks", "kvflow", "tests",
                            "mkdocs.yml", "Makefile"], cwd=REPO, capture_output=True, text=True).stdout.split()
    bad = []
    for name in files:
        if name.endswith((".png", ".gguf", ".bin")) or name.startswith("benchmarks/data/"):
            continue
        try:
            with open(os.path.join(REPO, name)) as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for p in patterns:
            bad += [f"{name}: {m.group(0)!r}" for m in re.finditer(p, text, flags=re.I)]
    assert not bad, "\n".join(bad)


# -- the runnable blocks -----------------------------------------------------------------------
def run_block(code: str, tmp_path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KVFLOW_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "the block printed nothing"


@pytest.fixture(scope="module")
def docs_server():
    server = ServerProcess()
    yield server
    server.terminate()


@pytest.mark.slow
@pytest.mark.parametrize("page,line,code", [(p, n, c) for p, n, k, c in BLOCKS if k == "script"],
                         ids=lambda v: v if isinstance(v, (str, int)) and not str(v).count("\n") else "")
def test_runnable_block(page, line, code, tmp_path):
    run_block(code, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page,line,code", [(p, n, c) for p, n, k, c in BLOCKS if k == "server"],
                         ids=lambda v: v if isinstance(v, (str, int)) and not str(v).count("\n") else "")
def test_runnable_server_block(page, line, code, docs_server, tmp_path):
    assert "127.0.0.1:8000" in code, f"{page}:{line}: a server block talks to 127.0.0.1:8000"
    run_block(code.replace("127.0.0.1:8000", f"127.0.0.1:{docs_server.port}"), tmp_path)
