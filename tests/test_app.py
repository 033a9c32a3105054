"""The app through gradio_client against a launched server (docs/architecture.md section 11)."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest
from gradio_client import Client

import app
from lab.trace import from_json

pytestmark = pytest.mark.embedded


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def client():
    demo = app.build_app()
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()


def submit(client: Client, strategy: str = "greedy", prompt: str = "Name three colours.", **kwargs):
    args = {
        "model": "smollm2-135m",
        "strategy": strategy,
        "prompt": prompt,
        "chat": True,
        "max_new_tokens": 24,
        "seed": 0,
        "params_json": "",
    }
    args.update(kwargs)
    return client.submit(*args.values(), api_name="/run")


def test_run_streams_updates_and_returns_text_and_trace(client):
    job = submit(client, max_new_tokens=48)
    final = job.result(timeout=300)
    updates = job.outputs()
    assert len(updates) >= 2, "expected at least the loading update and the final one"
    html, _figure, stats, text, trace_json, _file, *_details = final
    assert text.strip()
    trace = from_json(trace_json)
    assert trace.strategy == "greedy" and trace.text == text
    assert "tokens/s" in stats and "dl-" in html


def test_sample_params_json_is_applied(client):
    job = submit(client, strategy="sample", params_json='{"temperature": 0.5, "top_k": 5}', max_new_tokens=8)
    trace = from_json(job.result(timeout=300)[4])
    assert trace.params["temperature"] == 0.5 and trace.params["top_k"] == 5


def test_stop_cancels_and_server_keeps_serving(client):
    job = submit(client, strategy="sample", prompt="Write a long story about a dragon.", max_new_tokens=1024)
    deadline = time.time() + 120
    while len(job.outputs()) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert len(job.outputs()) >= 3, "the run should stream before it is stopped"
    job.cancel()
    time.sleep(1.0)
    streamed = len(job.outputs())
    time.sleep(2.0)
    assert len(job.outputs()) == streamed, "no updates after cancel"
    text = submit(client, max_new_tokens=8).result(timeout=300)[3]
    assert text.strip()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "x" * 20_000}, "characters"),
        ({"strategy": "no-such-strategy"}, "Unknown strategy"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"strategy": "sample", "params_json": '{"temperature": 9}'}, "out of range"),
        ({"params_json": "{not json"}, "not valid JSON"),
        ({"params_json": '{"bogus": 1}'}, "Unknown parameter"),
        ({"model": "./no-such-model-dir"}, "Could not load model"),
    ],
)
def test_bad_input_gives_clear_error_and_server_keeps_serving(client, kwargs, message):
    with pytest.raises(Exception, match=message):
        submit(client, **kwargs).result(timeout=120)
    assert submit(client, max_new_tokens=2).result(timeout=120)[3] is not None


def test_inspector_rerenders_a_step_from_the_trace_and_rejects_bad_traces(client):
    trace_json = submit(client, max_new_tokens=4).result(timeout=120)[4]
    figure, _gamma = app.inspect_trace(trace_json, 1, 1.5)
    step_one = [e for e in from_json(trace_json).events if getattr(e, "step", None) == 1][0]
    assert list(figure.data[0].x) == step_one.top_probs
    with pytest.raises(Exception, match="Cannot read the trace"):
        app.inspect_trace('{"format": "nope"}', 0, 1.5)


def test_compare_runs_strategies_side_by_side_with_a_diff(client):
    job = client.submit(
        ["greedy", "sample"],
        "Name three colours.",
        0,
        6,
        True,
        "smollm2-135m",
        "auto",
        "auto",
        "auto",
        api_name="/compare",
    )
    final = job.result(timeout=600)
    diff, summary = final[-2], final[-1]
    assert "| greedy |" in summary and "| sample |" in summary and "agreement with first" in summary
    assert "sample</b> vs <b>greedy" in diff
    assert "dl-token" in final[1] and "dl-token" in final[5]  # both columns' token views (title, tokens, stats, plot)
    with pytest.raises(Exception, match="Choose 2 to 4"):
        options = ("smollm2-135m", "auto", "auto", "auto")
        client.submit(["greedy"], "hi", 0, 4, True, *options, api_name="/compare").result(60)


def test_a_full_queue_is_refused_with_a_clear_message():
    demo = app.build_app(queue_max_size=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        # one client (one browser session) per student: Gradio's cancel stops every running event of the
        # cancelling session's endpoint, and in the model lane waiting runs are running events
        def student() -> Client:
            return Client(f"http://127.0.0.1:{port}/", verbose=False)

        running = submit(student(), strategy="sample", prompt="Write a long story about a dragon.", max_new_tokens=1024)
        deadline = time.time() + 120
        while len(running.outputs()) < 2 and time.time() < deadline:
            time.sleep(0.2)
        waiting = submit(student(), prompt="Name one fruit.", max_new_tokens=2)  # fills the one waiting place
        time.sleep(1.0)
        with pytest.raises(Exception, match=r"Queue is full: 1 runs are waiting .*you would be #2"):
            submit(student(), prompt="Name one animal.", max_new_tokens=2).result(timeout=60)
        same = submit(student(), prompt="Name one fruit.", max_new_tokens=2)  # identical: joins the waiting run
        time.sleep(1.0)
        assert any("#1 in line" in str(update[2]) for update in waiting.outputs()), waiting.outputs()
        with contextlib.suppress(httpx.TimeoutException):  # a busy server may answer the cancel late; it still acts
            running.cancel()
        assert waiting.result(timeout=300)[3] == same.result(timeout=300)[3] is not None
    finally:
        demo.close()
