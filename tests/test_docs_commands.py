"""The docs run as written: every `python benchmarks/...` command names a script that exists (and
every `python -m localctx....` a module that does), every raw result a page names lies under
docs/results/ (or, as a command's output, in a folder that does), every relative link and every
source path a page names in backticks exists, and every `git show REV:PATH` names a file of that
commit. README.md, benchmarks/README.md and every page in docs/ are walked."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# results a page promises but no run has made yet (the page says so); once committed, drop them here
# and let the page show the figures
PROMISED = {
    "docs/results/cuda/cuda-check.json": "no GPU has run benchmarks/cuda_check/one_run.py yet",
    "docs/results/cuda/cuda-check.txt": "no GPU has run benchmarks/cuda_check/one_run.py yet",
    "docs/results/cuda/cuda-attention.json": "no GPU has run benchmarks/cuda_check/attention_bench.py yet",
}
# folders .gitignore names from the root (made where they are used, e.g. the GPU check's wheels)
IGNORED = {line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if line.startswith("/")}
OUTPUT_FLAGS = ("--json", "--out", "--save", ">")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]{2,}")  # quality-NAME.json, quality-smollm2-torch-POLICY.json


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def lines(page: Path):
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        yield f"{page_id(page)}:{number}", line


def located(page: Path, path: str) -> Path:
    """A path as a page names it: from the repository root when it starts with a top-level folder,
    else from the page's own folder (docs/ pages link `results/quality/x.json`)."""
    first = path.split("/")[0]
    from_root = page.parent == ROOT or (first not in ("results", "img") and (ROOT / first).exists())
    return ROOT / path if from_root else page.parent / path


def exists(target: Path) -> bool:
    """A file or folder; a name with a placeholder (quality-NAME.json) or a * needs one match."""
    pattern = PLACEHOLDER.sub("*", target.name)
    return any(target.parent.glob(pattern)) if "*" in pattern else target.exists()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_benchmark_commands_name_scripts_that_exist(page):
    missing = []
    for where, line in lines(page):
        for script in re.findall(r"\bpython3? (benchmarks/[\w./-]+\.py)", line):
            if not (ROOT / script).is_file():
                missing.append(f"{where}: python {script}")
        for module in re.findall(r"\bpython3? -m (localctx(?:\.\w+)+)", line):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{where}: python -m {module}")
    assert not missing, "commands naming what does not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_results_exist(page):
    missing = []
    for where, line in lines(page):
        for m in re.finditer(r"(?<![\w/.-])((?:docs/)?results/[\w./+{},-]+\.(?:json|txt))", line):
            path = m.group(1)
            target = located(page, path)
            before = line[:m.start()].rstrip()
            rel = target.resolve().relative_to(ROOT.resolve()).as_posix() if target.resolve().is_relative_to(
                ROOT.resolve()) else path
            if rel in PROMISED:
                assert not target.exists(), f"{where}: {rel} is committed now; update the page and PROMISED"
                continue
            if before.endswith(OUTPUT_FLAGS):  # a command's output: written there when it runs
                ok = target.parent.is_dir()
            else:
                ok = exists(target)
            if not ok:
                missing.append(f"{where}: {path}")
    assert not missing, "raw results named but not there:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_and_source_paths_resolve(page):
    missing = []
    for where, line in lines(page):
        if line.startswith("    "):  # an indented block: code or a formula, not markdown
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{where}: link {target}")
        for token in re.findall(r"`([^`\s]+)`", line):
            path = token.split("::")[0].rstrip(",.:")
            checkable = "/" in path.rstrip("/") and path.rstrip("/") not in IGNORED and "<" not in path \
                and re.search(r"\.(py|c|json|md|tcss|toml)$|/$", path) and not path.startswith(("/", "~", "$", "http"))
            if not checkable:
                continue
            if path.startswith("results/") or path.startswith("docs/results/"):
                continue  # test_named_results_exist
            target = located(page, path.rstrip("/"))
            if not exists(target) and not exists(ROOT / path.rstrip("/")):
                missing.append(f"{where}: `{token}`")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def known_revision(rev: str) -> bool:
    done = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_git_show_references_name_files_of_that_commit(page):
    missing = []
    for where, line in lines(page):
        for rev, path in re.findall(r"git show ([0-9a-f]{7,40}):([\w./+-]+)", line):
            try:
                if not known_revision(rev):
                    continue  # a shallow clone or an export without history: nothing to check against
            except OSError:
                pytest.skip("git is not installed")
            if subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True).returncode:
                missing.append(f"{where}: git show {rev}:{path}")
    assert not missing, "\n".join(missing)


def test_results_are_named_by_a_page_or_a_script():
    """Every raw result under docs/results/ is named by a page or by the script that writes it; results
    quality_tables.py writes under a computed name (quality-NAME.json) count as named by that script."""
    import sys

    texts = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    texts += "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "benchmarks").rglob("*.py"))
    texts += "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "app").rglob("*.py"))
    sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
    try:
        from quality_tables import COMMANDS
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "quality"))
    made_by_quality_tables = {f"quality-{name}.json" for name in COMMANDS}
    results = sorted((ROOT / "docs" / "results").rglob("*.json"))
    assert len(results) > 100
    orphans = [r.relative_to(ROOT).as_posix() for r in results
               if r.name not in texts and r.name not in made_by_quality_tables]
    assert not orphans, f"{len(orphans)} of {len(results)} results under docs/results/ are named by no page or " \
                        f"script: {', '.join(orphans)}"
