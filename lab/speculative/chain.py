"""The chain loop: draft a chain, verify it in one target forward, accept, commit, stream. Vanilla speculative
decoding runs it with the serial schedule; SSD runs the same loop with its speculating schedule
(`lab.speculative.schedules.ssd.SSDSchedule`): SSD is a scheduling of this loop, not another loop.

Each round: 1. the schedule produces the draft (serial: `proposer.propose`; SSD: the speculation cache on a hit)
and it is cut after its first EOS; 2. the target scores [x_0, x_1..x_gamma] in one forward
(`lab.speculative.verify`; SSD's drafter thread pre-drafts the next round meanwhile); 3. the acceptance rule
decides (greedy walk, or Leviathan et al. 2023, Alg. 1 when sampling); 4. the target's cache keeps the accepted
prefix and the proposer rolls back; 5. the round's DraftRound, the schedule's events (PipelineSpans, SSD's
SpeculationRound) and one TokenEmitted per token stream out; 6. gamma adapts. The first token comes from the
prefill forward, as in greedy decoding (so the prompt's cache is computed exactly as greedy's).

Adaptive gamma (a documented heuristic, like HF's assisted generation which uses +2 / -1): after a fully
accepted non-empty draft gamma grows by 1 up to gamma_max, after a rejection it shrinks by 1 down to 1; an empty
draft leaves it alone. gamma is always clipped to the remaining budget - 1.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from lab.engine import runtime
from lab.engine.emitter import Emitter
from lab.engine.models import LoadedModel
from lab.engine.profile import section
from lab.engine.sampling import SamplingConfig, choose_token, process_logits
from lab.speculative.acceptance import Acceptance, accept
from lab.speculative.draft import Draft, DraftContext, Proposer, Verified
from lab.speculative.events import draft_round, sources_of
from lab.speculative.verify import commit, path_rows, verify
from lab.trace import Event, PipelineSpan, RunFinished


@dataclass(frozen=True)
class ChainSettings:
    max_new_tokens: int
    config: SamplingConfig
    gamma: int = 6
    adaptive: bool = False
    gamma_max: int = 12

    @property
    def first_gamma(self) -> int:
        return min(self.gamma, self.gamma_max) if self.adaptive else self.gamma


def next_gamma(gamma: int, drafted: int, accepted: int, settings: ChainSettings) -> int:
    """Adaptive draft length: +1 on full acceptance (up to gamma_max), -1 on a rejection (down to 1)."""
    if not settings.adaptive or drafted == 0:
        return gamma
    return min(gamma + 1, settings.gamma_max) if accepted == drafted else max(gamma - 1, 1)


class Schedule(Protocol):
    """Who drafts when. `fanout`: candidates per drafted position the drafts must report (SSD)."""

    fanout: int

    def draft(self, context: DraftContext) -> tuple[Draft, float]:
        """The round's draft and the seconds the main thread spent drafting it."""

    def verifying(self, context: DraftContext, draft: Draft, gamma: int) -> contextlib.AbstractContextManager:
        """Entered around the target's verify forward."""

    def round_events(self, step: int, acc: Acceptance, start: float, times: tuple[float, float]) -> list[Event]:
        """The schedule's events of a finished round (spans, speculation); `start` is relative to the run."""

    def close(self) -> None: ...


class SerialSchedule:
    """Vanilla speculative decoding: draft, then verify, on one thread."""

    fanout = 0

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer

    def draft(self, context: DraftContext) -> tuple[Draft, float]:
        start = time.perf_counter()
        return self.proposer.propose(context), time.perf_counter() - start

    def verifying(self, context: DraftContext, draft: Draft, gamma: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def round_events(self, step: int, acc: Acceptance, start: float, times: tuple[float, float]) -> list[Event]:
        middle, end = start + times[0], start + times[0] + times[1]
        return [
            PipelineSpan(step, "drafter", "draft", round(start, 6), round(middle, 6)),
            PipelineSpan(step, "target", "verify", round(middle, 6), round(end, 6)),
        ]

    def close(self) -> None:
        pass


def chain_loop(
    loaded: LoadedModel,
    prompt_ids: list[int],
    proposer: Proposer,
    generator: torch.Generator,
    settings: ChainSettings,
    schedule: Schedule | None = None,
) -> Iterator[Event]:
    """Chain speculative decoding until EOS or the budget (module docstring, steps 1-6)."""
    out, config, eos = Emitter(loaded, settings.max_new_tokens), settings.config, loaded.eos_token_ids
    schedule = schedule or SerialSchedule(proposer)
    rule = "greedy" if config.greedy else "sample"
    state, first = runtime.prefill(loaded, prompt_ids)
    step = 0
    try:
        processed = process_logits(first.logits[-1:], config, prompt_ids)  # [1, V]
        root = choose_token(processed[0], config, generator)
        yield from out.emit(step, [root], ["target"], processed)
        gamma, step = settings.first_gamma, 1
        while out.stop_reason is None:
            tokens = prompt_ids + out.generated
            context = DraftContext(
                tokens, min(gamma, out.remaining - 1), config, generator, eos, schedule.fanout, None, step, out.text_of
            )
            t0 = time.perf_counter()
            with section("draft"):
                draft, draft_s = schedule.draft(context)  # 1.
                draft = draft.cut_at_eos(eos)
            with schedule.verifying(context, draft, gamma):
                v = verify(state, root, draft, config, tokens)  # 2.
            with section("accept"):
                acc = accept(draft, v.processed, rule, config, generator).ended_by(eos)  # 3.
            commit(state, v, draft, acc)  # 4.
            proposer.accept(Verified(len(acc.accepted), acc.tokens, v.n_past))
            times = (draft_s, v.verify_s)
            yield draft_round(step, proposer.name, context.gamma, draft, v.processed, config, acc, out.text_of, times)
            yield from schedule.round_events(step, acc, t0 - out.start, times)  # 5.
            rows = v.processed[path_rows(acc)][: len(acc.tokens)]
            yield from out.emit(step, acc.tokens, sources_of(len(acc.accepted), acc.source), rows)
            root = acc.tokens[-1]
            gamma = next_gamma(gamma, draft.size, len(acc.accepted), settings)  # 6.
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards, proposer.forwards)
    finally:
        schedule.close()
        state.cache.reset()
        proposer.close()
