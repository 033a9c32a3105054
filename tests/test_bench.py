"""The benchmark (`lab.tools.bench`): rows, speedups, the table, and prompt files. Speeds are measured, never
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.app.builtin_prompts import load_prompts
from lab.params import InputError
from lab.tools.bench import HF_ROW, format_table, run_bench


@pytest.mark.embedded
def test_run_bench_rows_and_table(embedded) -> None:
    calls: list[tuple[int, int, str]] = []
    result = run_bench(
        ["greedy", "sample"],
        max_new_tokens=8,
        limit=2,
        device="cpu",
        dtype="float32",
        profile=True,
        progress=lambda done, total, message: calls.append((done, total, message)),
    )
    calls = [c for c in calls if not c[2].startswith("profile")]
    names = [row.name for row in result.rows]
    assert names == ["greedy", "sample", HF_ROW]
    assert result.rows[0].speedup == 1.0
    for row in result.rows:
        assert row.median_tokens_per_s > 0 and row.runs == 2
        assert 0 < row.mean_new_tokens <= 8 and row.forwards_per_token > 0
        assert "tokens_per_s" in row.metrics
    assert result.config["n_prompts"] == 2 and result.config["dtype"] == "float32"
    assert calls[-1][:2] == (6, 6) and "prompt 2/2" in calls[-1][2]  # round-robin: hf-generate last
    assert [c[2].split()[0] for c in calls[1:4]] == names
    table = format_table(result)
    assert all(f"| {name} |" in table for name in names)
    json.dumps(result.as_dict(), allow_nan=False)  # the --json output is plain JSON
    assert [row.name for row in result.profile] == ["greedy", "sample"]  # the profiled pass, strategies only
    for row in result.profile:
        assert sum(row.shares.values()) == pytest.approx(1.0) and row.shares["target forward"] > 0
        assert row.positions_per_target_forward == 1.0 and row.target_forwards_per_token > 0
    assert "Where the time goes" in table and "| greedy |" in table.split("Where the time goes")[1]


def test_prompt_files_load(tmp_path: Path) -> None:
    as_json = tmp_path / "prompts.json"
    as_json.write_text(json.dumps(["First prompt.", "Second prompt?"]), encoding="utf-8")
    as_text = tmp_path / "prompts.txt"
    as_text.write_text("One\n\n  \nTwo\nThree\n", encoding="utf-8")
    assert load_prompts(str(as_json)) == ["First prompt.", "Second prompt?"]
    assert load_prompts(str(as_text)) == ["One", "Two", "Three"]
    assert len(load_prompts("builtin")) >= 8


@pytest.mark.parametrize(
    "content",
    ['["unterminated", ', "[1, 2, 3]", '["fine", ""]', "", "\n  \n"],
    ids=["bad-json", "not-strings", "empty-item", "empty-file", "blank-lines"],
)
def test_malformed_prompt_file_is_input_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError):
        load_prompts(str(path))


def test_run_bench_rejects_a_bad_prompt_file_before_loading(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[1]", encoding="utf-8")
    with pytest.raises(InputError):
        run_bench(["greedy"], str(path), model="./no-such-model-dir")
