"""A classroom's worth of load: 20 concurrent gradio_client sessions against `python app.py` on 127.0.0.1.

Each session (its own Client, so its own Gradio session) submits one short greedy run through `/run` at the same
moment. Every request must either complete with text or be told the queue is full (Gradio's 503 + QueueError,
the app's bounded queue); any other error, any other 5xx response, or a request still open past the app's run
time limit fails the test. The server's resident memory (VmRSS) is read before and after the burst and must
stay within a generous bound. Every HTTP response the clients receive is recorded by wrapping httpx.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from gradio_client.utils import QueueError

from tests.appserver import running_app
from ui.common import MAX_RUN_SECONDS, QUEUE_MAX_SIZE

pytestmark = [pytest.mark.load, pytest.mark.embedded]

SESSIONS = 20
MAX_NEW_TOKENS = 4
RSS_GROWTH_LIMIT_MB = 500  # 20 finished sessions may leave traces and state behind, never another model
RSS_LIMIT_MB = 3000


def run_args(index: int) -> tuple:
    prompt = f"Say hello to student number {index}."
    return ("smollm2-135m", "greedy", prompt, True, MAX_NEW_TOKENS, index, "")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("load")) as server:
        yield server


@pytest.fixture
def http_log(monkeypatch):
    """(method, path, status) of every response any client in this process receives."""
    log: list[tuple[str, str, int]] = []
    lock = threading.Lock()
    send = httpx.Client.send

    def recording_send(self, request, *args, **kwargs):
        response = send(self, request, *args, **kwargs)
        with lock:
            log.append((request.method, request.url.path, response.status_code))
        return response

    monkeypatch.setattr(httpx.Client, "send", recording_send)
    return log


def one_session(url: str, index: int, outcomes: list, start: threading.Barrier) -> None:
    began = time.monotonic()
    try:
        client = Client(url, verbose=False)
        start.wait(timeout=120)
        began = time.monotonic()
        result = client.submit(*run_args(index), api_name="/run").result(timeout=MAX_RUN_SECONDS)
        outcomes[index] = ("ok", result[3], time.monotonic() - began)
    except QueueError as error:
        outcomes[index] = ("queue full", str(error), time.monotonic() - began)
    except Exception as error:  # anything else is a failure: keep it for the assertion message
        outcomes[index] = ("error", f"{type(error).__name__}: {error}", time.monotonic() - began)


def test_twenty_concurrent_sessions(server, http_log):
    warm = Client(server.url, verbose=False).submit(*run_args(0), api_name="/run")
    assert warm.result(timeout=MAX_RUN_SECONDS)[3].strip(), "warm-up run returned no text"
    rss_before = server.rss_mb()

    outcomes: list = [None] * SESSIONS
    start = threading.Barrier(SESSIONS)
    threads = [
        threading.Thread(target=one_session, args=(server.url, i, outcomes, start), daemon=True)
        for i in range(SESSIONS)
    ]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    with urllib.request.urlopen(server.url, timeout=30) as page:  # the page still serves under load
        assert page.status == 200
    for thread in threads:
        thread.join(timeout=max(1.0, MAX_RUN_SECONDS + 60 - (time.monotonic() - began)))
    assert not any(t.is_alive() for t in threads), "a session hung past the app's time limit"

    kinds = [o[0] if o else "missing" for o in outcomes]
    errors = [o for o in outcomes if not o or o[0] not in ("ok", "queue full")]
    assert not errors, f"requests neither completed nor were told the queue is full: {errors}"
    assert kinds.count("ok") >= QUEUE_MAX_SIZE // 2, kinds
    assert all(o[1].strip() for o in outcomes if o[0] == "ok"), "a completed run returned no text"
    assert all("Queue is full" in o[1] for o in outcomes if o[0] == "queue full")
    assert max(o[2] for o in outcomes) < MAX_RUN_SECONDS

    server_errors = [entry for entry in http_log if entry[2] >= 500]
    queue_full_503 = [entry for entry in server_errors if entry[2] == 503 and entry[1].endswith("/queue/join")]
    assert server_errors == queue_full_503 and len(queue_full_503) == kinds.count("queue full"), server_errors
    assert "Traceback" not in server.log(), server.log()[-4000:]

    rss_after = server.rss_mb()
    report = f"ok={kinds.count('ok')} queue_full={kinds.count('queue full')} rss {rss_before:.0f} -> {rss_after:.0f} MB"
    print(report)
    Path(server.log_path.parent / "load-report.txt").write_text(report + "\n")
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB, report
    assert rss_after < RSS_LIMIT_MB, report
