"""A session's run history: small records of finished runs (kept in the app's gr.State, one list per session).

Covered: `add_run` (newest first, at most MAX_HISTORY records; a record holds the strategy, the start of the
prompt, a few stats and the path of the saved trace file, never the trace itself, so per-session memory stays
bounded), `history_choices` (dropdown entries) and `find_run`. Re-opening a run loads its trace file with
`lab.app.replay.load_trace_file`; files are pruned by the app's trace folder limit, so an old record may point to
a file that is gone (the app says so). Not covered: persistence across sessions or server restarts.
"""

from __future__ import annotations

import time

from lab.trace import Trace, summarize

MAX_HISTORY = 20
PROMPT_CHARS = 40


def add_run(
    history: list[dict] | None, trace: Trace, trace_path: str, status: str = "", run_id: str = ""
) -> list[dict]:
    """A new history list with this run first (the input list is not modified); a run whose `run_id` is
    already recorded is not added twice."""
    previous = list(history or [])
    if run_id and any(record.get("run") == run_id for record in previous):
        return previous
    stats = summarize(trace.events)
    record = {
        "id": (previous[0]["id"] + 1) if previous else 1,
        "time": time.strftime("%H:%M:%S"),
        "strategy": trace.strategy,
        "prompt": trace.prompt[:PROMPT_CHARS] + ("…" if len(trace.prompt) > PROMPT_CHARS else ""),
        "tokens": stats.new_tokens,
        "tokens_per_s": stats.tokens_per_s,
        "stop": status or stats.stop_reason,
        "path": trace_path,
        "run": run_id,
    }
    return [record, *previous][:MAX_HISTORY]


def history_label(record: dict) -> str:
    return (
        f"#{record['id']} {record['time']} · {record['strategy']} · {record['tokens']} tok · "
        f"{record['tokens_per_s']} tok/s · {record['prompt']}"
    )


def history_choices(history: list[dict] | None) -> list[tuple[str, int]]:
    """(label, id) per record, newest first."""
    return [(history_label(record), record["id"]) for record in history or []]


def find_run(history: list[dict] | None, run_id: int | None) -> dict | None:
    return next((record for record in history or [] if record["id"] == run_id), None)
