"""Events of the system-2 family: Tree of Thoughts' nodes, steps and result; the Recursive LM's context, REPL
calls and result."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lab.trace.base import event_kind


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


def search_counters(events: Iterable[object]) -> tuple[int, int]:
    """(model calls, tokens) of a Tree of Thoughts run so far: the totals its latest node, step or result carries.
    The one reading the ToT figures and the run's stats share, so they say the same numbers."""
    last = None
    for event in events:
        last = event if isinstance(event, ThoughtNode | ThoughtStep | ThoughtResult) else last
    return (last.model_calls, last.tokens) if last else (0, 0)


@event_kind
@dataclass(frozen=True)
class RlmContext:
    """What an RLM run works on (Zhang, Kraska, Khattab 2025): the question, the context's size (it lives in the
    sandboxed REPL, never in a prompt), the task that generated it ("pasted" for user text) with its known answer
    ("" when unknown), the mode (action = constrained grammar, code = free-form ```repl code) and the sandbox's
    isolation level (full | full-no-root | unisolated: `lab.methods.rlm.sandbox.Isolation` says what each is)."""

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
