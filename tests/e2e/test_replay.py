"""Replay in the browser: upload a recorded trace and play it step by step; a hostile file is refused with a clear
message. No model is loaded (DECODING_LAB_NO_WARM=1): replay must work without one.

The uploaded file is the shipped example `examples/traces/speculative.json` (recorded from a real run), so the
draft-round view is replayed round by round.
"""

from __future__ import annotations

import pytest

from lab.trace import TokenEmitted, from_json
from tests.appserver import ROOT
from tests.e2e import ui

pytestmark = [pytest.mark.e2e]

APP_ENV = {"DECODING_LAB_NO_WARM": "1"}
EXAMPLE = ROOT / "examples" / "traces" / "speculative.json"


@pytest.fixture(scope="module")
def example():
    trace = from_json(EXAMPLE.read_text(encoding="utf-8"))
    return trace, sum(isinstance(e, TokenEmitted) for e in trace.events)


def replayed_tokens(page) -> int:
    return ui.token_spans(page, "replay-").count()


def upload_and_play(page, trace, total: int) -> None:
    """Upload the example on the Replay tab, check it is shown whole, then press Play (from the end: restart)."""
    ui.tab(page, "Replay")
    page.locator("#trace-upload input[type=file]").set_input_files(str(EXAMPLE))
    ui.wait_until(lambda: "Uploaded trace" in page.locator("#replay-status").inner_text(), "the upload", 60, page)
    assert trace.strategy in page.locator("#replay-status").inner_text()
    ui.wait_until(lambda: replayed_tokens(page) == total, "the whole trace", 30, page)
    assert ui.output_text(page, "replay-") == trace.text
    figure = ui.wait_until(lambda: ui.plot_data(page, "replay-main-plot"), "the replayed main view", 30, page)
    assert figure["title"].startswith("Draft rounds")

    ui.start_recording_plot(page, "replay-main-plot")
    ui.button(page, "replay-play").click()  # at the end: plays again from step 0


def test_replay_an_uploaded_trace_step_by_step(page, example, screenshot):
    trace, total = example
    assert total >= 8, "the example trace is too short to watch it play"
    upload_and_play(page, trace, total)
    ui.wait_until(lambda: 0 < replayed_tokens(page) < total // 2, "playback to restart", 60, page)
    screenshot(page, "06-replay")
    ui.wait_until(lambda: replayed_tokens(page) == total, "playback to reach the end", 120, page)
    assert len(ui.recorded_plot_states(page)) >= 3, "the replayed plot did not move step by step"
    assert ui.output_text(page, "replay-") == trace.text


def test_a_hostile_trace_upload_gets_a_clear_message(page, example, artifacts):
    """A 100,000-deep JSON array: refused with the loader's message; the replay keeps its trace."""
    ui.tab(page, "Replay")
    before = replayed_tokens(page)
    hostile = artifacts / "hostile-trace.json"
    hostile.write_text("[" * 100_000 + "]" * 100_000)
    clear = page.locator("#trace-upload button[aria-label='Clear']")
    if clear.count():
        clear.click()
    page.locator("#trace-upload input[type=file]").set_input_files(str(hostile))
    ui.wait_until(lambda: page.get_by_text("Cannot replay this file").count(), "the refusal message", 30, page)
    assert replayed_tokens(page) == before, "a refused file must leave the replay as it was"


def test_replay_an_uploaded_trace_with_play_and_pause(page, example, screenshot):
    trace, total = example
    assert total >= 8, "the example trace is too short to play and pause"
    page.reload()  # a fresh session: the upload box of the earlier tests still holds their file
    page.get_by_label("Prompt", exact=True).wait_for()
    upload_and_play(page, trace, total)
    ui.wait_until(lambda: 0 < replayed_tokens(page) < total // 2, "playback to restart and move", 60, page)
    ui.button(page, "replay-pause").click()
    paused = ui.wait_until_stable(page, lambda: replayed_tokens(page), quiet_ms=2500)
    assert paused < total, "playback kept going after Pause"
    assert len(ui.recorded_plot_states(page)) >= 2, "the replayed plot did not move step by step"
    screenshot(page, "06-replay")
    ui.button(page, "replay-play").click()
    ui.wait_until(lambda: replayed_tokens(page) == total, "playback to resume to the end", 120, page)
