"""Trace events, the statistics folded from them, and the versioned JSON trace file (docs/architecture.md section 7).

Events are frozen dataclasses of plain Python values (ints, floats, strings, lists of those); each carries the
step index. Strategies emit them, visualizers and stats read them. This module imports neither torch nor
gradio, so visualizers can depend on it alone.
A trace file is JSON: {"format", "version", "strategy", "model", "prompt", "params", "events": [{"kind", ...}]},
plus the optional "dtype" and "precision" (weight format, `lab.engine.quant`) of the run when they are known, and
"choice": how they were chosen when either was "auto", with the reason (`lab.engine.defaults`).
Loading checks the size, the nesting depth, the version, every event kind and every field's type, and never
unpickles anything. Detail kinds of later strategies register themselves with `@event_kind`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

TRACE_FORMAT = "decoding-lab-trace"
TRACE_VERSION = 1
MAX_TRACE_BYTES = 20_000_000
MAX_EVENTS = 200_000
MAX_DEPTH = 8

EVENT_KINDS: dict[str, type] = {}


class TraceError(ValueError):
    """A trace file is malformed, too large or of an unknown version; the message says which."""


def event_kind(cls: type) -> type:
    """Register a frozen event dataclass under its class name (the "kind" field in JSON)."""
    EVENT_KINDS[cls.__name__] = cls
    return cls


@event_kind
@dataclass(frozen=True)
class TokenEmitted:
    """One token appended to the output. `source` is its provenance: target (sampled or argmax from the
    target), accepted (a draft token the target accepted), recovered (resampled after a rejection) or bonus."""

    step: int
    token_id: int
    text: str
    source: str
    t: float  # seconds since the run started
    top_ids: list[int] = field(default_factory=list)  # alternatives at this step, most likely first
    top_tokens: list[str] = field(default_factory=list)
    top_probs: list[float] = field(default_factory=list)  # probabilities of the distribution sampled from


@event_kind
@dataclass(frozen=True)
class RunFinished:
    """The run ended: why, how long it took and how many forwards of each model it cost."""

    step: int
    stop_reason: str  # eos | max_new_tokens | cancelled | error
    wall_s: float
    prompt_tokens: int
    target_forwards: int
    draft_forwards: int = 0


# --- logit-level detail events (DoLa) ---


@event_kind
@dataclass(frozen=True)
class LayerContrast:
    """One DoLa step (Chuang et al. 2024, Eq. 3-4): the JSD of each candidate premature layer from the final
    layer, the chosen layer M, the emitted token and what plain greedy (argmax of the final layer after the same
    repetition penalty) would have picked, a logit lens (top-1 token of each layer in `lens_layers`, the last
    being the final layer N) and the top-8 of each distribution named in `top_labels` ("final", "premature",
    "contrast", "after penalty": the distribution the token was chosen from, incl. temperature when sampling);
    tokens with p = 0 (outside V_head) are left out, so a list may hold fewer than 8."""

    step: int
    candidate_layers: list[int]
    divergences: list[float]  # JSD(q_N || q_j) per candidate, as the reference reduces it (mean over the vocab)
    chosen_layer: int
    mode: str  # dola | soft
    token_id: int  # the emitted token
    token_text: str
    greedy_token_id: int
    lens_layers: list[int]
    lens_tokens: list[str]
    top_labels: list[str]
    top_ids: list[list[int]]
    top_tokens: list[list[str]]
    top_probs: list[list[float]]


# --- logit-level detail events (CFG) ---


@event_kind
@dataclass(frozen=True)
class GuidanceStep:
    """One classifier-free guidance step (Sanchez et al. 2023, Eq. 7): for the union of the top-8 tokens of the
    conditional, unconditional and guided distributions (sorted by guided probability), their full-vocabulary
    log-softmax values under cond and uncond and the full-vocabulary guided probability softmax(log P_hat).
    A view can re-weight the stored log-probs for another gamma without the model (renormalized over this subset).
    Entropies and KL(guided || cond) are over the full vocabulary, in nats; token_id is the token emitted."""

    step: int
    gamma: float
    token_id: int
    token_ids: list[int]
    tokens: list[str]
    cond_logprobs: list[float]
    uncond_logprobs: list[float]
    guided_probs: list[float]
    entropy_cond: float
    entropy_uncond: float
    entropy_guided: float
    kl_guided_cond: float


# --- logit-level detail events (Mirostat) ---


@event_kind
@dataclass(frozen=True)
class MirostatStep:
    """One Mirostat step (Basu et al. 2021, Alg. 1): truncation size k (v1's k, v2's number of tokens with
    surprise <= mu), the surprise S fed back, and mu before and after mu <- mu - eta (S - tau).
    `model_surprise` = -log2 p(x) under the model's untruncated distribution at temperature 1 (EOS masked when
    the run ignores EOS), the same measure for every series. Series "mirostat" is the run itself; "top-k" and
    "top-p" are comparison replays (same prompt and seed) with `version` = their setting ("k=40", "p=0.9"),
    mu = mu_next = None and surprise = model_surprise."""

    step: int
    version: str  # v1 | v2 for series "mirostat"; the baseline's setting otherwise
    tau: float  # target surprise in bits
    mu: float | None  # before the update
    mu_next: float | None
    surprise: float  # S fed back to the controller (bits; convention-dependent)
    model_surprise: float  # -log2 p(x), untruncated, T = 1 (bits)
    k: int  # truncation size
    s_hat: float | None  # v1's Zipf exponent estimate
    token_id: int
    series: str = "mirostat"


# --- speculative detail events (SD) ---


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


# --- system 2 detail events (Tree of Thoughts) ---


@event_kind
@dataclass(frozen=True)
class ThoughtNode:
    """One node of a Tree of Thoughts search (Yao et al. 2023, Alg. 1 / 2), emitted once its fate is known.
    `text` is the thought itself (the root's is the task input); `value` is V(p_theta, s) in [0, 1] from
    `value_source`: model (sum_w p(w) v(w) / 20 over w = sure / likely / impossible with the paper's
    v = 20 / 1 / 0.001, p renormalized over the three words; `judgment` = its argmax), vote (share of the
    n sampled votes), solver (1 if the state can still reach the goal, exact), or exact (a terminal state checked
    programmatically). `solver_value` is the exact solver's verdict where the task has one (Game of 24), also
    when the model judged, so views can show agreement. status: kept (selected / explored), pruned, solution
    (a terminal thought the task accepts: reaches 24, or a kept final answer of a task without a verifier).
    `logprob` is log p(thought | constraint) of a constrained proposal (Game of 24's legal moves).
    model_calls / tokens are the run's totals when the node was emitted."""

    step: int  # BFS step (= depth) or DFS expansion index
    node_id: int
    parent: int  # -1 for the root
    depth: int
    text: str
    value: float | None
    status: str  # kept | pruned | solution
    model_calls: int
    tokens: int
    value_source: str = ""  # model | vote | solver | exact | "" (root)
    judgment: str = ""
    solver_value: float | None = None
    logprob: float | None = None


def verdict_agreement(nodes: Iterable[ThoughtNode]) -> tuple[int, int]:
    """(agree, compared) of the model's value verdicts against the exact solver, one count per emitted thought
    that the model judged and the solver checked: the verdict agrees when "sure" / "likely" (reachable) meets
    solver value 1 or "impossible" meets 0. The one definition the search's ThoughtResult, `lab eval tot` and
    the ToT view all use."""
    judged = [n for n in nodes if n.judgment and n.solver_value is not None]
    return sum((n.judgment != "impossible") == (n.solver_value == 1.0) for n in judged), len(judged)


@event_kind
@dataclass(frozen=True)
class ThoughtStep:
    """The frontier after one search step: the b states BFS kept, or the DFS stack after an expansion
    (top last). `candidates` = thoughts generated and evaluated in this step."""

    step: int
    search: str  # bfs | dfs
    frontier: list[int]
    candidates: int
    model_calls: int
    tokens: int


@event_kind
@dataclass(frozen=True)
class ThoughtResult:
    """The search's answer: the root-to-answer path of node ids, whether it is verified correct (None when
    the task has no verifier), the answer text, the run's model calls / tokens / forwards, value calls, and
    how often the model's sure-or-likely vs impossible verdict agreed with the exact solver (agree of
    compared; 0 of 0 without model values on Game of 24)."""

    step: int
    task: str
    search: str
    value_source: str
    path: list[int]
    solved: bool | None
    answer: str
    model_calls: int
    tokens: int
    forwards: int
    value_calls: int
    agree: int = 0
    compared: int = 0


# --- multi-token heads detail events (Medusa, MTPC; EAGLE reuses TreeRound) ---


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


# --- system 2 detail events (RLM) ---


@event_kind
@dataclass(frozen=True)
class RlmContext:
    """What an RLM run works on (Zhang, Kraska, Khattab 2025): the question, the context's size (it lives in the
    sandboxed REPL, never in a prompt), the task that generated it ("pasted" for user text) with its known answer
    ("" when unknown), the mode (action = constrained grammar, code = free-form ```repl code) and the sandbox's
    isolation level (full | unisolated: `lab.methods.rlm.sandbox.LEVEL_TEXT` says what each is)."""

    step: int
    question: str
    task: str
    expected: str
    context_chars: int
    context_tokens: int
    prefix: str
    mode: str
    isolation: str


@event_kind
@dataclass(frozen=True)
class ReplCall:
    """One node of the RLM call tree. role "root": one root-model turn (its code or chosen action, the REPL
    output it got back, truncated, or the error); role "sub": one llm_query(prompt, text) served by the parent
    (depth >= 1; `code` holds the sub-prompt, `output` the answer). ranges: [start, end) character ranges of the
    context this call read. tokens: prompt + generated tokens of the model call(s) this node made. In action
    mode, `alternatives` / `scores` are the grammar's candidate actions and their log-probabilities under the
    grammar (log-softmax over the allowed next tokens only, summed over the action's tokens)."""

    step: int
    call_id: int
    parent_id: int  # -1 for root turns
    depth: int
    role: str  # root | sub
    code: str
    action: str
    ranges: list[list[int]]
    output: str
    error: str
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    final: str | None = None
    alternatives: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


@event_kind
@dataclass(frozen=True)
class RlmResult:
    """The RLM run's answer and why it stopped (final | max_iterations | token_budget | error), with totals over
    every model call (root and sub), and whether the answer matches the task's known answer (None if unknown)."""

    step: int
    answer: str
    correct: bool | None
    stop: str
    root_calls: int
    sub_calls: int
    tokens: int
    context_chars_read: int


# --- speculative detail events (SSD) ---


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


# --- speculative detail events (EAGLE) ---


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


Event = Any  # any registered event dataclass


@dataclass(frozen=True)
class Stats:
    """Aggregates of a run, folded from its events in one place (`summarize`)."""

    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_forwards: int
    forwards_per_token: float
    stop_reason: str
    # speculative runs only (None without DraftRound events): alpha = accepted / examined draft tokens
    # (Leviathan et al. 2023's acceptance rate; tokens after a rejection are never examined) and the mean
    # number of tokens a round emits (accepted + the recovered or bonus token)
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _draft_stats(events: list[Event]) -> tuple[float | None, float | None]:
    """(acceptance rate, mean accepted length) folded from DraftRound events; None where undefined."""
    rounds = [e for e in events if isinstance(e, DraftRound)]
    if not rounds:
        return None, None
    accepted = sum(r.accepted for r in rounds)
    examined = accepted + sum(r.recovered is not None for r in rounds)
    emitted = accepted + sum(r.recovered is not None or r.bonus is not None for r in rounds)
    return (round(accepted / examined, 4) if examined else None), round(emitted / len(rounds), 4)


def summarize(events: list[Event]) -> Stats:
    """Fold events into run statistics; works mid-run too (time and forwards from the latest events)."""
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    wall = finished.wall_s if finished else (tokens[-1].t if tokens else 0.0)
    forwards = finished.target_forwards if finished else len({e.step for e in tokens})
    n = len(tokens)
    acceptance_rate, mean_accepted_length = _draft_stats(events)
    if mean_accepted_length is None:  # tree rounds (Medusa, MTPC, EAGLE)
        acceptance_rate, mean_accepted_length = _tree_stats(events)
    return Stats(
        new_tokens=n,
        wall_s=round(wall, 4),
        tokens_per_s=round(n / wall, 2) if wall > 0 else 0.0,
        target_forwards=forwards,
        forwards_per_token=round(forwards / n, 3) if n else 0.0,
        stop_reason=finished.stop_reason if finished else "running",
        acceptance_rate=acceptance_rate,
        mean_accepted_length=mean_accepted_length,
    )


@dataclass
class Trace:
    """A recorded run: what was asked and every event the strategy emitted."""

    strategy: str
    model: str
    prompt: str
    params: dict
    events: list[Event] = field(default_factory=list)
    dtype: str = ""  # e.g. bfloat16 ("" when not recorded)
    precision: str = ""  # weight format of the linears: bf16 (float weights), int8, int4 or a requested "auto"
    choice: str = ""  # how dtype and precision were chosen, and why ("" when not recorded)
    # where this run branched from another (lab.app.branching.branch_record); None for a run from the prompt
    branch: dict | None = None
    # the target's forward path for the whole run (lab.engine.forward_path: name, reason, row_invariant); None when
    # not recorded (older traces, runs whose model loads elsewhere)
    forward_path: dict | None = None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEmitted))

    @property
    def token_ids(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEmitted)]


def event_to_dict(event: Event) -> dict:
    return {"kind": type(event).__name__, **dataclasses.asdict(event)}


def to_json(trace: Trace) -> str:
    """Serialize a trace to the versioned JSON format."""
    payload = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "strategy": trace.strategy,
        "model": trace.model,
        "prompt": trace.prompt,
        "params": trace.params,
        "events": [event_to_dict(e) for e in trace.events],
    }
    payload |= {key: value for key in ("dtype", "precision", "choice") if (value := getattr(trace, key))}
    if trace.branch is not None:  # optional: traces without it (all older ones) load as before
        payload["branch"] = trace.branch
    if trace.forward_path is not None:  # optional too
        payload["forward_path"] = trace.forward_path
    return json.dumps(payload, ensure_ascii=False, allow_nan=False)


def _depth(value: Any, limit: int, level: int = 0) -> None:
    if level > limit:
        raise TraceError(f"trace is nested deeper than {limit} levels")
    if isinstance(value, dict):
        for item in value.values():
            _depth(item, limit, level + 1)
    elif isinstance(value, list):
        for item in value:
            _depth(item, limit, level + 1)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # a huge JSON integer
        return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in a trace")


def _check_type(value: Any, hint: Any, where: str) -> None:
    """Check one JSON value against a field annotation (int, float, str, bool, list[...], X | None, dict)."""
    text = str(hint)
    if "None" in text and value is None:
        return
    if text.startswith("list"):
        if not isinstance(value, list):
            raise TraceError(f"{where}: expected a list")
        inner = hint.__args__[0] if getattr(hint, "__args__", None) else Any
        for i, item in enumerate(value):
            _check_type(item, inner, f"{where}[{i}]")
        return
    if hint is Any or text.startswith("dict"):
        return
    base = next((t for t in (bool, int, float, str) if t.__name__ in text), None)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value),
        str: isinstance(value, str),
    }.get(base, True)
    if not ok:
        expected = getattr(hint, "__name__", text)
        got = "a non-finite number" if base is float and isinstance(value, (int, float)) else type(value).__name__
        raise TraceError(f"{where}: expected {expected}, got {got}")


def event_from_dict(data: Any, index: int) -> Event:
    """Validate and build one event from its JSON object."""
    if not isinstance(data, dict):
        raise TraceError(f"events[{index}] is not an object")
    kind = data.get("kind")
    cls = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceError(f"events[{index}]: unknown event kind {kind!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(data) - set(fields) - {"kind"}
    if extra:
        raise TraceError(f"events[{index}] ({kind}): unknown fields {sorted(extra)}")
    values = {}
    for name, spec in fields.items():
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise TraceError(f"events[{index}] ({kind}): missing field {name!r}")
            continue
        _check_type(data[name], hints[name], f"events[{index}].{name}")
        values[name] = data[name]
    return cls(**values)


def from_json(text: str | bytes) -> Trace:
    """Load a trace file, rejecting anything oversized, too deep, of another version or not matching the schema."""
    size = len(text) if isinstance(text, (bytes, bytearray)) else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"trace is {size} bytes; the limit is {MAX_TRACE_BYTES}")
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:
        raise TraceError(f"not valid JSON: {error}") from None
    _depth(payload, MAX_DEPTH)
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise TraceError(f"not a Decoding Lab trace (expected format {TRACE_FORMAT!r})")
    version = payload.get("version")
    if type(version) is not int or version != TRACE_VERSION:
        raise TraceError(f"unsupported trace version {payload.get('version')!r}; this lab reads {TRACE_VERSION}")
    for key, kind in (("strategy", str), ("model", str), ("prompt", str), ("params", dict), ("events", list)):
        if not isinstance(payload.get(key), kind):
            raise TraceError(f"field {key!r} must be a {kind.__name__}")
    if len(payload["events"]) > MAX_EVENTS:
        raise TraceError(f"trace has {len(payload['events'])} events; the limit is {MAX_EVENTS}")
    for key, limit in (("dtype", 40), ("precision", 40), ("choice", 400)):
        if not isinstance(payload.get(key, ""), str) or len(payload.get(key, "")) > limit:
            raise TraceError(f"field {key!r} must be a string of at most {limit} characters")
    branch = payload.get("branch")
    if branch is not None and not isinstance(branch, dict):
        raise TraceError("field 'branch' must be an object")
    path = payload.get("forward_path")
    if path is not None and not (isinstance(path, dict) and isinstance(path.get("name"), str)):
        raise TraceError("field 'forward_path' must be an object with a string 'name'")
    events = [event_from_dict(item, i) for i, item in enumerate(payload["events"])]
    trace = Trace(payload["strategy"], payload["model"], payload["prompt"], payload["params"], events, branch=branch)
    trace.forward_path = path
    trace.dtype, trace.precision = payload.get("dtype", ""), payload.get("precision", "")
    trace.choice = payload.get("choice", "")
    return trace
