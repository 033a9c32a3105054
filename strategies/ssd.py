"""SSD, speculative speculative decoding (Kumar, Dao, May 2026, ICLR): vanilla speculative decoding whose drafter
works while the target verifies, pre-drafting the next round for the likely verification outcomes.

Each round: 1. the draft is taken from the speculation cache when the last round's outcome (k accepted, token
t) was guessed (a hit; a branch cut short is drafted on to gamma on the main thread), else drafted on the main
thread (a miss), 2. the drafter thread (`lab.ssd.Speculator`) starts guessing this round's outcomes, best first
(`lab.ssd.plan_outcomes`: acceptance rate alpha and the drafter's top-F candidates per position), and
pre-drafts the next round for each, 3. the target verifies the draft in one forward and `accept_draft` decides
(Leviathan et al. 2023, Alg. 1; `lab.proposers.verify_draft`, exactly as `strategies.speculative`), 4. the
drafter thread is stopped (it finishes the forward in flight) and the actual outcome is looked up, 5. the
round's `DraftRound`, `SpeculationRound`, `PipelineSpan`s (who ran what when: the Gantt view) and tokens
stream out, 6. gamma adapts as in vanilla SD (for the guessed branches it is computed per guessed outcome).

Losslessness: every round's draft is drawn from q on that round's exact context, independently of its own
acceptance draws (see `lab.ssd`), so greedy output equals greedy decoding and sampled output is distributed as
the target's; sampled runs are not reproducible from the seed because hits depend on timing.
Threads (CPU): the drafter thread sets its own torch intra-op count (`draft_threads`, default 1); the target's
thread uses `target_threads` while the two overlap (its verify), by default its own count minus the drafter's
(at least 1; unchanged for prompt lookup), and its own count again when it drafts on a miss (the drafter thread
is idle then). OpenMP thread counts are per calling thread, so the settings do not interfere; on the lab's
2-core CPU that is one core each during a verify. Oversubscribing (2 target threads + 1 drafter thread on 2
cores) was measured to stall the target's OpenMP team badly (verify 5-10x slower), hence the split. Both
threads release the GIL inside torch ops but hold it for the model's Python code, so small models overlap
partly. The drafter's KV cache is used by one thread at a time (the main thread drafts only after the worker
stopped).
Not covered: CUDA streams or a second device for the drafter, batched branch drafting (the paper's GPU
path), Saguaro sampling, tree drafts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.models import LoadedModel
from lab.params import param
from lab.proposers import DRAFTERS, Draft, DraftContext, Proposer, verify_draft
from lab.ssd import Job, Speculator, acceptance_estimate
from lab.trace import Event, PipelineSpan, RunFinished, SpeculationRound
from strategies.base import Strategy
from strategies.speculative import (
    Output,
    SpeculativeParams,
    _prefill,
    cut_at_eos,
    emitted,
    next_gamma,
    proposer_for,
    round_event,
)


@dataclass(frozen=True)
class SSDParams(SpeculativeParams):
    drafter: str = param(
        "self-draft",
        choices=DRAFTERS,
        help="Who drafts (and speculates in its thread): the target's first L layers, a draft model, or n-gram lookup.",
    )
    gamma: int = param(4, low=1, high=16, help="Draft length gamma: tokens proposed per target forward (at most).")
    fanout: int = param(
        3, low=1, high=8, help="F: candidate tokens t per position guessed for the outcome (k accepted, then t)."
    )
    draft_threads: int = param(1, low=0, high=64, help="torch threads of the drafter thread (0 = inherit).")
    target_threads: int = param(
        0, low=0, high=64, help="torch threads of the target's thread (0 = auto: the rest of the cores, see docs)."
    )


def target_threads(params: SSDParams, current: int) -> int:
    """The target thread's torch threads: `target_threads`, or auto (0): the calling thread's count minus the
    drafter thread's for a model drafter (both run at once; oversubscribed OpenMP teams spin and stall), the
    count unchanged for prompt lookup (its drafter thread runs no forwards)."""
    if params.target_threads:
        return params.target_threads
    if params.drafter == "prompt-lookup":
        return current
    return max(1, current - max(params.draft_threads, 1))


def next_gammas(gamma: int, n: int, done: int, params: SSDParams) -> list[int]:
    """The next round's gamma for each outcome k = 0..n (0: the budget ends, no next draft needed)."""
    gammas = []
    for k in range(n + 1):
        left = params.max_new_tokens - (done + k + 1)
        gammas.append(max(0, min(next_gamma(gamma, n, k, params), left - 1)) if left > 0 else 0)
    return gammas


def _span(step: int, who: str, what: str, start: float, clock: float, thread: str = "main", detail: str = ""):
    return PipelineSpan(step, who, what, round(start - clock, 6), round(time.perf_counter() - clock, 6), thread, detail)


def next_draft(
    proposer: Proposer, context: DraftContext, cached: Draft | None, step: int, clock: float
) -> tuple[Draft, int, int, list[PipelineSpan]]:
    """(draft, tokens taken from the cache, tokens drafted after them, spans): a hit uses the cached branch (drafted
    on to gamma when it was cut short), a miss drafts on the main thread."""
    eos, start = context.eos_token_ids, time.perf_counter()
    if cached is None:
        draft = cut_at_eos(proposer.propose(context), eos)
        return draft, 0, 0, [_span(step, "drafter", "draft", start, clock)]
    draft = cut_at_eos(cached.truncated(context.gamma), eos)
    used, short = len(draft.tokens), len(draft.tokens) < context.gamma
    if not short or (draft.tokens and draft.tokens[-1] in eos):
        return draft, used, 0, []
    rest = dataclasses.replace(context, tokens=context.tokens + draft.tokens, gamma=context.gamma - used)
    draft = draft.extended(cut_at_eos(proposer.propose(rest), eos))
    return draft, used, len(draft.tokens) - used, [_span(step, "drafter", "extend", start, clock)]


def speculation_event(job: Job, k: int, token: int, hit: bool, used: tuple[int, int], out: Output) -> SpeculationRound:
    """The SpeculationRound of a finished job, given the actual outcome (k accepted, then `token`)."""
    keys = list(job.cache)
    return SpeculationRound(
        step=job.step,
        hit=hit,
        accepted=k,
        token=token,
        token_text=out.text_of(token),
        cached_tokens=used[0],
        extended=used[1],
        branches=sum(job.fanout),
        completed=job.completed,
        fanout=list(job.fanout),
        planned=list(job.planned),
        keys_k=[key[0] for key in keys],
        keys_tokens=[key[1] for key in keys],
        keys_texts=[out.text_of(key[1]) for key in keys],
        hit_rank=keys.index((k, token)) if hit else -1,
        alpha=round(job.alpha, 4),
    )


def decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], params: SSDParams, proposer: Proposer, generator: torch.Generator
) -> Iterator[Event]:
    """SSD rounds until EOS or the budget (see the module docstring for the numbered steps)."""
    out, config, eos = Output(loaded, params.max_new_tokens), params.sampling, loaded.eos_token_ids
    worker_generator = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=generator)))
    speculator = Speculator(proposer, config, eos, params.fanout, params.draft_threads, worker_generator, out.start)
    threads = torch.get_num_threads()
    verify_threads = target_threads(params, threads)  # while the drafter thread runs; the rest uses `threads`
    state, last = _prefill(loaded, prompt_ids)
    gamma = min(params.gamma, params.gamma_max) if params.adaptive else params.gamma
    step, counts, cached, job, clock = 0, [0, 0], None, None, out.start
    try:
        while out.stop_reason is None:
            tokens = prompt_ids + out.generated
            n_left = params.max_new_tokens - len(out.generated)
            context = DraftContext(tokens, min(gamma, n_left - 1), config, generator, eos, params.fanout)
            draft, *used, spans = next_draft(proposer, context, cached, step, clock)  # 1.
            n = len(draft.tokens)
            job = Job(
                step, tokens, draft, next_gammas(gamma, n, len(out.generated), params), acceptance_estimate(*counts)
            )
            speculator.start(job)  # 2.
            start = time.perf_counter()
            torch.set_num_threads(verify_threads)
            v = verify_draft(state, last, draft, config, tokens, generator)  # 3.
            spans.append(_span(step, "target", "verify", start, clock))
            start = time.perf_counter()
            speculator.finish(job)  # 4.
            torch.set_num_threads(threads)
            spans.append(_span(step, "target", "wait", start, clock, detail="for the drafter thread to stop"))
            round_tokens, v = emitted(v, eos)
            k = len(v.acceptance.accepted)
            counts = [counts[0] + k, counts[1] + k + (v.acceptance.recovered is not None)]
            cached = job.cache.get((k, round_tokens[-1]))
            draft_s = sum(s.end - s.start for s in spans if s.who == "drafter")  # on the main thread only
            yield round_event(step, proposer.name, context.gamma, draft, v, out.text_of, (draft_s, v.verify_s))
            yield speculation_event(job, k, round_tokens[-1], cached is not None, tuple(used), out)  # 5.
            yield from spans
            yield from (
                PipelineSpan(step, "drafter", w, round(a, 6), round(b, 6), "worker", d) for w, d, a, b in job.spans
            )
            yield from out.token_events(step, round_tokens, v)
            last, job = round_tokens[-1], None
            gamma = next_gamma(gamma, n, k, params)  # 6.
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards, proposer.forwards)
    finally:
        if job is not None:
            job.stop.set()
            job.done.wait()
        speculator.close()
        torch.set_num_threads(threads)
        state.cache.reset()
        proposer.close()


def run(loaded: LoadedModel, prompt_ids: list[int], params: SSDParams, generator: torch.Generator) -> Iterator[Event]:
    return decode_loop(loaded, prompt_ids, params, proposer_for(loaded, params), generator)


STRATEGY = Strategy(
    name="ssd",
    family="speculative",
    summary="Speculative decoding whose drafter pre-drafts the next round for likely outcomes during verification.",
    paper="Kumar, Dao, May 2026, Speculative Speculative Decoding (ICLR 2026); Leviathan et al. 2023 (Alg. 1)",
    Params=SSDParams,
    run=run,
)
