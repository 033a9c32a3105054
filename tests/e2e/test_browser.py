"""The lab in a real browser (Debian Chromium through Playwright), against `python app.py` on 127.0.0.1.

One page for the module, used like a student would: open the page, run greedy and watch the plot update live,
download its trace, click a token to see its alternatives, run prompt-lookup speculative decoding and watch its
draft rounds grow, start a long run and press Stop (Replay: test_replay.py). Each step saves a full-page
screenshot (see conftest.py). Budgets are tiny
(max_new_tokens 4-32) so the module stays within a few minutes on 2 shared cores.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from lab.methods.rlm import tasks
from lab.trace import ReplCall, RlmContext, RlmResult, TokenEmitted, from_json
from strategies import REGISTRY
from tests.e2e import ui

pytestmark = [pytest.mark.e2e, pytest.mark.embedded]

GREEDY_TOKENS = 24
GREEDY_PROMPT = "Name three colours and say one thing about each."
LOOKUP_PROMPT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog near the river bank."
STORY_PROMPT = "Write a long story about a dragon who learns to bake bread."
PROB_TOLERANCE = 1e-4  # the alternatives table shows probabilities rounded to 4 digits


def run_and_watch(page, plot_id: str = "main-plot") -> tuple[str, list[str]]:
    """Click Run, record every distinct state of the plot until the run's trace file appears."""
    previous = ui.trace_file_name(page)
    ui.start_recording_plot(page, plot_id)
    ui.button(page, "run-button").click()
    name = ui.wait_for_new_trace(page, previous)
    page.wait_for_timeout(300)  # let the final figure draw
    return name, ui.recorded_plot_states(page)


def draw_a_first_figure(page) -> None:
    """A 2-token run, then wait until its figure is drawn: Gradio loads plotly.js with the first figure, which can
    take seconds on a loaded CPU, longer than the recorded run streams."""
    ui.set_number(page, "max-new-tokens", 2)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_for_new_trace(page, previous)
    ui.wait_until(lambda: ui.plot_data(page, "main-plot"), "the first figure to be drawn", 120, page)


def download_trace(page, artifacts, name: str):
    with page.expect_download() as info:
        page.locator(f'#trace-file a[data-testid="download-link"][download="{name}"]').click()
    path = artifacts / name
    info.value.save_as(path)
    return path, from_json(path.read_text(encoding="utf-8"))


def tokens_of(trace) -> list[TokenEmitted]:
    return [e for e in trace.events if isinstance(e, TokenEmitted)]


@pytest.fixture(scope="module")
def greedy_run(page, artifacts):
    """Greedy, GREEDY_TOKENS tokens: the plot states seen while it streamed and its downloaded trace."""
    ui.prompt_box(page).fill(GREEDY_PROMPT)
    draw_a_first_figure(page)
    ui.set_number(page, "max-new-tokens", GREEDY_TOKENS)
    name, states = run_and_watch(page)
    path, trace = download_trace(page, artifacts, name)
    return {"states": states, "trace": trace, "path": path, "text": ui.output_text(page)}


def test_page_opens_with_the_controls(page, screenshot):
    """Gradio renders the page in pieces after fetching its config: each control is waited for (up to a minute),
    then checked, so a slow first render on a loaded CPU is not a failure."""
    assert page.title() == "Decoding Lab"
    for name in ("Run", "Compare", "Replay", "Learn", "Measure"):
        expect(page.get_by_role("tab", name=name, exact=True)).to_be_visible(timeout=60_000)
    expect(ui.button(page, "run-button")).to_be_visible(timeout=60_000)
    expect(ui.button(page, "stop-button")).to_be_visible(timeout=60_000)
    assert ui.prompt_box(page).is_editable()
    assert ui.dropdown_value(page, "strategy").endswith("greedy")
    screenshot(page, "01-start")


def test_first_contact_a_default_prompt_examples_in_sight_and_out_of_range_input_clamped(page):
    """1280 x 720: a prompt to run is there and example prompts are on screen; max_new_tokens 5000 / 0 and
    temperature 7 typed into their boxes are clamped with a note naming the field; an empty prompt is refused once,
    where the stats go, naming what is missing (no toast, no Error badges)."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.evaluate("window.scrollTo(0, 0)")
    assert ui.prompt_box(page).input_value().strip(), "the prompt starts empty"
    examples = ui.box(page, "#example-prompts")
    assert examples and examples["y"] + 40 < 720, f"the example prompts are not on screen: {examples}"
    box = page.locator("#max-new-tokens input[type=number]")
    ui.wait_until(lambda: page.evaluate("window.__dlClamp === true"), "the page's scripts", 30, page)
    for typed, shown, note in (("5000", "1024", "above the maximum 1024"), ("0", "1", "below the minimum 1")):
        ui.set_number(page, "max-new-tokens", typed)
        ui.wait_until(lambda shown=shown: box.input_value() == shown, f"{typed} clamped to {shown}", 10, page)
        assert page.locator("#max-new-tokens input[type=range]").input_value() == shown
        assert f"max_new_tokens: {typed} is {note}" in page.locator("#max-new-tokens").inner_text()
    ui.choose(page, "strategy", re.compile(r"› sample$"))
    slider = page.locator("input[type=number][aria-label='number input for temperature']").filter(visible=True)
    temperature = page.locator(".block", has=slider).filter(visible=True).last
    temperature.locator("input[type=number]").fill("7")
    temperature.locator("input[type=number]").press("Enter")
    ui.wait_until(lambda: "temperature: 7 is above the maximum 2" in temperature.inner_text(), "the note", 10, page)
    assert temperature.locator("input[type=number]").input_value() == "2"
    ui.choose(page, "strategy", re.compile(r"› greedy$"))
    ui.prompt_box(page).fill("   ")
    ui.button(page, "run-button").click()
    ui.wait_until(lambda: "Cannot run" in page.locator("#stats").inner_text(), "the refusal", 30, page)
    assert "prompt is empty" in page.locator("#stats").inner_text()
    page.wait_for_timeout(500)
    assert error_badges(page) == 0 and page.locator(".toast-body").count() == 0
    page.set_viewport_size({"width": 1400, "height": 1000})


def test_greedy_streams_a_live_plot_and_a_valid_trace(page, greedy_run, screenshot):
    states, trace = greedy_run["states"], greedy_run["trace"]
    # loading placeholder, at least one partial figure while tokens streamed, and the final figure
    assert len(states) >= 3, f"the plot changed only {len(states)} times during the run"
    assert trace.strategy == "greedy" and trace.prompt == GREEDY_PROMPT
    emitted = tokens_of(trace)
    assert 1 <= len(emitted) <= GREEDY_TOKENS and trace.text == greedy_run["text"] and trace.text.strip()
    assert ui.token_spans(page).count() == len(emitted)
    assert {s.get_attribute("data-source") for s in ui.token_spans(page).all()} == {"target"}
    stats = page.locator("#stats").inner_text()
    assert "tokens/s" in stats and re.search(r"\b(max_new_tokens|eos)\b", stats), stats
    screenshot(page, "02-greedy")


def test_clicking_a_token_shows_its_alternatives(page, greedy_run, screenshot):
    """Step 2's top-k: the alternatives table and the inspector's bars show the trace's probabilities."""
    step = tokens_of(greedy_run["trace"])[2]
    page.locator(f'#token-view span.dl-token[data-step="{step.step}"]').click()
    expected = step.top_probs

    def table_matches():
        rows = ui.table_rows(page, "alternatives")
        probs = [float(row[2]) for row in rows if len(row) > 2 and re.fullmatch(r"[0-9.e-]+", row[2])]
        if len(probs) != len(expected):
            return False
        return all(abs(a - b) <= PROB_TOLERANCE for a, b in zip(probs, expected, strict=True))

    ui.wait_until(table_matches, f"step {step.step}'s alternatives in the table", 60, page)
    assert page.locator("#inspect-step input").input_value() == str(step.step)
    bars = ui.wait_until(lambda: ui.plot_data(page, "inspect-token-plot"), "the inspector figure", 30, page)
    assert [round(x, 4) for x in bars["traces"][0]["x"]] == [round(p, 4) for p in expected]
    screenshot(page, "03-token-alternatives")


def test_prompt_lookup_speculative_draws_its_rounds_live(page, artifacts, screenshot):
    """...after a greedy run of the same prompt, whose speed the speculative run's stats compare against."""
    ui.prompt_box(page).fill(LOOKUP_PROMPT)
    ui.set_number(page, "max-new-tokens", 32)
    run_and_watch(page)  # greedy
    ui.choose(page, "strategy", re.compile(r"› speculative$"))
    assert page.get_by_label("drafter", exact=True).input_value() == "prompt-lookup"
    name, states = run_and_watch(page)
    assert len(states) >= 3, f"the draft-round plot changed only {len(states)} times during the run"
    assert ui.plot_data(page, "main-plot")["title"].startswith("Draft rounds")
    _, trace = download_trace(page, artifacts, name)
    assert trace.strategy == "speculative" and trace.params["drafter"] == "prompt-lookup"
    sources = {s.get_attribute("data-source") for s in ui.token_spans(page).all()}
    assert sources == {e.source for e in tokens_of(trace)}
    first, *rest = tokens_of(trace)
    assert first.source == "target"  # the first token comes from the prefill forward, as in greedy decoding
    assert {e.source for e in rest} <= {"accepted", "recovered", "bonus"} and sources & {"recovered", "bonus"}
    stats = ui.wait_until_stable(page, lambda: page.locator("#stats").inner_text(), quiet_ms=500)
    assert "acceptance" in stats and re.search(r"acceptance α\s+τ.*\n.*\b\d\.\d\d\s+\d+\.\d\d\b", stats), stats
    speedup = re.search(r"Speed: (\d+\.\d\d)x greedy \((\d+\.\d) tok/s on this prompt\)(; .*)?", stats)
    assert speedup, f"no speedup against the greedy run in the stats: {stats}"
    if float(speedup.group(1)) < 1.0:
        assert "greedy decode steps" in speedup.group(3), stats
    assert not ui.figure_problems(page, name="speculative (live)"), ui.figure_problems(page, name="speculative (live)")
    screenshot(page, "04-speculative")


def error_badges(page) -> int:
    """Gradio's red "Error" status badges on the page (an output whose event failed or was cancelled)."""
    return page.locator(".error", has_text=re.compile(r"^\s*Error\s*$")).count()


def test_stop_ends_a_long_run_as_a_result_and_the_next_run_works(page, artifacts, screenshot):
    """Stop mid-run: no Error badge; the partial run stays with every view, says "stopped by you", can be inspected,
    branched from and downloaded; then the next run works."""
    ui.choose(page, "strategy", re.compile(r"› greedy$"))
    ui.prompt_box(page).fill(STORY_PROMPT)
    ui.set_number(page, "max-new-tokens", 1000)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_until(lambda: len(ui.output_text(page)) >= 30, "streamed text", page=page)
    ui.button(page, "stop-button").click()
    name = ui.wait_for_new_trace(page, previous, timeout_s=60)  # the stopped run's final update
    ui.wait_until(lambda: "stopped by you" in page.locator("#stats").inner_text(), "the stop in the stats", 30, page)
    page.wait_for_timeout(500)
    screenshot(page, "05-stopped")
    assert error_badges(page) == 0, "a stopped run is a result, not an error"
    _, trace = download_trace(page, artifacts, name)
    count = ui.token_spans(page).count()
    assert 1 <= count < 1000 and len(tokens_of(trace)) == count
    assert trace.events[-1].stop_reason == "cancelled" and trace.text == ui.output_text(page)
    ui.wait_until(lambda: (ui.plot_data(page, "main-plot") or {}).get("traces"), "the partial run's figure", 60, page)
    step = tokens_of(trace)[1]
    page.locator(f'#token-view span.dl-token[data-step="{step.step}"]').click()
    ui.wait_until(lambda: "Branch at token 2" in page.locator("#branch-where").inner_text(), "branch choices", 30, page)
    inspected = page.locator("#inspect-step input")
    ui.wait_until(lambda: inspected.input_value() == str(step.step), "the inspector", 30, page)
    ui.set_number(page, "max-new-tokens", 4)
    ui.button(page, "run-button").click()
    ui.wait_for_new_trace(page, name)
    assert 1 <= ui.token_spans(page).count() <= 4
    assert error_badges(page) == 0


def test_system_2_runs_say_what_they_need_and_what_they_did(page, artifacts, screenshot):
    """Tree of Thoughts: an empty prompt is told it needs the Game of 24 hand, and the stats count the model calls
    and tokens its figure's title counts (no tokens/s). RLM: the prompt is the question asked, the task's own only
    when chosen (its button writes it into the prompt); while it runs the token view and stats count root turns
    and sub-calls; at the end the stats put the answer beside the expected one; figure text shows quotes as
    quotes."""
    ui.choose(page, "strategy", re.compile(r"› tot$"))
    ui.prompt_box(page).fill("")
    ui.button(page, "run-button").click()
    ui.wait_until(
        lambda: "Game of 24 hand" in page.locator("#stats").inner_text(), "ToT's empty prompt refused", 60, page
    )
    ui.prompt_box(page).fill("4 9 10 13")
    ui.set_number(page, "param-tot-k", 3)
    ui.set_number(page, "param-tot-breadth", 2)
    ui.set_number(page, "max-new-tokens", 16)
    run_and_watch(page)
    stats = ui.wait_until_stable(page, lambda: ui.stats_table(page), quiet_ms=500)
    title = ui.plot_data(page, "main-plot")["title"].replace("<br>", " ")
    calls, tokens = re.search(r"(\d+) model calls · ([\d,]+) tokens", title).groups()
    assert (stats.get("model calls"), stats.get("tokens run")) == (calls, tokens), (stats, title)
    assert "tokens/s" not in stats and "forwards/token" not in stats, stats
    page.wait_for_timeout(1000)  # let plotly finish every layout
    assert not ui.figure_problems(page, name="tot (live)"), ui.figure_problems(page, name="tot (live)")

    ui.choose(page, "strategy", re.compile(r"› rlm$"))
    ui.set_number(page, "param-rlm-context_tokens", 1000)
    ui.set_number(page, "param-rlm-max_iterations", 2)
    ui.prompt_box(page).fill("Describe the logs.")
    ui.button(page, "rlm-task-prompt").click()
    own = tasks.make_task("needle", 1000, 0)
    ui.wait_until(lambda: ui.prompt_box(page).input_value() == own.question, "the task's question in the prompt")
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_until(lambda: "Working:" in page.locator("#token-view").inner_text(), "the live progress line", 120, page)
    assert "root turns" in ui.stats_table(page) and ui.trace_file_name(page) == previous
    name = ui.wait_for_new_trace(page, previous)
    stats = ui.wait_until_stable(page, lambda: ui.stats_table(page), quiet_ms=500)
    _, trace = download_trace(page, artifacts, name)
    context = next(e for e in trace.events if isinstance(e, RlmContext))
    result = next(e for e in trace.events if isinstance(e, RlmResult))
    assert context.question == own.question and stats["expected"] == own.answer, stats
    assert stats["verdict"] == ("correct" if result.correct else "wrong") and stats["answer"], stats
    calls = [e for e in trace.events if isinstance(e, ReplCall)]
    assert stats["root turns"] == str(sum(c.role == "root" for c in calls)), stats
    assert stats["sub-calls"] == str(sum(c.role == "sub" for c in calls)), stats
    drawn = page.evaluate("() => document.querySelector('#main-plot').textContent")
    assert "&quot;" not in drawn and "&#x27;" not in drawn and "&amp;" not in drawn
    page.wait_for_timeout(1000)
    assert not ui.figure_problems(page, name="rlm (live)"), ui.figure_problems(page, name="rlm (live)")
    screenshot(page, "06-rlm")


def test_compare_stop_ends_the_comparison_as_a_result(page):
    """The Compare tab's own Stop: no Error badge; the run in progress keeps its tokens and says "stopped by you",
    the runs after it do not start, and the summary covers the run there is."""
    ui.tab(page, "Compare")
    page.locator("#compare-prompt textarea").fill(STORY_PROMPT)
    ui.set_number(page, "compare-tokens-max", 256)
    ui.button(page, "compare-run").click()
    first = page.locator("#compare-tokens-0 span.dl-token")
    ui.wait_until(lambda: first.count() >= 5, "the first column's tokens", page=page)
    ui.button(page, "compare-stop").click()
    summary = page.locator("#compare-summary")
    ui.wait_until(lambda: "greedy" in summary.inner_text(), "the summary of the stopped comparison", 60, page)
    assert error_badges(page) == 0, "a stopped comparison is a result, not an error"
    assert "stopped by you" in page.locator("#compare-stats-0").inner_text()
    assert 5 <= first.count() < 256
    assert page.locator("#compare-tokens-1 span.dl-token").count() == 0  # the next run never started
    ui.tab(page, "Run")


LIVE_CHECKED_ELSEWHERE = {"speculative", "tot", "rlm"}  # their own tests above check their live figures


def test_every_strategys_live_figures_fit(page):
    """A short live run of each strategy (the ones not checked above): in every drawn figure, measured from the SVG,
    no text is cut by its figure, no title or legend covers other text and no tick labels crowd each other."""
    ui.tab(page, "Run")
    ui.prompt_box(page).fill(GREEDY_PROMPT)
    found = []
    for name in [n for n in REGISTRY if n not in LIVE_CHECKED_ELSEWHERE]:
        ui.choose(page, "strategy", re.compile(rf"› {name}$"))
        ui.set_number(page, "max-new-tokens", 6)
        run_and_watch(page)
        ui.wait_until(lambda: ui.text_boxes(page, "main-plot"), f"{name}'s figure", 60, page)
        page.wait_for_timeout(1500)  # let plotly finish every layout
        found += ui.figure_problems(page, name=f"{name} (live)")
    assert not found, "\n".join(found[:30])
