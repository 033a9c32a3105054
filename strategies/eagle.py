"""EAGLE-2 (Li et al. 2024): the EAGLE feature-level draft head grows a dynamic draft tree, one target forward
verifies it.

Each round: 1. the head reads the real pairs the last round committed (`EagleCache.extend`: the target's
features f at the root and the accepted nodes, paired with the tokens that followed them) and predicts f_hat
after the root; 2. EAGLE-2's dynamic tree (Sec. 4, "expansion" and "reranking"): the top-`branch` tokens of
q = softmax(W_lm[V_d] f_hat) are depth 0; at each further depth the `branch` frontier nodes with the highest
cumulative log-probability c(x) = sum of log q along the path (the draft's confidence, which EAGLE-2 shows
approximates the acceptance rate) are expanded at once (one head forward with the tree mask), each proposing
its top-`branch` children; after `depth` levels every candidate is reranked by c(x) and the best `total_tokens`
are kept (a child never outscores its parent, so the kept set is a tree); 3. `lab.tree.build_tree_attention`
gives mask, positions and retrieve indices and `runtime.verify_tree` scores [root] + nodes in one forward;
4. `lab.tree_accept.accept_tree` keeps the longest accepted path: greedy (follow the target's argmax; exact)
or sample (EAGLE-2's sibling-by-sibling rule: accept child x with probability p(x), else set p(x) = 0,
renormalise and try the next sibling, finally sample what is left; lossless); 5. `runtime.select` compacts the
target's KV cache to prefix + path, the head's cache drops its tree entries (`EagleCache.rollback`) and
re-reads the path with real features in step 1 of the next round, as EAGLE's implementation does;
6. an `EagleDraft` (every candidate, its score, the rerank cut), a `TreeRound` and one `TokenEmitted` per
token stream out. The first token comes from the prefill forward, as in greedy decoding.

Defaults (total_tokens 16, depth 3, branch 8) come from measuring the round's parts on the embedded model on the
2-core CPU (bf16, 8 builtin prompts, 128 tokens; `lab.heads.eagle_tune` replays tree sizes, then `lab bench` checked
the best few): with the shipped head a frontier of 8 drafts far better than 4 (tau 2.01 vs 1.81 at 8 nodes), a
fourth level adds little (2.24 vs 2.20 at 16 nodes), and verifying 1 + 16 nodes costs about 1.3 greedy steps while
1 + 24 or more jumps to 1.6 or more, so 16 nodes at depth 3 was fastest (README, EAGLE section, has the table).
Deliberate differences: EOS nodes are not expanded; no repetition penalty (it would depend on each node's path);
the head only scores its draft vocabulary V_d (`lab.heads.eagle`).
Not covered: EAGLE-3, batching, stochastic (sampled) draft trees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lab import runtime
from lab.heads import published_build
from lab.heads.common import load_heads
from lab.heads.eagle import KIND, EagleCache, EagleHead, build_head
from lab.heads.eagle3 import Eagle3Head, target_features
from lab.heads.published import is_lab_stem
from lab.models import LoadedModel
from lab.params import DecodeParams, param
from lab.profile import section
from lab.sampling import SamplingConfig, choose_token, process_logits
from lab.trace import EagleDraft, Event, RunFinished, TreeRound
from lab.tree import build_tree_attention
from lab.tree_accept import TreeAcceptance, accept_tree
from strategies.base import Strategy
from strategies.medusa import Emitter

TOP_ALTERNATIVES = 8
MODES = ("greedy", "sample")
_HEADS: dict[tuple, EagleHead] = {}


@dataclass(frozen=True)
class EagleParams(DecodeParams):
    mode: str = param("greedy", choices=MODES, help="greedy: exact argmax path; sample: EAGLE-2's lossless rule.")
    total_tokens: int = param(16, low=1, high=128, help="Draft nodes kept after reranking by c(x) (verify size).")
    depth: int = param(3, low=1, high=16, help="Draft tree levels: head forwards per round (longest draft).")
    branch: int = param(8, low=1, high=16, help="EAGLE-2's top_k: children per expanded node and frontier width.")
    temperature: float = param(1.0, low=0.05, high=2.0, help="sample: p = softmax(z / T) of the target.")
    top_p: float = param(1.0, low=0.05, high=1.0, help="sample: nucleus on p (1 = off).")
    heads_path: str = param(
        "", help="Lab head file/stem, or a published EAGLE / EAGLE-3 folder or Hub id (empty = shipped head)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        if self.mode == "greedy":
            return SamplingConfig(temperature=0.0)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p)


@dataclass
class Candidates:
    """Every node drafted in one round, in creation order; parents index this list (-1 = the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # c(x): cumulative log q along the path
    q: list[float] = field(default_factory=list)  # q(x | parent path)
    ranks: list[int] = field(default_factory=list)  # rank of the token among its parent's children
    expanded: list[bool] = field(default_factory=list)

    def add(self, token: int, parent: int, logq: float, rank: int) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(logq + (self.scores[parent] if parent >= 0 else 0.0))
        self.q.append(math.exp(logq))
        self.ranks.append(rank)
        self.expanded.append(False)

    def ancestors(self, node: int) -> set[int]:
        found, node = set(), self.parents[node]
        while node >= 0:
            found.add(node)
            node = self.parents[node]
        return found


def _add_children(c: Candidates, logq: torch.Tensor, parents: list[int], vocab: torch.Tensor, branch: int) -> None:
    """Top-`branch` children of each parent row: logq [n, V_d] (log q, clamped <= 0 so c(child) <= c(parent))."""
    top = logq.clamp_max(0.0).topk(min(branch, logq.shape[-1]), dim=-1)
    ids = vocab[top.indices].tolist()
    for row, parent in enumerate(parents):
        for rank, (token, value) in enumerate(zip(ids[row], top.values[row].tolist(), strict=True)):
            c.add(token, parent, value, rank)


def grow_tree(
    first_logq: torch.Tensor,  # [V_d] log q after the root
    expand: Callable[[Candidates, list[int]], torch.Tensor],  # frontier node ids -> log q of children [n, V_d]
    vocab: torch.Tensor,  # [V_d] draft index -> token id
    branch: int,
    depth: int,
    eos: tuple[int, ...],
) -> Candidates:
    """EAGLE-2 expansion: top-`branch` at depth 0, then `depth - 1` times expand the best `branch` frontier nodes."""
    c = Candidates()
    _add_children(c, first_logq[None], [-1], vocab, branch)
    level = list(range(len(c.tokens)))
    for _ in range(depth - 1):
        open_nodes = [i for i in level if c.tokens[i] not in eos]
        frontier = sorted(open_nodes, key=lambda i: (-c.scores[i], i))[:branch]
        if not frontier:
            break
        for node in frontier:
            c.expanded[node] = True
        first_child = len(c.tokens)
        _add_children(c, expand(c, frontier), frontier, vocab, branch)
        level = list(range(first_child, len(c.tokens)))
    return c


def rerank(c: Candidates, total_tokens: int) -> list[int]:
    """EAGLE-2 reranking: the `total_tokens` candidates of highest c(x), parents before children.

    Ties go to the shallower node, and c(child) <= c(parent), so every kept node's parent is kept."""
    best = sorted(range(len(c.tokens)), key=lambda i: (-c.scores[i], c.depths[i], i))[:total_tokens]
    return sorted(best, key=lambda i: (c.depths[i], i))


class EagleDrafter:
    """The head, its cache and the expansion callback of one run."""

    def __init__(self, head: EagleHead, params: EagleParams, eos: tuple[int, ...]) -> None:
        self.head, self.params, self.eos = head, params, eos
        self.cache = EagleCache(head)
        self.forwards = 0

    def draft(self, f_hat: torch.Tensor, pair_position: int, depth: int) -> Candidates:
        """Grow this round's candidate tree from f_hat (the head's prediction after the root)."""
        outputs: dict[int, torch.Tensor] = {-1: f_hat}

        def expand(c: Candidates, frontier: list[int]) -> torch.Tensor:
            features = torch.stack([outputs[c.parents[i]] for i in frontier])  # [n, H]
            positions = [pair_position + 1 + c.depths[i] for i in frontier]
            tokens = [c.tokens[i] for i in frontier]
            out = self.cache.tree_step(features, tokens, positions, frontier, [c.ancestors(i) for i in frontier])
            self.forwards += 1
            outputs.update(zip(frontier, out, strict=True))
            return self.head.logits(out).float().log_softmax(-1)  # [n, V_d]

        first = self.head.logits(f_hat).float().log_softmax(-1)
        return grow_tree(first, expand, self.head.vocab, self.params.branch, depth, self.eos)


def cached_head(loaded: LoadedModel, path: str) -> EagleHead | Eagle3Head:
    """The trained head for this model (shipped, a lab file, or a published folder / Hub id), loaded once."""
    if path and not is_lab_stem(path):  # a published SafeAILab / speculators head (lab.heads.published)
        return published_build.cached("eagle", loaded, path)
    key = (loaded.spec, id(loaded.model), str(loaded.dtype), path)
    if key not in _HEADS:
        if len(_HEADS) >= 4:
            _HEADS.pop(next(iter(_HEADS)))
        tensors, _ = load_heads(KIND, loaded, path or None)
        _HEADS[key] = build_head(loaded, tensors["vocab"], tensors)
    return _HEADS[key]


def draft_event(step: int, params: EagleParams, c: Candidates, kept: list[int], text, forwards: int, draft_s: float):
    """The EagleDraft of a round: every candidate and where the rerank cut fell."""
    node_of = {candidate: node for node, candidate in enumerate(kept)}
    return EagleDraft(
        step=step, branch=params.branch, depth=params.depth, total_tokens=params.total_tokens,
        tokens=list(c.tokens), texts=[text(t) for t in c.tokens], parents=list(c.parents), depths=list(c.depths),
        scores=[round(s, 5) for s in c.scores], q=[round(x, 6) for x in c.q], ranks=list(c.ranks),
        expanded=list(c.expanded), kept=[node_of.get(i, -1) for i in range(len(c.tokens))],
        threshold=round(min((c.scores[i] for i in kept), default=0.0), 5), head_forwards=forwards,
        draft_s=round(draft_s, 6),
    )  # fmt: skip


def tree_event(
    step: int,
    params: EagleParams,
    c: Candidates,
    kept: list[int],
    full: tuple[list[int], list[int]],
    processed: torch.Tensor,
    result: TreeAcceptance,
    emitted: int,
    text: Callable[[int], str],
    times: tuple[float, float],
) -> TreeRound:
    """The TreeRound of a verified tree (node i = full index i + 1; the root is not a node)."""
    tokens, parents = full
    rows = torch.tensor(parents[1:], dtype=torch.long)
    columns = torch.tensor(tokens[1:], dtype=torch.long)
    lse = torch.logsumexp(processed, dim=-1)  # [n + 1]
    p = (processed[rows, columns] - lse[rows]).exp().tolist() if kept else []
    return TreeRound(
        step=step, method="eagle", mode=params.mode, root_token=tokens[0], root_text=text(tokens[0]),
        tokens=tokens[1:], texts=[text(t) for t in tokens[1:]], parents=[x - 1 for x in parents[1:]],
        depths=[c.depths[i] for i in kept], heads=[c.depths[i] for i in kept], ranks=[c.ranks[i] for i in kept],
        q=[round(c.q[i], 6) for i in kept], p=[round(x, 6) for x in p], accepted=[i - 1 for i in result.path[1:]],
        next_token=result.next_token, next_text=text(result.next_token), next_source=result.source,
        emitted=emitted, draft_s=round(times[0], 6), verify_s=round(times[1], 6),
    )  # fmt: skip


def tree_inputs(root: int, c: Candidates, kept: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of [root] + kept nodes for `build_tree_attention` / `accept_tree` (root = node 0)."""
    index = {candidate: node + 1 for node, candidate in enumerate(kept)}
    return [root] + [c.tokens[i] for i in kept], [-1] + [index.get(c.parents[i], 0) for i in kept]


def decode_loop(
    loaded: LoadedModel,
    prompt_ids: list[int],
    params: EagleParams,
    head: EagleHead | Eagle3Head,
    generator: torch.Generator,
) -> Iterator[Event]:
    """EAGLE-2 rounds until EOS or the budget (module docstring, steps 1-6)."""
    out, config, greedy = Emitter(loaded, params.max_new_tokens), params.sampling, params.mode == "greedy"
    drafter = EagleDrafter(head, params, loaded.eos_token_ids)
    state, first = runtime.prefill(loaded, prompt_ids, hidden_states=True)
    try:
        processed = process_logits(first.logits[-1:], config, [])  # [1, V]
        root = choose_token(processed[0], config, generator)
        yield from out.emit(0, [root], ["target"], processed)
        features = target_features(head, first.hidden_states)  # [n, F]
        pending = (features[-1:], [root], len(prompt_ids) - 1)  # real pairs (f_p, x_{p+1}), first p
        if getattr(head, "reads_prompt", False):  # published heads: the whole prompt, as their references do
            pending = (features, list(prompt_ids[1:]) + [root], 0)
        step = 1
        while out.stop_reason is None:
            t0, forwards = time.perf_counter(), drafter.forwards
            depth = min(params.depth, params.total_tokens, params.max_new_tokens - len(out.generated) - 1)
            c, kept = Candidates(), []
            if depth > 0:
                with section("draft"):
                    f_hat = drafter.cache.extend(*pending)  # 1. the head reads the committed pairs
                    drafter.forwards += 1
                    c = drafter.draft(f_hat, pending[2] + len(pending[1]) - 1, depth)  # 2. expand
                    kept = rerank(c, params.total_tokens)  # rerank
            full = tree_inputs(root, c, kept)
            t1, n_past = time.perf_counter(), state.length
            v = runtime.verify_tree(state, build_tree_attention(full[1]), full[0], hidden_states=True)  # 3.
            processed = process_logits(v.logits, config, [])  # [n + 1, V]
            scores = processed if greedy else processed.softmax(-1)
            with section("accept"):
                result = accept_tree(full[0], full[1], scores, generator, greedy)
            runtime.select(state, list(range(n_past)) + [n_past + i for i in result.path])  # 5. compact
            pending = (target_features(head, v.hidden_states)[result.path], result.tokens, n_past)
            times = (t1 - t0, time.perf_counter() - t1)
            sources = ["accepted"] * (len(result.path) - 1) + [result.source]
            before = len(out.generated)
            emitted = list(out.emit(step, result.tokens, sources, processed[result.path]))
            yield draft_event(step, params, c, kept, out.text_of, drafter.forwards - forwards, times[0])  # 6.
            yield tree_event(step, params, c, kept, full, processed, result, len(out.generated) - before, out.text_of,
                             times)  # fmt: skip
            yield from emitted
            root = result.next_token
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards, drafter.forwards)
    finally:
        state.cache.reset()
        drafter.cache.reset()


def run(loaded: LoadedModel, prompt_ids: list[int], params: EagleParams, generator: torch.Generator) -> Iterator[Event]:
    return decode_loop(loaded, prompt_ids, params, cached_head(loaded, params.heads_path), generator)


STRATEGY = Strategy(
    name="eagle",
    family="speculative",
    summary="A one-layer head drafts features; EAGLE-2 grows a dynamic tree by confidence, one forward verifies it.",
    paper="Li et al. 2024, EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty; "
    "Li et al. 2024, EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    Params=EagleParams,
    run=run,
)
