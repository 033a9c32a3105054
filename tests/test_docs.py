"""The README stays a user's page whose figures agree with docs/benchmarks.md, and the docs cite only files that exist
in the repository (docs/architecture.md is the design document; no DESIGN.md outside it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")


def _table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of the Markdown table whose header line starts with `header_start` (separator row skipped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell))


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    assert len(README.splitlines()) < 200
    assert "make run" in README and "make test" in README


def test_readme_results_match_docs_benchmarks() -> None:
    """The README's table is docs/benchmarks.md's current bench table, cell for cell, and each ratio is the rows'
    decode tok/s over the first row's (to the rounding of the printed figures)."""
    header = "| strategy | decode tok/s | decode vs greedy"
    readme = _table_rows(README, header)
    bench = {row[0]: row for row in _table_rows(BENCHMARKS, header)}
    assert len(readme) >= 5
    first = _number(readme[0][1])
    for row in readme:
        assert bench[row[0]] == row, row[0]
        ratio = _number(row[2].split("x")[0])
        assert abs(_number(row[1]) / first - ratio) < 0.002, row[0]


def test_readme_and_docs_links_point_to_files_that_exist() -> None:
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = document.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (document.parent / target).exists(), f"{document.name} links to missing {target}"


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".cpp"} or name == "tests/test_docs.py":
            continue
        if "DESIGN.md" in path.read_text(encoding="utf-8", errors="replace"):
            offenders.append(name)
    assert offenders == []
