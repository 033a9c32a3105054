"""Events of the speculative and multi-token-head families: chain rounds (SD), tree rounds (Medusa, MTPC,
EAGLE), MTPC's mixture, SSD's pipeline spans and speculation rounds, EAGLE's draft growth."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.trace.base import Event, RunFinished, event_kind


@event_kind
@dataclass(frozen=True)
class DraftRound:
    """One speculative round (Leviathan et al. 2023, Alg. 1): gamma drafted tokens x_i, verified in one target
    forward. q / p: q_i(x_i) and p_i(x_i) of every drafted token (q = 1.0 for a deterministic drafter, whose q is
    one-hot at x_i; p is the processed target distribution, one-hot argmax in greedy mode). uniforms: u_i of the
    examined tokens (x_i accepted iff u_i < min(1, p/q)). accepted: how many were kept; then either `recovered`
    (drawn from norm(max(0, p - q)) at the first rejection, whose top 5 are residual_top_*) or `bonus` (drawn
    from p after a fully accepted draft); final_text is that token's text. alt_*: per drafted position the top
    tokens of p + q with their p and q. gamma is the draft length asked for; draft_s / verify_s are seconds."""

    step: int
    drafter: str
    gamma: int
    draft_tokens: list[int]
    draft_texts: list[str]
    q: list[float]
    p: list[float]
    uniforms: list[float]
    accepted: int
    recovered: int | None = None
    bonus: int | None = None
    final_text: str = ""
    residual_top_ids: list[int] = field(default_factory=list)
    residual_top_texts: list[str] = field(default_factory=list)
    residual_top_probs: list[float] = field(default_factory=list)
    alt_texts: list[list[str]] = field(default_factory=list)
    alt_p: list[list[float]] = field(default_factory=list)
    alt_q: list[list[float]] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0


@event_kind
@dataclass(frozen=True)
class TreeRound:
    """One tree-speculation round (Cai et al. 2024 Medusa, Sec. 2.1.2; also EAGLE and MTPC): a draft tree
    hanging off the last committed token (the root, not a node), verified in one target forward with the tree
    attention mask. Per node i: `tokens[i]` / `texts[i]`, `parents[i]` (-1 = child of the root, parents come
    first), `depths[i]` (0 = first drafted position), `heads[i]` (which head or draft step proposed it: Medusa
    head k, EAGLE depth), `ranks[i]` (rank of the token in that head's distribution, 0 = top-1), `q[i]` (the
    drafter's probability of the token given its parent: a Medusa head's marginal, MTPC's conditional, EAGLE's
    draft prob) and `p[i]` (the target's processed probability of the token after the root-to-parent path).
    `accepted` lists the kept node indices root first; `next_token` follows them (source "bonus" when the path
    reached a leaf, "recovered" when it stopped early: the target's argmax / residual draw). `emitted` is how many
    tokens the round added to the output (accepted + next, fewer when EOS or the budget cut it): the mean of
    `emitted` over rounds is the mean accepted length tau (bonus included). `head_top_*[k]` are the top tokens of
    draft position k's marginal at this round (heatmap rows). mode: greedy | typical | sample.
    draft_s: seconds spent drafting the tree; verify_s: seconds of the verify forward (tree mask included)."""

    step: int
    method: str
    mode: str
    root_token: int
    root_text: str
    tokens: list[int]
    texts: list[str]
    parents: list[int]
    depths: list[int]
    heads: list[int]
    ranks: list[int]
    q: list[float]
    p: list[float]
    accepted: list[int]
    next_token: int
    next_text: str
    next_source: str  # bonus | recovered
    emitted: int
    head_top_ids: list[list[int]] = field(default_factory=list)
    head_top_texts: list[list[str]] = field(default_factory=list)
    head_top_probs: list[list[float]] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0


@event_kind
@dataclass(frozen=True)
class MixtureRound:
    """One MTPC round (Grivas et al. 2025): the mixture weights P(z | h) of the r components, the posterior
    P(z | h, x_{t+1}) after the root token (the target's own next token), and for the first two draft positions
    the candidate pairs (a, b) with their probability under the joint, sum_z w_z p_1z(a) p_2z(b), next to the
    product of the marginals q_1(a) q_2(b) (what independent heads would assume). A pair with joint well below
    the product is one the circuit suppresses."""

    step: int
    prior: list[float]
    posterior: list[float]
    pair_ids: list[list[int]]
    pair_texts: list[list[str]]
    joint: list[float]
    product: list[float]


def _tree_stats(events: list[Event]) -> tuple[float | None, float | None]:
    """(acceptance rate, mean accepted length) folded from TreeRound events, like `_draft_stats`: accepted nodes
    over accepted + rounds that stopped before a leaf; tau = mean tokens emitted per round (bonus included)."""
    rounds = [e for e in events if isinstance(e, TreeRound)]
    if not rounds:
        return None, None
    accepted = sum(len(r.accepted) for r in rounds)
    examined = accepted + sum(r.next_source == "recovered" for r in rounds)
    return (round(accepted / examined, 4) if examined else None), round(sum(r.emitted for r in rounds) / len(rounds), 4)


@event_kind
@dataclass(frozen=True)
class PipelineSpan:
    """A timed piece of work of a speculative round, in seconds since the run started. who: target (its verify
    forward, or the main thread waiting for the drafter thread to stop: what = wait) or drafter; thread: main
    or worker (SSD's drafter thread). what: draft (the round's draft, drafted on the main thread), extend
    (drafting the rest of a cached draft that was cut short), verify, wait, probe (SSD: the drafter's guess of
    the bonus token and the next draft after it), branch (SSD: the next draft for a guessed outcome)."""

    step: int  # the round
    who: str  # target | drafter
    what: str
    start: float
    end: float
    thread: str = "main"  # main | worker
    detail: str = ""


@event_kind
@dataclass(frozen=True)
class SpeculationRound:
    """SSD (Kumar, Dao, May 2026) for one round: while the target verified the round's draft, the drafter thread
    pre-drafted the next round for guessed outcomes (k accepted, then token t). hit: this round's actual outcome
    was in the speculation cache, so the next round's draft comes from it. cached_tokens / extended: how this
    round's own draft was made: tokens taken from the cache (the previous round hit) and tokens drafted after
    them on the main thread (the cached branch had been cut short). fanout / planned: per position k = 0..n, the
    guesses pre-drafted / known (the drafter's top-F candidates). keys_*: the cached outcomes, in drafting
    order; hit_rank is the actual outcome's index there (-1: a miss). alpha: the estimate that ranked them."""

    step: int
    hit: bool
    accepted: int
    token: int | None
    token_text: str
    cached_tokens: int
    extended: int
    branches: int
    completed: int
    fanout: list[int]
    planned: list[int]
    keys_k: list[int]
    keys_tokens: list[int]
    keys_texts: list[str]
    hit_rank: int
    alpha: float


def speculation_stats(events: list) -> dict[str, float]:
    """SSD aggregates (empty without SpeculationRound events): cache hit rate over rounds that needed a next
    draft, mean branches pre-drafted per round, and the share of the wall time the drafter thread was busy."""
    rounds = [e for e in events if isinstance(e, SpeculationRound)]
    if not rounds:
        return {}
    worker = sum(s.end - s.start for s in events if isinstance(s, PipelineSpan) and s.thread == "worker")
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    needed = rounds[:-1] if finished is not None else rounds  # the last round needs no next draft
    hits = sum(r.hit for r in needed)
    return {
        "ssd_hit_rate": round(hits / len(needed), 4) if needed else 0.0,
        "ssd_branches_per_round": round(sum(r.branches for r in rounds) / len(rounds), 3),
        "ssd_drafter_busy": round(worker / finished.wall_s, 4) if finished and finished.wall_s > 0 else 0.0,
    }


@event_kind
@dataclass(frozen=True)
class EagleDraft:
    """How one EAGLE-2 round grew its draft tree (Li et al. 2024, EAGLE-2, Sec. 4): every candidate the head
    proposed, in creation order (depth 0 = the top-`branch` after the root; each further depth = the top-`branch`
    children of the `branch` frontier nodes of highest c(x)). Per candidate: token / text, parent (a candidate
    index, -1 = the root), depth, score c(x) = sum of log q along its path, q(x | parent), rank among its
    parent's children, expanded (was in a frontier) and kept (its node index in the same step's TreeRound, -1 =
    cut by the rerank, which keeps the `total_tokens` best c(x)). `threshold` is the lowest kept c(x)."""

    step: int
    branch: int
    depth: int
    total_tokens: int
    tokens: list[int]
    texts: list[str]
    parents: list[int]
    depths: list[int]
    scores: list[float]
    q: list[float]
    ranks: list[int]
    expanded: list[bool]
    kept: list[int]
    threshold: float
    head_forwards: int
    draft_s: float = 0.0
