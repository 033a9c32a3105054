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
Deviations from the paper: one CPU worker thread drafts the branches one after another (the paper batches all
branches on a separate GPU), the fan-out per position follows the estimated outcome probability through a
single ranked list instead of the paper's closed-form allocation, and Saguaro sampling (reshaping the draft
distribution to make outcomes more predictable) and its fallback speculator are not implemented: a miss drafts
with the same drafter on the main thread. Not covered: tree drafts, several sequences, CUDA streams.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from lab.proposers import Draft, DraftContext, Proposer
from lab.sampling import SamplingConfig

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
        self._thread = threading.Thread(target=self._loop, name="ssd-drafter", daemon=True)
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
