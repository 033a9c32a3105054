"""The proposer contract of speculative decoding (DESIGN.md section 6): what a drafter gets and what it returns.

A proposer turns the committed sequence into a draft: `propose(context) -> Draft(tokens, q_draft, tree)`.
`q_draft` holds the distributions the tokens were drawn from (rows [gamma, V], after the same logits processors
as the target) or None for a deterministic drafter (prompt lookup); `tree` stays None for chain drafters (EAGLE,
Medusa and MTPC fill it). After verification the strategy calls `accept(n)` (the first n draft tokens were
kept) so a proposer with a KV cache can roll back; proposers must stay correct without the hint, because
`propose` may be called on any context (SSD speculates on several possible verification outcomes).
For SSD (`lab.ssd`) a context may ask for `fanout` candidates per drafted position (the drafter's top tokens at
the position each draft token was drawn at, `Draft.top_ids` / `top_probs`) and carry `should_stop`, polled
between forwards so a speculation can be cut short (the draft is then shorter, still drawn from q).
Not covered: batched proposals, proposers that run on another device or process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lab.sampling import SamplingConfig
from lab.tree import TreeAttention


@dataclass(frozen=True)
class DraftContext:
    """What a proposer sees: the committed tokens (prompt + every emitted token, the last one not yet verified),
    how many tokens to draft at most, the processors to apply (same as the target's) and the run's RNG."""

    tokens: list[int]
    gamma: int
    config: SamplingConfig
    generator: torch.Generator
    eos_token_ids: tuple[int, ...] = ()
    fanout: int = 0  # SSD: report this many top candidates per drafted position (0 = none)
    should_stop: Callable[[], bool] | None = None  # SSD: polled between forwards; True = return what is drafted


@dataclass(frozen=True)
class Draft:
    """Drafted tokens x_1..x_gamma; q_draft[i] is the distribution x_{i+1} was drawn from ([gamma, V]) or None
    when the drafter is deterministic (then q is one-hot at x_i, Leviathan et al. 2023, Alg. 1 with q = delta)."""

    tokens: list[int]
    q_draft: torch.Tensor | None = None  # [gamma, V] float32
    tree: TreeAttention | None = None  # chain drafters leave it None
    # SSD: per drafted position, the drafter's top candidates there (most likely first) and their probabilities
    top_ids: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if self.q_draft is not None and self.q_draft.shape[0] != len(self.tokens):
            raise ValueError(f"q_draft has {self.q_draft.shape[0]} rows for {len(self.tokens)} draft tokens")

    def truncated(self, n: int) -> Draft:
        """The first n draft tokens (and their q rows and candidates)."""
        q = self.q_draft[:n] if self.q_draft is not None else None
        top_ids = self.top_ids[:n] if self.top_ids is not None else None
        top_probs = self.top_probs[:n] if self.top_probs is not None else None
        return Draft(self.tokens[:n], q, self.tree, top_ids, top_probs)

    def dropped(self, n: int) -> Draft:
        """The draft without its first n tokens (rows dropped alike)."""
        q = self.q_draft[n:] if self.q_draft is not None else None
        top_ids = self.top_ids[n:] if self.top_ids is not None else None
        top_probs = self.top_probs[n:] if self.top_probs is not None else None
        return Draft(self.tokens[n:], q, self.tree, top_ids, top_probs)

    def extended(self, more: Draft) -> Draft:
        """This draft followed by `more` (drafted after it); q rows and candidates are kept only if both have them."""
        if not more.tokens:
            return self
        if not self.tokens:
            return more
        both_q = self.q_draft is not None and more.q_draft is not None
        q = torch.cat([self.q_draft, more.q_draft]) if both_q else None
        ids = self.top_ids + more.top_ids if self.top_ids is not None and more.top_ids is not None else None
        probs = self.top_probs + more.top_probs if self.top_probs is not None and more.top_probs is not None else None
        return Draft(self.tokens + more.tokens, q, None, ids, probs)


@runtime_checkable
class Proposer(Protocol):
    """A drafter. `name` labels it in events; `forwards` counts the forward passes it has run (draft_forwards)."""

    name: str

    @property
    def forwards(self) -> int: ...

    def propose(self, context: DraftContext) -> Draft: ...

    def accept(self, n_accepted: int) -> None:
        """The first `n_accepted` tokens of the last draft were kept; drop what follows them from any cache."""

    def close(self) -> None:
        """Free caches (called in the strategy's `finally`)."""


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
