"""The app's gradio-free logic: replay loading (fuzz-style) and frames, compare diffs, learn texts, presets,
parameter visibility, history, ZeroGPU wrapping, the Measure figures and the compare diff view."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lab.app import compare, history, learn, presets, replay, zerogpu
from lab.app.controls import dependencies, visibility
from lab.params import build_params, param_specs
from lab.trace import RunFinished, TokenEmitted, Trace, TraceError, to_json
from strategies import ORDER, REGISTRY
from visualizers.compare import diff_html
from visualizers.measure import (
    acceptance_speedup_figure,
    expected_speedup,
    quality_throughput_figure,
    selection_matrix_figure,
)
from visualizers.style import display_token


def _trace(texts: list[str], ids: list[int] | None = None, strategy: str = "greedy") -> Trace:
    ids = ids if ids is not None else list(range(len(texts)))
    pairs = enumerate(zip(ids, texts, strict=True))
    events = [TokenEmitted(i, tid, text, "target", 0.01 * (i + 1)) for i, (tid, text) in pairs]
    events.append(RunFinished(len(texts), "max_new_tokens", 0.01 * len(texts) + 0.01, 5, len(texts)))
    return Trace(strategy, "tiny", "a prompt", {"max_new_tokens": len(texts)}, events)


# --- replay: loading ---------------------------------------------------------------------------------------------


def _write(tmp_path: Path, data: bytes | str, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_load_trace_file_round_trips(tmp_path):
    trace = _trace(["a", "b", "c"])
    loaded = replay.load_trace_file(_write(tmp_path, to_json(trace)))
    assert loaded.text == "abc" and loaded.strategy == "greedy" and len(loaded.events) == 4


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        ("{not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON|nested"),
        (json.dumps({"a": [[[[[[[[[[[1]]]]]]]]]]]}), "nested deeper"),
        (json.dumps({"format": "something-else", "version": 1}), "not a Decoding Lab trace"),
        ("NaN", "not valid JSON|not allowed"),
        ('{"__class__": "os.system", "args": ["rm -rf /"]}', "not a Decoding Lab trace"),
    ],
)
def test_load_trace_file_rejects_hostile_input_with_a_clear_message(tmp_path, data, message):
    with pytest.raises(TraceError, match=message):
        replay.load_trace_file(_write(tmp_path, data))


def test_load_trace_file_caps_the_size_before_reading(tmp_path):
    path = _write(tmp_path, " " * 2000)
    with pytest.raises(TraceError, match="limited to 1,000 bytes"):
        replay.load_trace_file(path, max_bytes=1000)


def test_load_trace_file_rejects_missing_and_non_files(tmp_path):
    with pytest.raises(TraceError, match="no file"):
        replay.load_trace_file(None)
    with pytest.raises(TraceError, match="cannot be read"):
        replay.load_trace_file(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="not a regular file"):
        replay.load_trace_file(tmp_path)


def test_load_trace_file_fuzz_mutations_raise_only_trace_errors(tmp_path):
    """Random byte flips, truncations and field swaps of a real trace: a Trace or a TraceError, nothing else."""
    text = to_json(_trace(["x", "y", "z", "w"]))
    rng = random.Random(0)
    outcomes = {"ok": 0, "rejected": 0}
    for i in range(300):
        data = bytearray(text.encode("utf-8"))
        for _ in range(rng.randint(1, 4)):
            choice = rng.random()
            position = rng.randrange(max(len(data), 1))
            if choice < 0.4 and data:
                data[position] = rng.randrange(256)
            elif choice < 0.7:
                data = data[:position]
            else:
                data[position:position] = rng.choice([b"[", b"{", b'"', b"1e999", b"-", b"null", b","])
        try:
            loaded = replay.load_trace_file(_write(tmp_path, bytes(data), f"f{i}.json"))
            assert isinstance(loaded, Trace)
            outcomes["ok"] += 1
        except TraceError as error:
            assert str(error)
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 200


def test_example_traces_load_and_replay_to_their_text():
    examples = replay.example_traces()
    assert {"greedy", "speculative"} <= {label for label, _ in examples}
    for _label, path in examples:
        trace = replay.load_trace_file(path)
        assert trace.strategy in REGISTRY
        last = replay.frame_count(trace)
        assert replay.events_at(trace, 0) == [] and replay.events_at(trace, last) == trace.events
        assert replay.trace_at(trace, last).text == trace.text and trace.text


# --- replay: frames -------------------------------------------------------------------------------------------


def test_frames_cut_where_the_step_changes():
    trace = _trace(["a", "b"])
    # TokenEmitted steps 0, 1 then RunFinished step 2: frames [], [a], [a, b], [a, b, finished]
    assert replay.frame_cuts(trace.events) == [0, 1, 2, 3]
    assert replay.frame_count(trace) == 3
    assert replay.events_at(trace, 1) == trace.events[:1]
    assert replay.events_at(trace, 99) == trace.events and replay.events_at(trace, -5) == []
    assert replay.frame_of_step(trace, 1) == 2


def test_frames_group_several_events_of_one_step():
    events = [TokenEmitted(0, 1, "a", "accepted", 0.1), TokenEmitted(0, 2, "b", "bonus", 0.1)]
    events.append(TokenEmitted(1, 3, "c", "target", 0.2))
    assert replay.frame_cuts(events) == [0, 2, 3]


# --- compare --------------------------------------------------------------------------------------------------


def test_token_diff_and_divergence():
    base, other = _trace(["The", " sky", " is", " blue"], [1, 2, 3, 4]), _trace(["The", " sea", " is"], [1, 9, 3])
    blocks = compare.token_diff(base, other)
    assert [b.op for b in blocks] == ["equal", "replace", "equal", "delete"]
    assert blocks[1].a_text == " sky" and blocks[1].b_text == " sea"
    assert compare.first_divergence(base, other) == 1
    assert compare.first_divergence(base, base) is None
    assert compare.first_divergence(base, _trace(["The"], [1])) == 1
    assert compare.agreement(base, other) == 0.5 and compare.agreement(base, base) == 1.0


def test_compare_rows_and_markdown():
    rows = compare.compare_rows([_trace(["a", "b"], [1, 2]), _trace(["a", "c"], [1, 3], strategy="sample")])
    assert rows[0]["agreement with first"] == 1.0 and rows[1]["first difference at"] == 1
    table = compare.rows_markdown(rows)
    assert table.count("\n") == 3 and "| sample |" in table


def test_diff_html_escapes_and_marks_changes():
    base, other = _trace(["<b>", "x"], [1, 2]), _trace(["<b>", "y"], [1, 3], strategy="sample")
    page = diff_html("greedy", {"sample": compare.token_diff(base, other)})
    assert "<b>" not in page.replace("<b>sample</b>", "").replace("<b>greedy</b>", "")
    assert "&lt;b&gt;" in page and "dl-diff-del" in page and "dl-diff-ins" in page
    assert "identical output" in diff_html("greedy", {"greedy2": compare.token_diff(base, base)})


def test_display_token_leaves_quotes_for_plotly():
    assert display_token('say "hi" <b>') == 'say␣"hi"␣&lt;b&gt;'


# --- learn ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_learn_has_every_planned_strategy_in_both_languages(lang):
    entries = learn.load_entries(lang)
    for name in ORDER:
        entry = entries[name]
        for field in ("title", "idea", "formula", "paper", "watch", "problem", "operation", "when"):
            assert entry.get(field, "").strip(), f"{lang}/{name} lacks {field}"
        page = learn.learn_markdown(name, lang)
        assert "$$" in page and entry["title"] in page


def test_learn_chinese_is_translated_and_falls_back_for_formulas():
    english, chinese = learn.load_entries("en"), learn.load_entries("zh")
    for name in ORDER:
        assert chinese[name]["idea"] != english[name]["idea"]
        assert chinese[name]["formula"] == english[name]["formula"]
    assert learn.matrix_headings("中文")[0] == "解决的问题"


def test_learn_falls_back_to_the_registry_for_unknown_strategies():
    page = learn.learn_markdown("brand-new", "en", fallback=("A summary.", "Someone 2030"))
    assert "A summary." in page and "Someone 2030" in page
    assert "No text" in learn.learn_markdown("brand-new", "en")


# --- presets and parameter visibility ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REGISTRY))
def test_presets_of_every_registered_strategy_validate(name):
    params_cls = REGISTRY[name].Params
    names = presets.presets_for(name, params_cls)
    assert names[0] == presets.DEFAULTS
    assert len(names) == 1 + len(presets.CURATED.get(name, {})), "a curated preset names an unknown parameter"
    for preset in names:
        values = presets.preset_values(name, params_cls, preset)
        build_params(params_cls, values)


def test_preset_values_fill_every_parameter():
    values = presets.preset_values("sample", REGISTRY["sample"].Params, "focused (T=0.3, top-p 0.9)")
    assert values["temperature"] == 0.3 and values["top_p"] == 0.9 and "max_new_tokens" in values


def test_visibility_hides_parameters_without_effect():
    params = REGISTRY["speculative"].Params
    shown = visibility(params, {"drafter": "prompt-lookup"})
    assert shown["max_ngram"] and not shown["draft_layers"] and not shown["draft_model"] and shown["gamma"]
    shown = visibility(params, {"drafter": "self-draft"})
    assert shown["draft_layers"] and not shown["max_ngram"]
    dola = REGISTRY["dola"].Params
    assert not visibility(dola, {})["top_k"] and visibility(dola, {"temperature": 0.7})["top_k"]
    assert not visibility(dola, {})["soft_alpha"] and visibility(dola, {"mode": "soft"})["soft_alpha"]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_visibility_rules_name_real_parameters(name):
    params_cls = REGISTRY[name].Params
    fields = set(visibility(params_cls, {}))
    for rule in dependencies(params_cls).values():
        assert rule.controller in fields and rule.field in fields and rule.controller != rule.field


def test_visibility_rules_are_declared_on_the_fields_and_name_real_choices():
    """Every `only_when` names another parameter of the same strategy and values it can take (a choice, or > 0 for
    a number), and the rules are exactly the declared ones (no help text is parsed)."""
    for name, strategy in REGISTRY.items():
        specs = {spec.name: spec for spec in param_specs(strategy.Params)}
        for field, rule in dependencies(strategy.Params).items():
            assert specs[field].only_when is not None, (name, field)
            controller = specs[rule.controller]
            if rule.positive:
                assert controller.type in ("int", "float"), (name, field)
            else:
                assert rule.values and set(rule.values) <= set(controller.choices or ()), (name, field)
    declared = {(n, f) for n, s in REGISTRY.items() for f in dependencies(s.Params)}
    assert ("speculative", "draft_layers") in declared and ("dola", "top_k") in declared
    assert ("sample", "top_k") not in declared  # sample's help texts never hide anything


# --- history --------------------------------------------------------------------------------------------------


def test_history_is_newest_first_bounded_and_deduplicated():
    records: list[dict] = []
    for i in range(history.MAX_HISTORY + 5):
        records = history.add_run(records, _trace(["a"]), f"/tmp/{i}.json", run_id=f"run{i}")
    assert len(records) == history.MAX_HISTORY and records[0]["path"].endswith(f"{history.MAX_HISTORY + 4}.json")
    assert history.add_run(records, _trace(["a"]), "/tmp/x.json", run_id=records[0]["run"]) == records
    assert history.find_run(records, records[3]["id"]) is records[3] and history.find_run(records, -1) is None
    assert history.history_choices(records)[0][1] == records[0]["id"]


# --- ZeroGPU --------------------------------------------------------------------------------------------------


def test_gpu_function_is_identity_off_zero_gpu(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert zerogpu.gpu_function(len, 10) is len and not zerogpu.zero_gpu_enabled()


def test_gpu_function_survives_a_missing_spaces_package(monkeypatch):
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setattr(zerogpu, "_spaces_module", lambda: None)
    assert zerogpu.gpu_function(len, 10) is len


def test_gpu_function_wraps_with_spaces_gpu(monkeypatch):
    calls = []

    class FakeSpaces:
        @staticmethod
        def GPU(duration):  # noqa: N802 (the spaces API)
            calls.append(duration)
            return lambda fn: ("wrapped", fn)

    monkeypatch.setenv("SPACES_ZERO_GPU", "1")
    monkeypatch.setattr(zerogpu, "_spaces_module", lambda: FakeSpaces)
    assert zerogpu.gpu_function(len, 42) == ("wrapped", len) and calls == [42]


# --- Measure figures ------------------------------------------------------------------------------------------


def test_expected_speedup_formula():
    assert expected_speedup(0.0, 4, 0.0) == 1.0
    assert expected_speedup(0.0, 4, 0.25) == pytest.approx(0.5)
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_speedup(1.0, 4, 0.0) == 5.0


ROWS = [
    {
        "name": "greedy",
        "family": "baseline",
        "tokens_per_s": 40.0,
        "speedup": 1.0,
        "quality": -0.4,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "gamma": None,
    },
    {
        "name": "speculative",
        "family": "speculative",
        "tokens_per_s": 52.0,
        "speedup": 1.3,
        "quality": -0.4,
        "acceptance_rate": 0.62,
        "mean_accepted_length": 2.1,
        "gamma": 6,
    },
    {
        "name": "sample",
        "family": "baseline",
        "tokens_per_s": 38.0,
        "speedup": 0.95,
        "quality": None,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "gamma": None,
    },
]


def test_measure_figures_draw_only_measured_values():
    quality = quality_throughput_figure(ROWS)
    assert sorted(x for trace in quality.data for x in trace.x) == [40.0, 52.0]  # sample has no quality
    accept = acceptance_speedup_figure(ROWS)
    measured = [t for t in accept.data if t.name == "measured"][0]
    assert list(measured.x) == [0.62] and list(measured.y) == [1.3]
    assert sum(1 for t in accept.data if t.name and t.name.startswith("theory γ=6")) == 3
    matrix = selection_matrix_figure(ROWS, {"greedy": ("p", "o", "w")}, ("problem", "operation", "when"))
    cells = matrix.data[0].cells.values
    assert list(cells[0]) == ["greedy", "speculative", "sample"] and cells[2][0] == "p"
    assert "1.30x" in cells[4][1]


def test_measure_figures_explain_missing_data():
    assert quality_throughput_figure([]).layout.annotations[0].text == "Run the benchmark first"
    assert "No speculative" in acceptance_speedup_figure(ROWS[:1]).layout.annotations[0].text
