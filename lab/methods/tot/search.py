"""Tree of Thoughts search (Yao et al. 2023): ToT-BFS (Alg. 1) and ToT-DFS (Alg. 2) over a task's thoughts.

BFS: S_0 = {root}; for t = 1..T: S'_t = {[s, z] : s in S_{t-1}, z in G(p_theta, s, k)} (k thoughts per
state), V_t = V(p_theta, S'_t), S_t = the b best of S'_t by value. Terminal states leave the frontier; the
answer is the best terminal or frontier state (a verified solution first).
DFS: expand the most promising state first; a child with V(s') < prune_below is pruned (the paper's
V > v_th, with >= so that 0 keeps everything), kept children are explored best first, backtracking when a
subtree is exhausted; it stops at the first solution or after `max_expansions` expansions.
Value modes: model (one value prompt per distinct state, cached by state as the paper does, the prompts of a
step's candidates scored together in one tree forward; on Game of 24 the exact solver is also consulted,
without a model call, to count agreement), vote (one vote prompt over the candidates of a step, n votes sampled
from it), solver (exact solvability, Game of 24 only). Value and vote options end with the newline that ends
the answer line (" sure\n", " 3\n") and are scored as full sequences, so " 1" never absorbs " 10".." 19" and
" sure" never absorbs " surely". Terminal Game of 24 states are always checked exactly.
The thoughts of every BFS frontier state are proposed together too (one forward for Game of 24).
Deliberate differences: siblings with the same text are merged (free-text tasks), and ties in value keep the
proposal order (for Game of 24, the order of the Gumbel top-k draw).
Not covered: the paper's crossword task, its value sampling with written reasoning (see lab.methods.tot.prompts), and
pruning by a learned heuristic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.methods.tot.lm import CallModel
from lab.methods.tot.prompts import VOTE, value_options, vote_options
from lab.methods.tot.tasks import Thought, value_from_logps
from lab.params import InputError
from lab.trace import Event, ThoughtNode, ThoughtResult, ThoughtStep, verdict_agreement

SEARCHES = ("bfs", "dfs")
VALUE_MODES = ("model", "vote", "solver")


@dataclass(frozen=True)
class SearchConfig:
    search: str = "bfs"
    value: str = "model"
    k: int = 8  # thoughts generated per state
    breadth: int = 5  # b, states kept per BFS step
    temperature: float = 0.7
    n_votes: int = 5
    prune_below: float = 0.05
    max_expansions: int = 20


@dataclass
class Node:
    id: int
    parent: int
    depth: int
    thought: Thought
    value: float | None = None
    source: str = ""
    judgment: str = ""
    solver_value: float | None = None
    status: str = "kept"


class TreeSearch:
    """One search over one task input; `run()` streams ThoughtNode / ThoughtStep events and a ThoughtResult."""

    def __init__(self, task: object, lm: CallModel, config: SearchConfig, generator: torch.Generator) -> None:
        if config.search not in SEARCHES or config.value not in VALUE_MODES:
            raise InputError(f"search must be one of {SEARCHES} and value one of {VALUE_MODES}.")
        if config.value == "solver" and not task.has_solver:
            raise InputError(f"The {task.name} task has no exact solver; use value = model or vote.")
        self.task, self.lm, self.config, self.generator = task, lm, config, generator
        self.nodes: list[Node] = []
        self.cache: dict[object, tuple[float, str]] = {}
        self.value_calls = 0
        self.emitted: list[ThoughtNode] = []

    # --- building blocks -------------------------------------------------------------------------------
    def add(self, parent: Node | None, thought: Thought) -> Node:
        node = Node(len(self.nodes), parent.id if parent else -1, parent.depth + 1 if parent else 0, thought)
        self.nodes.append(node)
        return node

    def path(self, node: Node) -> list[Node]:
        chain = [node]
        while chain[-1].parent >= 0:
            chain.append(self.nodes[chain[-1].parent])
        return chain[::-1]

    def terminal(self, node: Node) -> bool:
        return self.task.is_terminal(node.thought.state, node.depth)

    def solution(self, node: Node) -> bool:
        return self.terminal(node) and self.task.is_solution(node.thought.state, node.depth)

    def expand(self, nodes: list[Node]) -> list[Node]:
        """G(p_theta, s, k) for every s in `nodes`: k thoughts each (batched where the task can)."""
        c = self.config
        states = [n.thought.state for n in nodes]
        proposals = self.task.propose_many(self.lm, states, c.k, c.temperature, self.generator)
        return [self.add(node, t) for node, thoughts in zip(nodes, proposals, strict=True) for t in thoughts]

    def evaluate(self, nodes: list[Node]) -> None:
        """V(p_theta, S): set value and source of every node (exact check first, then the chosen mode)."""
        judged = []
        for node in nodes:
            exact = self.task.exact_value(node.thought.state)
            if exact is not None:
                node.value, node.source = exact, "exact"
            elif self.config.value == "solver":
                node.value, node.source = self.task.solver_value(node.thought.state), "solver"
            else:
                judged.append(node)
        if self.config.value == "vote":
            self._vote(judged)
        elif judged:
            self._model_values(judged)

    def _model_values(self, nodes: list[Node]) -> None:
        """The value prompt of every distinct uncached state, all in one forward (one model call each)."""
        states = list(dict.fromkeys(n.thought.state for n in nodes if n.thought.state not in self.cache))
        if states:
            queries = [self.task.value_query(s) for s in states]
            options = value_options()
            scores = self.lm.score_many(queries[0][0], [(suffix, options) for _, suffix in queries])
            for state, logps in zip(states, scores, strict=True):
                self.cache[state] = value_from_logps(logps)
                self.value_calls += 1
        for node in nodes:
            node.value, node.judgment = self.cache[node.thought.state]
            node.source = "model"
            if self.task.has_solver:
                node.solver_value = self.task.solver_value(node.thought.state)

    def _vote(self, nodes: list[Node]) -> None:
        """The paper's vote: the model picks the most promising choice, n_votes times; V = share of votes."""
        if len(nodes) == 1:
            nodes[0].value, nodes[0].source = 1.0, "vote"
        if len(nodes) <= 1:
            return
        choices = "".join(f"Choice {i}:\n{self.task.choice(self._thoughts(n))}\n" for i, n in enumerate(nodes, 1))
        suffix = f"Instruction: {self.task.instruction()}\n{choices}The best choice is"
        logps = torch.tensor(self.lm.score(VOTE, suffix, vote_options(len(nodes))))  # full " i\n" sequences
        self.value_calls += 1
        probs = (logps / self.config.temperature).softmax(0)
        votes = torch.multinomial(
            probs.to(self.generator.device), self.config.n_votes, replacement=True, generator=self.generator
        )
        counts = torch.bincount(votes, minlength=len(nodes)).tolist()
        for node, count in zip(nodes, counts, strict=True):
            node.value, node.source = count / self.config.n_votes, "vote"

    def _thoughts(self, node: Node) -> list[Thought]:
        return [n.thought for n in self.path(node)]

    def emit(self, node: Node, status: str, step: int) -> ThoughtNode:
        node.status = status
        event = ThoughtNode(
            step=step,
            node_id=node.id,
            parent=node.parent,
            depth=node.depth,
            text=node.thought.text,
            value=node.value,
            status=status,
            model_calls=self.lm.usage.model_calls,
            tokens=self.lm.usage.tokens,
            value_source=node.source,
            judgment=node.judgment,
            solver_value=node.solver_value,
            logprob=node.thought.logprob,
        )
        self.emitted.append(event)
        return event

    def frontier(self, step: int, frontier: list[Node], candidates: int) -> ThoughtStep:
        usage = self.lm.usage
        ids = [n.id for n in frontier]
        return ThoughtStep(step, self.config.search, ids, candidates, usage.model_calls, usage.tokens)

    def status(self, node: Node, kept: bool) -> str:
        return "pruned" if not kept else "solution" if self.solution(node) else "kept"

    # --- the two searches ------------------------------------------------------------------------------
    def bfs(self, root: Node) -> Iterator[Event]:
        """Yao et al. 2023, Alg. 1 (ToT-BFS); returns the answer node."""
        frontier, finished = [root], []
        for step in range(1, self.task.depth + 1):
            expandable = [n for n in frontier if not self.terminal(n)]
            if not expandable:
                break
            candidates = self.expand(expandable)  # 1. S'_t
            self.evaluate(candidates)  # 2. V_t
            kept = sorted(candidates, key=lambda n: -n.value)[: self.config.breadth]  # 3. S_t = best b
            kept_ids = {n.id for n in kept}
            for node in candidates:
                yield self.emit(node, self.status(node, node.id in kept_ids), step)
            finished += [n for n in kept if self.terminal(n)]
            frontier = [n for n in kept if not self.terminal(n)]
            yield self.frontier(step, kept, len(candidates))
        pool = finished + frontier
        return max(pool, key=lambda n: (self.solution(n), n.value)) if pool else root

    def dfs(self, root: Node) -> Iterator[Event]:
        """Yao et al. 2023, Alg. 2 (ToT-DFS) with an expansion budget; returns the answer node."""
        stack, found, expansions = [root], None, 0
        while stack and found is None and expansions < self.config.max_expansions:
            node = stack.pop()
            expansions += 1
            children = self.expand([node])  # 1. G(p_theta, s, k)
            self.evaluate(children)  # 2. V(p_theta, {s'})
            ranked = sorted(children, key=lambda n: -n.value)
            for child in ranked:  # 3. prune below the threshold, keep the rest
                status = self.status(child, child.value >= self.config.prune_below)
                found = found or (child if status == "solution" else None)
                yield self.emit(child, status, expansions)
            stack += [c for c in reversed(ranked) if c.status == "kept" and not self.terminal(c)]  # 4. best on top
            yield self.frontier(expansions, stack, len(children))
        explored = [n for n in self.nodes if n.status != "pruned"]
        return found or max(explored, key=lambda n: (n.depth, n.value or 0.0))

    def run(self) -> Iterator[Event]:
        """The root, the chosen search's events, then the ThoughtResult."""
        root = self.add(None, self.task.root())
        yield self.emit(root, "kept", 0)
        best = yield from (self.bfs(root) if self.config.search == "bfs" else self.dfs(root))
        path = self.path(best)
        usage = self.lm.usage
        agree, compared = verdict_agreement(self.emitted)
        yield ThoughtResult(
            step=max(n.depth for n in self.nodes),
            task=self.task.name,
            search=self.config.search,
            value_source=self.config.value,
            path=[n.id for n in path],
            solved=self.solution(best) if self.task.has_solver else None,
            answer=self.task.answer([n.thought for n in path]),
            model_calls=usage.model_calls,
            tokens=usage.tokens,
            forwards=usage.forwards,
            value_calls=self.value_calls,
            agree=agree,
            compared=compared,
        )
