"""Branch from here: replace one token of a run with an alternative (or typed text) and continue the same strategy.

Covered: `branch_point` (where a branch starts in a parent trace: the tokens before the chosen one become part of
the prompt, the chosen alternative or typed text replaces it), `branch_events` (the forced token(s) as
TokenEmitted events with source "forced" at step 0, then the strategy's own events on prompt + prefix + forced,
their steps shifted by one, with the budget reduced by the forced tokens), and `branch_record` (what a trace stores
about where it branched: `Trace.branch`, an optional field that older traces simply lack). Typed text is encoded
with the model's tokenizer inside the model work and may become several tokens. Not covered: editing tokens in the
middle without regenerating the rest (a branch always regenerates after the forced token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from lab.trace import Event, TokenEmitted, Trace

MAX_TYPED_CHARS = 200


class BranchError(ValueError):
    """The branch cannot start where asked; the message says why."""


@dataclass(frozen=True)
class BranchPoint:
    """Where a branch leaves its parent: the parent's tokens before `at_token` are kept, then the forced token."""

    parent_run: str
    at_token: int
    at_step: int
    prefix_ids: tuple[int, ...]
    prefix_text: str
    replaced_text: str
    forced_id: int | None  # an alternative of the step, or None when the viewer typed text
    forced_text: str
    top_ids: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = ()
    top_probs: tuple[float, ...] = ()


def tokens_of(trace: Trace) -> list[TokenEmitted]:
    return [e for e in trace.events if isinstance(e, TokenEmitted)]


def first_token_of_step(trace: Trace, step: int) -> int | None:
    """Index (among the trace's tokens) of the first token emitted at `step`, or None."""
    return next((i for i, e in enumerate(tokens_of(trace)) if e.step == step), None)


def branch_point(trace: Trace, run_id: str, token_index: int, choice_id: int | None, typed: str = "") -> BranchPoint:
    """The branch replacing token `token_index` of `trace` by `choice_id` (one of that step's alternatives) or,
    when `choice_id` is None, by the `typed` text."""
    tokens = tokens_of(trace)
    if not 0 <= token_index < len(tokens):
        raise BranchError(f"the run has no token {token_index}; click a token first")
    at = tokens[token_index]
    typed = (typed or "")[:MAX_TYPED_CHARS]
    if choice_id is None and not typed:
        raise BranchError("pick one of the alternatives or type a token to continue with")
    if choice_id is not None and choice_id not in at.top_ids:
        raise BranchError(f"token id {choice_id} is not among step {at.step}'s alternatives")
    text = at.top_tokens[at.top_ids.index(choice_id)] if choice_id is not None else typed
    prefix = tokens[:token_index]
    return BranchPoint(
        parent_run=run_id,
        at_token=token_index,
        at_step=at.step,
        prefix_ids=tuple(e.token_id for e in prefix),
        prefix_text="".join(e.text for e in prefix),
        replaced_text=at.text,
        forced_id=choice_id,
        forced_text=text,
        top_ids=tuple(at.top_ids),
        top_tokens=tuple(at.top_tokens),
        top_probs=tuple(at.top_probs),
    )


def forced_ids(point: BranchPoint, tokenizer) -> list[int]:
    """The forced token ids: the chosen alternative, or the typed text encoded without special tokens."""
    if point.forced_id is not None:
        return [point.forced_id]
    ids = list(tokenizer.encode(point.forced_text, add_special_tokens=False))
    if not ids:
        raise BranchError("the typed text encodes to no token")
    return ids


def branch_events(run_strategy, loaded, prompt_ids: list[int], params, generator, point: BranchPoint) -> Iterator:
    """Forced TokenEmitted events (step 0), then `run_strategy(loaded, prompt + prefix + forced, params with the
    budget left, generator)`'s events with their steps shifted by one."""
    forced = forced_ids(point, loaded.tokenizer)
    for token_id in forced:
        text = loaded.tokenizer.decode([token_id])
        top = (list(point.top_ids), list(point.top_tokens), list(point.top_probs))
        yield TokenEmitted(0, token_id, text, "forced", 0.0, *top)
    budget = params.max_new_tokens - len(forced)
    if budget < 1:
        return
    ids = list(prompt_ids) + list(point.prefix_ids) + forced
    events = run_strategy(loaded, ids, dataclasses.replace(params, max_new_tokens=budget), generator)
    try:
        for event in events:
            yield _shifted(event)
    finally:
        events.close()


def _shifted(event: Event) -> Event:
    step = getattr(event, "step", None)
    return dataclasses.replace(event, step=step + 1) if isinstance(step, int) else event


def branch_record(point: BranchPoint) -> dict:
    """`Trace.branch`: the parent run, where it branched and with what (plain JSON values)."""
    return {
        "parent_run": point.parent_run,
        "at_token": point.at_token,
        "at_step": point.at_step,
        "prefix_ids": list(point.prefix_ids),
        "prefix_text": point.prefix_text,
        "replaced_text": point.replaced_text,
        "forced_id": point.forced_id,
        "forced_text": point.forced_text,
    }
