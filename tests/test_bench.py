"""The benchmark (`lab.tools.bench`): rows, speedups, the table, and prompt files; the prefill / decode split and
its bootstrap intervals (`lab.tools.bench_stats`) on tiny models and synthetic samples, and the llama.cpp row's
counters through a stand-in `llama_cpp` module (the package is an optional extra, not installed here). Speeds are
measured, never asserted: only how the figures relate."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from lab.app.builtin_prompts import load_prompts
from lab.app.validation import validate_request
from lab.params import InputError
from lab.tools.bench import HF_ROW, BenchResult, BenchRow, build_requests, format_table, run_bench, time_strategy
from lab.tools.bench_reference import LlamaCppRow, RunSample, time_hf_generate
from lab.tools.bench_stats import decode_only, mean_difference_interval, ratio_interval, row_figures, split_fields


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
        assert row.median_prefill_ms > 0 and row.median_decode_tokens_per_s > 0  # the split of every row
        assert (row.speedup_interval is None) == (row is result.rows[0])  # 2 prompts: intervals past the first
    assert result.config["n_prompts"] == 2 and result.config["dtype"] == "float32"
    assert result.config["choice"].endswith("as requested") and all(row.choice for row in result.rows)
    assert "dtype and precision: float32 activations, float weights" in format_table(result)
    assert calls[-1][:2] == (6, 6) and "prompt 2/2" in calls[-1][2]  # round-robin: hf-generate last
    assert [c[2].split()[0] for c in calls[1:4]] == names
    table = format_table(result)
    assert all(f"| {name} |" in table for name in names)
    assert "| prefill ms | decode tok/s | decode vs first |" in table
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


def test_labelled_rows_bench_one_strategy_twice_with_their_own_params() -> None:
    """`LABEL=NAME[@PRECISION]`: the label keys the row and its own --params; the strategy's params reach every
    row of it, and the label's win for that row."""
    rows = ["speculative", "short=speculative@int4"]
    overrides = {"speculative": {"gamma": "3", "max_ngram": "2"}, "short": {"gamma": "1"}}
    requests = build_requests(rows, ["hi"], 4, 0, "smollm2-135m", "cpu", "float32", overrides, precision="bf16")
    assert list(requests) == ["speculative", "short"]
    first, second = requests["speculative"][0], requests["short"][0]
    assert (first.params.gamma, second.params.gamma) == (3, 1)
    assert first.params.max_ngram == second.params.max_ngram == 2
    assert (second.strategy.name, second.precision, first.precision) == ("speculative", "int4", "bf16")
    for bad in (["=greedy"], ["x@int4=greedy"], ["a=greedy", "a=sample"], ["hf-generate=greedy"]):
        with pytest.raises(InputError, match="--strategies row|distinct"):
            build_requests(bad, ["hi"], 4, 0, "smollm2-135m", "cpu", "float32")
    with pytest.raises(InputError, match="nope"):
        build_requests(rows, ["hi"], 4, 0, "smollm2-135m", "cpu", "float32", {"nope": {"gamma": "1"}})


def _check_split(sample: RunSample) -> None:
    """prefill + (n - 1) / decode rate is the run's end-to-end wall time."""
    wall = sample.metrics["wall_s"]
    assert sample.new_tokens > 1 and 0 < sample.prefill_s < wall and sample.decode_tokens_per_s > 0
    assert sample.prefill_s + (sample.new_tokens - 1) / sample.decode_tokens_per_s == pytest.approx(wall, abs=2e-4)
    assert sample.tokens_per_s == pytest.approx(sample.new_tokens / wall, rel=1e-3)


def test_strategy_and_hf_generate_split_prefill_from_decode(tiny, one_thread) -> None:
    ids = tiny.encode("The lab decodes", chat=False)
    for name in ("greedy", "speculative"):
        request = validate_request(name, "x", {"max_new_tokens": 12}, device="cpu", dtype="float32")
        _check_split(time_strategy(request, tiny, ids))
    _check_split(time_hf_generate(tiny, ids, 12))


def _samples(rates: np.ndarray, prefill_s: float = 0.01, tokens: int = 9) -> list[RunSample]:
    """RunSamples of the given [prompts, repeats] decode rates (prompt by prompt, as the bench orders runs)."""
    out = []
    for rate in rates.reshape(-1):
        wall = prefill_s + (tokens - 1) / rate
        out.append(RunSample(tokens / wall, tokens, {"wall_s": wall}, "max_new_tokens", (), prefill_s, float(rate)))
    return out


def _rates(prompts: int, ratio: float, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A first row whose speed varies 4x across prompts, and a row `ratio` times as fast with multiplicative
    run-to-run noise; both [prompts, 3 repeats]."""
    rng = np.random.default_rng(seed)
    base = np.repeat(rng.uniform(25, 100, size=(prompts, 1)), 3, axis=1)
    other = ratio * base * np.exp(rng.normal(0, noise, size=base.shape))
    return base * np.exp(rng.normal(0, noise, size=base.shape)), other


def test_interval_contains_the_point_estimate_and_narrows_with_more_prompts() -> None:
    widths = []
    for prompts in (8, 64):
        base, other = _rates(prompts, 1.5, 0.1, seed=prompts)
        first, row = _samples(base), _samples(other)
        low, high = ratio_interval(first, row, prompts, decode_only)
        point = row_figures(row)["median_decode_tokens_per_s"] / row_figures(first)["median_decode_tokens_per_s"]
        assert low <= point <= high and low < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 1.5  # 8x the prompts: about a third of the width


def test_interval_is_paired_by_prompt() -> None:
    base, _ = _rates(24, 1.0, 0.0, seed=1)
    first, row = _samples(base), _samples(1.25 * base)  # every prompt 1.25x, prompts 4x apart
    assert ratio_interval(first, row, 24, decode_only) == [1.25, 1.25]  # unpaired resampling would be wide
    assert ratio_interval(first, row, 1, decode_only) is None  # one prompt: nothing to resample
    with pytest.raises(ValueError, match="prompts"):
        ratio_interval(first, row, 5)


def test_mean_difference_interval_is_paired_and_covers_the_mean() -> None:
    rng = np.random.default_rng(3)
    first = rng.uniform(1.5, 3.5, size=24)  # prompts far apart
    mean, interval = mean_difference_interval(first, first + 0.2)  # every prompt +0.2: no spread to resample
    assert mean == pytest.approx(0.2) and interval == pytest.approx([0.2, 0.2])
    noisy = first + rng.normal(0.1, 0.3, size=24)
    mean, (low, high) = mean_difference_interval(first, noisy)
    assert low < mean < high and mean == pytest.approx(float(np.mean(noisy - first)), abs=1e-4)
    assert mean_difference_interval([2.0], [2.5]) == (0.5, None)
    with pytest.raises(ValueError, match="paired"):
        mean_difference_interval([1.0, 2.0], [1.0])


def test_split_fields_of_first_and_other_rows() -> None:
    base, other = _rates(6, 2.0, 0.05, seed=3)
    first, row = _samples(base, prefill_s=0.02), _samples(other)
    own = split_fields(first, first, 6, None)
    assert own["decode_speedup"] == 1.0 and own["speedup_interval"] is None and own["median_prefill_ms"] == 20.0
    fields = split_fields(row, first, 6, own["median_decode_tokens_per_s"])
    assert fields["decode_speedup"] == pytest.approx(2.0, rel=0.1) and fields["median_prefill_ms"] == 10.0
    low, high = fields["decode_speedup_interval"]
    assert low <= fields["decode_speedup"] <= high
    one_token = [RunSample(50.0, 1, {"wall_s": 0.02}, "eos", (), 0.02, 0.0)] * 6  # no decode part
    assert split_fields(one_token, first, 6, 40.0)["median_decode_tokens_per_s"] == 0.0


def test_table_and_json_show_the_new_columns() -> None:
    rows = [
        BenchRow("greedy", 40.0, 1.0, 8.0, 1.0, 6, median_prefill_ms=12.5, median_decode_tokens_per_s=45.0),
        BenchRow("eagle", 60.0, 1.5, 8.0, 0.5, 6, median_prefill_ms=20.0, median_decode_tokens_per_s=70.0),
    ]
    rows[1].decode_speedup, rows[1].speedup_interval, rows[1].decode_speedup_interval = 1.556, [1.4, 1.6], [1.5, 1.7]
    config = {"model": "m", "device": "cpu", "dtype": "bfloat16", "threads": 2, "n_prompts": 6, "repeat": 3}
    table = format_table(BenchResult(config | {"max_new_tokens": 8}, rows))
    header = table.splitlines()[2]
    assert "prefill ms" in header and "decode tok/s" in header and "decode vs first" in header
    assert "| eagle | 60.00 | 1.500x [1.400, 1.600] | 20.0 | 70.00 | 1.556x [1.500, 1.700] |" in table
    row = json.loads(json.dumps(BenchResult(config, rows).as_dict(), allow_nan=False))["rows"][1]
    assert row["median_prefill_ms"] == 20.0 and row["decode_speedup_interval"] == [1.5, 1.7]


class _FakeLlama:
    """Shaped like llama_cpp.Llama as far as LlamaCppRow reaches: prefill costs 30 ms, each eval 4 ms."""

    def __init__(self, **kwargs) -> None:
        self.ctx = object()
        self.counters = types.SimpleNamespace(t_p_eval_ms=0.0, t_eval_ms=0.0, n_p_eval=0, n_eval=0)

    def reset(self) -> None:
        pass

    def generate(self, tokens, **kwargs):
        self.counters.t_p_eval_ms += 30.0
        self.counters.n_p_eval += len(tokens)
        token = 5
        while True:
            yield token  # like llama-cpp-python: the yielded token is evaluated only when the loop asks for more
            self.counters.t_eval_ms += 4.0
            self.counters.n_eval += 1
            token += 1


def _fake_llama_cpp(monkeypatch, counters: bool) -> _FakeLlama:
    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.__version__ = "0.0-fake"
    made: list[_FakeLlama] = []
    module.Llama = lambda **kwargs: made.append(_FakeLlama(**kwargs)) or made[-1]
    if counters:
        module.llama_perf_context = lambda ctx: made[-1].counters
        module.llama_perf_context_reset = lambda ctx: made[-1].counters.__init__(
            t_p_eval_ms=0.0, t_eval_ms=0.0, n_p_eval=0, n_eval=0
        )
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return made


@pytest.mark.parametrize("counters", [True, False], ids=["perf-counters", "no-counters"])
def test_llama_cpp_row_reads_its_own_counters(monkeypatch, counters: bool) -> None:
    made = _fake_llama_cpp(monkeypatch, counters)
    row = LlamaCppRow(types.SimpleNamespace(spec="model.gguf", eos_token_ids=(0,)), 64)
    for _ in range(2):  # the counters are reset before every run
        sample = row.time([1, 2, 3], 10)
        assert sample.new_tokens == 10 and sample.stop_reason == "max_new_tokens"
        if counters:  # 9 evals of 4 ms after the first token
            assert sample.prefill_s == pytest.approx(0.030) and sample.decode_tokens_per_s == pytest.approx(250.0)
            assert sample.metrics["llama_evals"] == 9 and made[0].counters.n_p_eval == 3
        else:  # the wall clock split at the first token
            _check_split(sample)
