"""The command line `python -m lab`: listing, running, traces and exit codes for bad input.

Validation errors happen before any model is loaded, so those cases call `lab.tools.cli.main(argv)` in process
(cheap); `list --json` and one full `run` go through a subprocess (`sys.executable -m lab`), the run being the
only subprocess that loads the model (about 15 s).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.app.validation import MAX_PROMPT_CHARS
from lab.tools import cli
from lab.trace import from_json

ROOT = Path(__file__).resolve().parents[1]


def run_lab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m lab ARGS` from the repository root, capturing text output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lab", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_list_json_has_strategies_and_params() -> None:
    result = run_lab("list", "--json")
    assert result.returncode == 0, result.stderr
    items = {item["name"]: item for item in json.loads(result.stdout)}
    assert {"greedy", "sample"} <= set(items)
    for item in items.values():
        assert set(item) == {"name", "family", "summary", "paper", "params"}
    sample_params = {p["name"]: p for p in items["sample"]["params"]}
    assert {"max_new_tokens", "temperature", "top_k", "top_p", "min_p"} <= set(sample_params)
    assert sample_params["temperature"]["type"] == "float" and sample_params["max_new_tokens"]["common"] is True
    assert set(sample_params["top_k"]) == {"name", "type", "default", "low", "high", "choices", "help", "common"}
    assert "repetition_penalty" in {p["name"] for p in items["greedy"]["params"]}


def test_list_text_groups_by_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "baseline:" in out and "greedy" in out and "sample" in out


@pytest.mark.embedded
def test_run_json_and_trace(tmp_path: Path) -> None:
    trace_file = tmp_path / "run.json"
    result = run_lab(
        "run",
        "--strategy",
        "greedy",
        "--prompt",
        "Name a colour.",
        "--max-new-tokens",
        "8",
        "--json",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--trace",
        str(trace_file),
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    payload = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(payload) == {"text", "token_ids", "stats"}
    assert isinstance(payload["text"], str) and 1 <= len(payload["token_ids"]) <= 8
    stats = payload["stats"]
    for key in ("new_tokens", "wall_s", "tokens_per_s", "target_forwards", "forwards_per_token", "stop_reason"):
        assert key in stats
    assert stats["new_tokens"] == len(payload["token_ids"]) and stats["prompt_tokens"] > 0
    assert stats["strategy"] == "greedy" and stats["model"] == "smollm2-135m"
    trace = from_json(trace_file.read_text(encoding="utf-8"))
    assert trace.token_ids == payload["token_ids"] and trace.strategy == "greedy"
    assert trace.params["max_new_tokens"] == 8


@pytest.mark.embedded
def test_run_streams_text_and_stats(embedded, capsys: pytest.CaptureFixture[str]) -> None:
    """In process, reusing the session's cached fp32 model: text on stdout, the stats line on stderr."""
    argv = ["run", "--strategy", "sample", "--prompt", "Hello", "--raw", "--max-new-tokens", "4"]
    assert cli.main([*argv, "--set", "temperature=0.5", "--dtype", "float32", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    assert "[sample bf16]" in captured.err and "tok/s" in captured.err and "stop:" in captured.err  # + weight format


BAD_INPUTS = {
    "empty prompt": (["--strategy", "greedy", "--prompt", "   "], "empty"),
    "prompt too long": (["--strategy", "greedy", "--prompt", "x" * (MAX_PROMPT_CHARS + 1)], "limit"),
    "unknown strategy": (["--strategy", "no-such", "--prompt", "hi"], "Unknown strategy"),
    "unknown --set key": (["--strategy", "sample", "--prompt", "hi", "--set", "warp=2"], "Unknown parameter"),
    "out of range": (["--strategy", "sample", "--prompt", "hi", "--set", "temperature=9"], "out of range"),
    "non-numeric": (["--strategy", "sample", "--prompt", "hi", "--set", "top_k=many"], "must be a int"),
    "--set without =": (["--strategy", "sample", "--prompt", "hi", "--set", "top_k"], "key=value"),
    "max-new-tokens 0": (["--strategy", "greedy", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    "bad seed": (["--strategy", "greedy", "--prompt", "hi", "--seed", "x"], "seed"),
    "bad dtype": (["--strategy", "greedy", "--prompt", "hi", "--dtype", "int4"], "dtype"),
    "trace dir missing": (["--strategy", "greedy", "--prompt", "hi", "--trace", "/no/such/dir/t.json"], "trace"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, fragment = BAD_INPUTS[case]
    assert cli.main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err


def test_bad_input_in_a_subprocess_has_no_traceback() -> None:
    result = run_lab("run", "--strategy", "sample", "--prompt", "hi", "--set", "temperature=9")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr and result.stdout == ""


def test_prompt_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n"))
    assert cli.main(["run", "--strategy", "greedy", "--prompt", "-"]) == 2
    assert "empty" in capsys.readouterr().err


def test_unknown_model_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--strategy", "greedy", "--prompt", "hi", "--model", "./no-such-model-dir"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model-dir" in err and "Traceback" not in err


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupt(request):
        raise KeyboardInterrupt

    monkeypatch.setattr("lab.app.runner.prepare", interrupt)
    assert cli.main(["run", "--strategy", "greedy", "--prompt", "hi"]) == 130
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--strategies", "greedy,greedy"], "distinct"),
        (["--strategies", "greedy", "--repeat", "0"], "repeat"),
        (["--strategies", "greedy", "--limit", "x"], "--limit"),
        (["--strategies", "nope"], "Unknown strategy"),
        (["--strategies", "greedy", "--prompts", "/no/such/prompts.txt"], "does not exist"),
        (["--strategies", "greedy", "--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bench_bad_input_exits_2(args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err


def test_argparse_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--strategy", "greedy"]) == 2
    assert "error:" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
