"""What every draft-then-verify method exchanges (docs/architecture.md section 6): the draft, what a proposer sees, the
proposer contract, and what the loop tells a proposer after verification.

A `Draft` is a chain x_1..x_n (`parents` None) or a tree given by parent indices (node i hangs under node
parents[i]; -1 = under the root, the last committed token; parents come before children). `q` holds, per node,
the distribution its token was drawn from ([n, V] on the device of the logits it came from) or is None for a
deterministic drafter (prompt lookup, greedy drafting, top-k trees: q is then one-hot at the drafted token,
Leviathan et al. 2023, Alg. 1 with q = delta). The rest is what the views show: q(x) of each node, its rank
among the drafter's candidates, per drafted position the drafter's top candidates (SSD ranks its guesses with
them, the heads heatmap draws them), and the proposer's own detail events (EagleDraft, MixtureRound).

A proposer turns a `DraftContext` into a draft (`propose`) and learns the verified outcome (`accept`, with the
target's features of the committed positions when it asked for them through `feature_layers`). Proposers must
stay correct on any context: SSD proposes on guessed contexts in a worker thread.
Not covered: batched proposals (several sequences), proposers on another device than the target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from lab.engine.sampling import SamplingConfig


@dataclass(frozen=True)
class DraftContext:
    """What a proposer sees: the committed tokens (prompt + emitted; the last is the root, whose target logits
    come from the next verify forward), the draft budget (chain length or tree depth), the processors and the
    run's generator (on the model's device), plus what SSD and the views need."""

    tokens: list[int]
    gamma: int
    config: SamplingConfig
    generator: torch.Generator
    eos_token_ids: tuple[int, ...] = ()
    fanout: int = 0  # SSD: report this many top candidates per drafted position (0 = none)
    should_stop: Callable[[], bool] | None = None  # SSD: polled between forwards; True = return what is drafted
    step: int = 0
    text_of: Callable[[int], str] = str  # token id -> text, for the proposer's detail events


@dataclass(frozen=True)
class Draft:
    """Drafted tokens (model ids) as a chain (`parents` None) or a tree; see the module docstring."""

    tokens: list[int]
    parents: list[int] | None = None  # None = chain
    q: torch.Tensor | None = None  # [n, V] float32, or None for a deterministic drafter
    q_token: list[float] | None = None  # q(x_i) under the drafter (for the views), None = 1.0 (one-hot)
    ranks: list[int] | None = None  # rank of each token among the drafter's candidates at its node
    top_ids: list[list[int]] | None = None  # per drafted position: the drafter's top candidates
    top_probs: list[list[float]] | None = None
    events: tuple = field(default=(), compare=False)  # the proposer's detail events for this round

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"q has {self.q.shape[0]} rows for {n} draft tokens")
        if self.parents is not None:
            if len(self.parents) != n:
                raise ValueError(f"{len(self.parents)} parents for {n} draft tokens")
            for i, parent in enumerate(self.parents):
                if not -1 <= parent < i:
                    raise ValueError(f"parents[{i}] = {parent}: a parent must be -1 or an earlier node")

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents is None or all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def tree_parents(self) -> list[int]:
        """Parent list of the draft seen as a tree (a chain is the tree -1, 0, 1, ...)."""
        return list(self.parents) if self.parents is not None else list(range(-1, self.size - 1))

    @property
    def depths(self) -> list[int]:
        depths: list[int] = []
        for parent in self.tree_parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        """Child node indices of `node` (-1 = the root), in node order."""
        return [i for i, parent in enumerate(self.tree_parents) if parent == node]

    def q_of(self, node: int) -> float:
        return 1.0 if self.q_token is None else self.q_token[node]

    def truncated(self, n: int) -> Draft:
        """The first n tokens of a chain draft (rows and candidates cut alike)."""
        self._need_chain("truncated")
        return self._sliced(slice(None, n))

    def dropped(self, n: int) -> Draft:
        """A chain draft without its first n tokens."""
        self._need_chain("dropped")
        return self._sliced(slice(n, None))

    def _sliced(self, part: slice) -> Draft:
        """The chain's positions in `part`, every per-position field cut alike (the detail events are kept)."""
        cut = lambda x: x[part] if x is not None else None  # noqa: E731
        return replace(
            self,
            tokens=self.tokens[part],
            parents=None,
            q=cut(self.q),
            q_token=cut(self.q_token),
            ranks=cut(self.ranks),
            top_ids=cut(self.top_ids),
            top_probs=cut(self.top_probs),
        )

    def extended(self, more: Draft) -> Draft:
        """This chain followed by `more` (drafted after it). Both parts must say alike whether they carry q:
        joining a sampled part with a deterministic one would lose what the acceptance rule needs."""
        self._need_chain("extended")
        more._need_chain("extended")
        if not more.tokens:
            return self
        if not self.tokens:
            return more
        if (self.q is None) != (more.q is None):
            raise ValueError("cannot join a draft that has q with one that has none (q = one-hot is not known)")
        join = lambda a, b: a + b if a is not None and b is not None else None  # noqa: E731
        return Draft(
            self.tokens + more.tokens,
            None,
            torch.cat([self.q, more.q]) if self.q is not None else None,
            join(self.q_token, more.q_token),
            join(self.ranks, more.ranks),
            join(self.top_ids, more.top_ids),
            join(self.top_probs, more.top_probs),
        )

    def cut_at_eos(self, eos_ids: tuple[int, ...]) -> Draft:
        """A chain drops what follows its first EOS (the target would stop there)."""
        if self.parents is not None:
            return self
        return next((self.truncated(i + 1) for i, t in enumerate(self.tokens) if t in eos_ids), self)

    def _need_chain(self, what: str) -> None:
        if not self.is_chain:
            raise ValueError(f"Draft.{what} works on chain drafts only")


@dataclass(frozen=True)
class Verified:
    """What the loop tells a proposer after a round: how many draft tokens were kept and, for a proposer with
    `feature_layers`, the target's features at the root and the accepted nodes ([n_accepted + 1, F]) paired with
    the tokens that followed them (`tokens`: the accepted tokens and the next one), the root at `first_position`."""

    n_accepted: int
    tokens: list[int]
    first_position: int
    features: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """A drafter. `name` labels it in events; `forwards` counts its forward passes (draft_forwards);
    `feature_layers` names the target hidden states it reads (indices into hidden_states, () = none)."""

    name: str
    feature_layers: tuple[int, ...]

    @property
    def forwards(self) -> int: ...

    def propose(self, context: DraftContext) -> Draft: ...

    def accept(self, verified: Verified) -> None:
        """The round's outcome: drop rejected entries from any cache, read the target's features."""

    def close(self) -> None:
        """Free caches (called in the loop's `finally`)."""


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
