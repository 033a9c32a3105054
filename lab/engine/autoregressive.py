"""The one autoregressive loop of the lab: greedy and sampling (`strategies.greedy`, `strategies.sample`), Mirostat
(`lab.methods.mirostat`), DoLa (`strategies.dola`) and CFG (`strategies.cfg`) run it with their own per-step hook.

Each step: 1. the method's hook turns the step's forward output (last-position logits, every layer's hidden states,
or both CFG branches' logits) and the token history into a `Pick`: the next token, the alternatives shown with it
and the method's events, 2. the method's events and the token's `TokenEmitted` stream out (`lab.engine.emitter`,
the emitter the speculative loops use too), 3. the run stops at EOS (emitted) or the budget, 4. one forward of the
chosen token (`Forwards.advance`). Every forward goes through `lab.engine.runtime`. `sampling_hook` is the
baseline family's hook; with it the loop matches `model.generate` token for token in greedy mode (tested in fp32).
Not covered: batching several prompts, stopping strings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lab.engine import runtime
from lab.engine.emitter import TOP_ALTERNATIVES, Emitter
from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig, choose_token, process_logits, top_tokens
from lab.trace import Event, RunFinished


@dataclass(frozen=True)
class Pick:
    """What a method's hook decided at one step."""

    token: int
    top_ids: list[int]  # the most likely tokens of the distribution the token was chosen from
    top_probs: list[float]  # their probabilities
    before: tuple[Event, ...] = ()  # the method's events streamed before the token's TokenEmitted
    after: tuple[Event, ...] = ()  # ... and after it


Hook = Callable[[int, Any, list[int]], Pick]  # (step, forward output, prompt + generated ids) -> Pick


class State(Protocol):
    """What the loop needs of a method's decoding state: the forwards it cost and the cache to free."""

    forwards: int
    cache: Any


@dataclass(frozen=True)
class Forwards:
    """The model side of a loop: encode the prompt into (state, first output), then advance by one chosen token."""

    prefill: Callable[[LoadedModel, list[int]], tuple[State, Any]]
    advance: Callable[[Any, int], Any]


LOGITS = Forwards(runtime.prefill, runtime.decode_step)  # outputs: runtime.ForwardOutput (logits [T, V])


@dataclass(frozen=True)
class Outcome:
    stop_reason: str
    new_tokens: int
    forwards: int


def steps(
    loaded: LoadedModel,
    prompt_ids: list[int],
    hook: Hook,
    max_new_tokens: int,
    *,
    forwards: Forwards = LOGITS,
    emit_text: bool = True,
    start: float | None = None,
) -> Generator[Event, None, Outcome]:
    """The loop (module docstring), streaming the hook's events and, with `emit_text`, a TokenEmitted per token
    (without: the tokens still count and stop the run, as in Mirostat's comparison replays); returns the Outcome."""
    out = Emitter(loaded, max_new_tokens, start)
    state, output = forwards.prefill(loaded, prompt_ids)
    try:
        for step in range(max_new_tokens):
            pick = hook(step, output, prompt_ids + out.generated)  # 1.
            yield from pick.before  # 2.
            if emit_text:
                yield out.token(step, pick.token, "target", pick.top_ids, pick.top_probs)
            else:
                out.accept(pick.token)
            yield from pick.after
            if out.stop_reason:  # 3.
                break
            output = forwards.advance(state, pick.token)  # 4.
        return Outcome(out.stop_reason or "max_new_tokens", len(out.generated), state.forwards)
    finally:
        state.cache.reset()


def decode(
    loaded: LoadedModel, prompt_ids: list[int], hook: Hook, max_new_tokens: int, *, forwards: Forwards = LOGITS
) -> Iterator[Event]:
    """`steps`, then the run's RunFinished."""
    start = time.perf_counter()
    outcome = yield from steps(loaded, prompt_ids, hook, max_new_tokens, forwards=forwards, start=start)
    elapsed = time.perf_counter() - start
    yield RunFinished(outcome.new_tokens, outcome.stop_reason, elapsed, len(prompt_ids), outcome.forwards)


def top_alternatives(processed_logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The most likely tokens of softmax(processed_logits) [V] (`lab.engine.sampling.top_tokens`' order) and their
    probabilities."""
    ids = top_tokens(processed_logits, TOP_ALTERNATIVES).ids[0]
    return ids.tolist(), processed_logits.softmax(dim=-1)[ids].tolist()


def sampling_hook(config: SamplingConfig, generator: torch.Generator) -> Hook:
    """The baseline family's step: process the last logits (HF order, `lab.engine.sampling`), then argmax or a
    seeded draw; the alternatives are those of the processed distribution."""

    def hook(step: int, output: runtime.ForwardOutput, history: list[int]) -> Pick:
        processed = process_logits(output.logits[-1], config, history)  # [V]
        token = choose_token(processed, config, generator)
        return Pick(token, *top_alternatives(processed))

    return hook


def decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], config: SamplingConfig, max_new_tokens: int, generator: torch.Generator
) -> Iterator[Event]:
    """Greedy / sampled decoding, one target forward per token, streaming a TokenEmitted per token."""
    return decode(loaded, prompt_ids, sampling_hook(config, generator), max_new_tokens)
