"""SSD's speculation engine (Kumar, Dao, May 2026, "Speculative Speculative Decoding", ICLR; its Saguaro
algorithm): while the target verifies round T, a drafter thread guesses the verification outcome and pre-drafts
round T + 1 for each guess into a speculation cache.

An outcome of round T is (k, t): k of the n draft tokens accepted, then the target's token t (recovered from
norm(max(0, p_k - q_k)) when k < n, the bonus from p_n when k = n). `plan_outcomes` ranks the guesses by an
estimate of their probability, P(k, t) ~ alpha^k (1 - alpha) q_k(t) / (1 - q_k(x_k)) for k < n (t != x_k: a
rejected x_k has p_k(x_k) < q_k(x_k), so the residual is 0 there) and alpha^n q_n(t) for the bonus, with the
run's acceptance rate alpha and the drafter's own top candidates q_k (its fan-out F per position). The bonus
position needs the drafter's distribution after x_n first: a "probe" drafts gamma + 1 tokens after the whole
draft, whose first token is the drafter's own guess of the bonus and whose rest is that outcome's next draft.
`Speculator` runs the plan in a worker thread (its own torch intra-op thread count, set inside the thread:
OpenMP's thread count is per calling thread), best guess first, one branch = one `Proposer.propose` on the
guessed context (the drafter's KV cache keeps the shared prefix: `ModelProposer` crops to the common prefix).
`finish` asks it to stop (polled between drafter forwards, so a branch may be cut short: a shorter draft still
drawn from q) and waits for the forward in flight. The cache maps (k, t) to the pre-drafted next draft.

Losslessness: a cached draft for (k, t) was drawn from q on exactly the context the next round has when the
outcome is (k, t), with a generator of its own, before and independently of the target's acceptance draws of
the next round; whether a guess is cached depends on timing and on earlier guesses only, never on that round's
uniforms. So each round still drafts x ~ q on its context and Alg. 1 of Leviathan et al. 2023 keeps the output
distributed as p (greedy: identical tokens). Sampling runs are therefore exact in distribution but not
reproducible token for token from the seed (which guesses were cached depends on timing).
`SSDSchedule` plugs all of this into the chain loop (`lab.speculative.chain`): its `draft` takes the cache entry
of the actual outcome (a hit; an empty entry is a miss) or drafts on the main thread, `verifying` runs the
speculator around the target's verify with the thread split below, `round_events` reports the round.
Threads (CPU): the drafter thread sets its own torch intra-op count (`draft_threads`); the target's thread uses
`target_threads` while the two overlap (its verify), by default its own count minus the drafter's (at least 1;
unchanged for prompt lookup), and its own count again afterwards: OpenMP thread counts are per calling thread, so
the settings do not interfere, and the schedule restores them in every case. Oversubscribing (2 target threads +
1 drafter thread on 2 cores) was measured to stall the target's OpenMP team badly, hence the split.
The worker's generator is its own, seeded from the run's and on the model's device.
Deviations from the paper: one CPU worker thread drafts the branches one after another (the paper batches all
branches on a separate GPU), the fan-out per position follows the estimated outcome probability through a
single ranked list instead of the paper's closed-form allocation, and Saguaro sampling (reshaping the draft
distribution to make outcomes more predictable) and its fallback speculator are not implemented: a miss drafts
with the same drafter on the main thread. Not covered: tree drafts, several sequences, CUDA streams.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from lab.engine.sampling import SamplingConfig
from lab.speculative.draft import Draft, DraftContext, Proposer
from lab.trace import PipelineSpan, SpeculationRound

PROBE = -1  # the token of the plan entry that probes the bonus position


@dataclass(frozen=True)
class Guess:
    """A planned outcome (k accepted, then token t; t = PROBE for the bonus probe) and its estimated probability."""

    score: float
    k: int
    token: int


def acceptance_estimate(accepted: int, examined: int) -> float:
    """alpha with a uniform prior (Laplace): (accepted + 1) / (examined + 2)."""
    return (accepted + 1) / (examined + 2)


def plan_outcomes(draft: Draft, alpha: float, fanout: int, eos: tuple[int, ...] = ()) -> list[Guess]:
    """The guesses for positions k < n (top `fanout` candidates t != x_k of q_k) plus one probe of the bonus
    position k = n (whole mass alpha^n), best first. A draft ending in EOS needs no probe; EOS guesses end the
    run, so they need no next draft either."""
    n, guesses = len(draft.tokens), []
    rows = zip(draft.top_ids or [], draft.top_probs or [], strict=True)
    for k, (ids, probs) in enumerate(rows):
        x_prob = next((p for t, p in zip(ids, probs, strict=True) if t == draft.tokens[k]), 0.0)
        reach = alpha**k * (1 - alpha) / max(1e-6, 1 - x_prob)
        kept = [(t, p) for t, p in zip(ids, probs, strict=True) if t != draft.tokens[k] and t not in eos][:fanout]
        guesses += [Guess(reach * p, k, t) for t, p in kept]
    if fanout and not (n and draft.tokens[-1] in eos):
        guesses.append(Guess(alpha**n, n, PROBE))
    return sorted(guesses, key=lambda g: -g.score)


@dataclass
class Job:
    """One round's speculation: the committed tokens, the draft under verification, the next round's gamma for
    each k, and what the worker produced (cache, spans as (what, detail, start, end), branches per position)."""

    step: int
    base: list[int]  # prompt + generated, ending with the round's x_0
    draft: Draft
    gammas: list[int]  # next round's gamma when k = 0..n tokens are accepted (0: no next draft needed)
    alpha: float
    cache: dict[tuple[int, int], Draft] = field(default_factory=dict)
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    fanout: list[int] = field(default_factory=list)  # branches started per position k = 0..n
    planned: list[int] = field(default_factory=list)  # guesses known per position
    completed: int = 0
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class Speculator:
    """The drafter thread of SSD: runs one `Job` at a time (start, then finish after the target's verify)."""

    def __init__(
        self,
        proposer: Proposer,
        config: SamplingConfig,
        eos: tuple[int, ...],
        fanout: int,
        threads: int,
        generator: torch.Generator,
        clock: float,
    ) -> None:
        self.proposer, self.config, self.eos, self.fanout = proposer, config, eos, fanout
        self.threads, self.generator, self.clock = threads, generator, clock
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        # the drafter runs in the run's context, so its forwards take the run's pinned path (lab.engine.forward_path)
        run_context = contextvars.copy_context()
        self._thread = threading.Thread(target=run_context.run, args=(self._loop,), name="ssd-drafter", daemon=True)
        self._thread.start()

    def start(self, job: Job) -> None:
        self._jobs.put(job)

    def finish(self, job: Job) -> Job:
        """Stop the job (the forward in flight completes) and return it; re-raises the worker's error."""
        job.stop.set()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)  # per thread: the target's thread keeps its own count
        while (job := self._jobs.get()) is not None:
            try:
                self._speculate(job)
            except BaseException as error:  # handed to the main thread by finish()
                job.error = error
            finally:
                job.done.set()

    def _context(self, tokens: list[int], gamma: int, job: Job) -> DraftContext:
        return DraftContext(tokens, gamma, self.config, self.generator, self.eos, self.fanout, job.stop.is_set)

    def _speculate(self, job: Job) -> None:
        """Pre-draft the next round for the guessed outcomes, best first, until stopped."""
        n = len(job.draft.tokens)
        job.fanout, job.planned = [0] * (n + 1), [0] * (n + 1)
        plan = plan_outcomes(job.draft, job.alpha, self.fanout, self.eos)
        for guess in plan:
            job.planned[guess.k] += guess.token != PROBE
        heap = [(-g.score, i, g) for i, g in enumerate(plan)]
        counter = len(plan)  # tie-breaker for guesses pushed later
        while heap and not job.stop.is_set():
            _, _, guess = heapq.heappop(heap)
            gamma = job.gammas[guess.k]
            if gamma <= 0:
                continue
            start = time.perf_counter()
            if guess.token == PROBE:
                for extra in self._probe(job, gamma):
                    heapq.heappush(heap, (-extra.score, counter, extra))
                    counter += 1
            else:
                context = job.base + job.draft.tokens[: guess.k] + [guess.token]
                job.cache[(guess.k, guess.token)] = self.proposer.propose(self._context(context, gamma, job))
                job.fanout[guess.k] += 1
                job.completed += not job.stop.is_set()
            what = "probe" if guess.token == PROBE else "branch"
            job.spans.append((what, f"k={guess.k}", start - self.clock, time.perf_counter() - self.clock))

    def _probe(self, job: Job, gamma: int) -> list[Guess]:
        """Draft gamma + 1 tokens after the whole draft: the first is the drafter's guess t1 of the bonus, the rest
        the next draft for (n, t1). Returns the other bonus candidates as guesses."""
        n = len(job.draft.tokens)
        drafted = self.proposer.propose(self._context(job.base + job.draft.tokens, gamma + 1, job))
        if not drafted.tokens:
            return []
        first = drafted.tokens[0]
        job.fanout[n] += 1
        job.planned[n] += 1
        if first not in self.eos and len(drafted.tokens) > 1:
            job.cache[(n, first)] = drafted.dropped(1)
        job.completed += not job.stop.is_set()
        ids, probs = (drafted.top_ids or [[]])[0], (drafted.top_probs or [[]])[0]
        others = [(t, p) for t, p in zip(ids, probs, strict=True) if t != first and t not in self.eos]
        reach = job.alpha**n
        job.planned[n] += len(others[: self.fanout - 1])
        return [Guess(reach * p, n, t) for t, p in others[: self.fanout - 1]]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads on this thread, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def split_threads(total: int, draft_threads: int, target_threads: int, model_drafter: bool) -> int:
    """The target thread's count while the drafter thread runs: `target_threads`, or (0 = auto) the total minus
    the drafter's for a model drafter, the total for prompt lookup (its drafter thread runs no forwards)."""
    if target_threads:
        return target_threads
    return max(1, total - max(draft_threads, 1)) if model_drafter else total


def worker_generator(generator: torch.Generator) -> torch.Generator:
    """The drafter thread's own generator: seeded from the run's, on the same device."""
    seed = int(torch.randint(2**62, (), generator=generator, device=generator.device))
    return torch.Generator(device=generator.device).manual_seed(seed)


def next_gammas(gamma: int, n: int, done: int, max_new_tokens: int, rule: Callable[[int, int, int], int]) -> list[int]:
    """The next round's gamma for each outcome k = 0..n of a draft of n tokens with `done` tokens generated
    (0: the budget ends, no next draft needed); `rule(gamma, drafted, accepted)` is the chain loop's."""
    gammas = []
    for k in range(n + 1):
        left = max_new_tokens - (done + k + 1)
        gammas.append(max(0, min(rule(gamma, n, k), left - 1)) if left > 0 else 0)
    return gammas


@dataclass(frozen=True)
class SSDSettings:
    fanout: int = 3
    draft_threads: int = 1
    target_threads: int = 0
    max_new_tokens: int = 128
    next_gamma: Callable[[int, int, int], int] = lambda gamma, drafted, accepted: gamma  # the chain loop's rule


class SSDSchedule:
    """SSD as a schedule of the chain loop (module docstring): speculation cache, drafter thread, thread split."""

    def __init__(
        self,
        proposer: Proposer,
        config: SamplingConfig,
        eos: tuple[int, ...],
        settings: SSDSettings,
        generator: torch.Generator,
        model_drafter: bool,
        prompt_length: int,
    ) -> None:
        self.proposer, self.settings, self.fanout = proposer, settings, settings.fanout
        self.prompt_length, self.text_of = prompt_length, str
        self.clock = time.perf_counter()
        self.speculator = Speculator(
            proposer, config, eos, settings.fanout, settings.draft_threads, worker_generator(generator), self.clock
        )
        total = torch.get_num_threads()
        self.verify_threads = split_threads(total, settings.draft_threads, settings.target_threads, model_drafter)
        self.cached: Draft | None = None
        self.counts = [0, 0]  # accepted, examined (for alpha)
        self.job: Job | None = None
        self.used = (0, 0)
        self.spans: list[PipelineSpan] = []

    def _span(self, step: int, what: str, start: float, who: str = "drafter", detail: str = "") -> PipelineSpan:
        end = time.perf_counter() - self.clock
        return PipelineSpan(step, who, what, round(start - self.clock, 6), round(end, 6), "main", detail)

    def draft(self, context: DraftContext) -> tuple[Draft, float]:
        """A hit takes the cached branch (drafted on to gamma when it was cut short); a miss drafts here."""
        start, eos, cached = time.perf_counter(), context.eos_token_ids, self.cached
        self.spans, self.used, self.text_of = [], (0, 0), context.text_of
        if cached is None:
            draft = self.proposer.propose(context).cut_at_eos(eos)
            self.spans.append(self._span(context.step, "draft", start))
            return draft, time.perf_counter() - start
        draft = cached.truncated(context.gamma).cut_at_eos(eos)
        used = draft.size
        if used < context.gamma and not (draft.tokens and draft.tokens[-1] in eos):
            rest = replace(context, tokens=context.tokens + draft.tokens, gamma=context.gamma - used)
            draft = draft.extended(self.proposer.propose(rest).cut_at_eos(eos))
            self.spans.append(self._span(context.step, "extend", start))
        self.used = (used, draft.size - used)
        return draft, sum(s.end - s.start for s in self.spans)

    @contextlib.contextmanager
    def verifying(self, context: DraftContext, draft: Draft, gamma: int) -> Iterator[None]:
        """Speculate in the drafter thread while the target verifies; stop it (the forward in flight ends)."""
        done, rule = len(context.tokens) - self.prompt_length, self.settings.next_gamma
        gammas = next_gammas(gamma, draft.size, done, self.settings.max_new_tokens, rule)
        self.job = Job(context.step, context.tokens, draft, gammas, acceptance_estimate(*self.counts))
        self.speculator.start(self.job)
        start = time.perf_counter()
        try:
            with torch_threads(self.verify_threads):
                yield
        finally:
            self.spans.append(self._span(context.step, "verify", start, "target"))
            start = time.perf_counter()
            self.speculator.finish(self.job)
            self.spans.append(self._span(context.step, "wait", start, "target", "for the drafter thread to stop"))

    def round_events(self, step: int, acc, start: float, times: tuple[float, float]) -> list:
        """SpeculationRound, the main thread's spans and the worker's spans; the next round's cache entry."""
        job, k, token = self.job, len(acc.accepted), acc.tokens[-1]
        self.counts = [self.counts[0] + k, self.counts[1] + k + (acc.recovered is not None)]
        entry = job.cache.get((k, token))
        self.cached = entry if entry is not None and entry.tokens else None  # an empty draft is no hit
        keys = list(job.cache)
        hit = self.cached is not None
        event = SpeculationRound(
            step=step,
            hit=hit,
            accepted=k,
            token=token,
            token_text=self.text_of(token),
            cached_tokens=self.used[0],
            extended=self.used[1],
            branches=sum(job.fanout),
            completed=job.completed,
            fanout=list(job.fanout),
            planned=list(job.planned),
            keys_k=[key[0] for key in keys],
            keys_tokens=[key[1] for key in keys],
            keys_texts=[self.text_of(key[1]) for key in keys],
            hit_rank=keys.index((k, token)) if hit else -1,
            alpha=round(job.alpha, 4),
        )
        worker = [PipelineSpan(step, "drafter", w, round(a, 6), round(b, 6), "worker", d) for w, d, a, b in job.spans]
        self.job = None
        return [event, *self.spans, *worker]

    def close(self) -> None:
        if self.job is not None:
            self.job.stop.set()
            self.job.done.wait()
        self.speculator.close()
