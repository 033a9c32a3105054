"""Medusa (Cai et al. 2024): K heads draft a sparse candidate tree, one target forward verifies it all.

Each round: 1. the heads read h, the target's hidden state at the last committed token's predecessor row, and
`tree_from_choices` builds the tree (the first `tree_nodes` paths of the tuned `choices`, clipped to the
remaining budget); 2. `runtime.verify_tree` scores [root] + nodes with the tree attention mask (the root is the
last committed token, not yet in the KV cache); 3. acceptance picks a root-to-node path and the next token;
4. `runtime.select` keeps the KV of the prefix and the path (compaction); 5. a `TreeRound` and one
`TokenEmitted` per token stream out; the next token becomes the new root and the path's last hidden state
feeds the heads. The first token comes from the prefill forward (like greedy).
Acceptance modes:
- greedy (exact): follow the child equal to the target's argmax (`lab.tree_accept.accept_tree`); the output
  equals greedy decoding token for token (up to float ties of batched vs one-token logits; tested in fp32);
- typical (lossy, Cai et al. 2024, Sec. 2.3.1): node x is accepted if p(x) > min(epsilon, delta * exp(-H(p)))
  under its parent's temperature-scaled target distribution; the longest accepted path wins (first in node order
  on ties) and the next token is sampled from p after it. Faster, but not the target's distribution;
- sample (lossless): `accept_tree`'s sibling-by-sibling rule for deterministic candidates (SpecInfer /
  EAGLE-2): accept child x with probability p(x), else p(x) = 0, renormalise, try the next sibling, finally
  sample what is left. A drafter that samples a chain with known q (MTPC) uses `lab.sampling.accept_draft`.
Tree size (`tree_nodes`, default 8) is a CPU trade-off: with the shipped heads tau was 1.56 / 1.63 / 1.67 for
8 / 12 / 16 nodes and the speedup over greedy 1.14x / 1.11x / 1.09x (`lab bench --strategies greedy,medusa
--limit 8 --params medusa.tree_nodes=N`, bf16, 2 cores), since a verify forward costs about 25.7 ms + 0.5 ms per
token there (DESIGN.md 12); on a GPU larger trees are nearly free.
This module also hosts the tree decode loop `tree_decode_loop`, shared with `strategies.mtpc`.
Not covered: repetition penalty (it would depend on each node's path), batching, Medusa-2.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch

from lab import runtime
from lab.heads import published_build
from lab.heads.common import load_heads
from lab.heads.medusa import DraftTree, MedusaHeads, head_top, prune_choices, tree_from_choices
from lab.heads.published import is_lab_stem
from lab.models import LoadedModel
from lab.params import DecodeParams, param
from lab.profile import section
from lab.sampling import SamplingConfig, accept_draft, choose_token, process_logits
from lab.text import IncrementalDetokenizer
from lab.trace import Event, RunFinished, TokenEmitted, TreeRound
from lab.tree import build_tree_attention
from lab.tree_accept import accept_tree, children_of
from strategies.base import Strategy

TOP_ALTERNATIVES = 8
MODES = ("greedy", "typical", "sample")
_HEADS: dict[tuple, object] = {}


@dataclass(frozen=True)
class TreeParams(DecodeParams):
    mode: str = param(
        "greedy", choices=MODES, help="greedy: exact; typical: p(x) > min(eps, delta e^-H) (lossy); sample: lossless."
    )
    tree_nodes: int = param(8, low=1, high=64, help="Candidate tree size: the first N paths of the tuned tree.")
    temperature: float = param(0.7, low=0.05, high=2.0, help="typical / sample: p = softmax(z / T).")
    top_p: float = param(1.0, low=0.05, high=1.0, help="sample: nucleus on p (1 = off).")
    epsilon: float = param(0.09, low=0.0, high=1.0, help="typical: hard threshold epsilon in min(eps, delta e^-H).")
    delta: float = param(
        0.3, low=0.0, high=1.0, help="typical: entropy-scaled threshold delta in min(eps, delta e^-H)."
    )
    heads_path: str = param(
        "", help="Lab heads file/stem; Medusa also a FasterDecoding folder or Hub id (empty = shipped heads)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        if self.mode == "greedy":
            return SamplingConfig(temperature=0.0)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p if self.mode == "sample" else 1.0)


class TreeDrafter(Protocol):
    method: str

    def draft(self, hidden: torch.Tensor, root: int, root_logits: torch.Tensor, max_depth: int, mode: str,
              generator: torch.Generator) -> tuple[DraftTree, list[Event]]: ...  # fmt: skip


def cached_heads(kind: str, loaded: LoadedModel, path: str, build):
    """Load a head set once per (model, path); `build(tensors, config)` makes the inference object."""
    key = (kind, loaded.spec, id(loaded.model), path)
    if key not in _HEADS:
        if len(_HEADS) >= 4:
            _HEADS.pop(next(iter(_HEADS)))
        _HEADS[key] = build(*load_heads(kind, loaded, path or None))
    return _HEADS[key]


class MedusaDrafter:
    method = "medusa"

    def __init__(self, heads: MedusaHeads, tree_nodes: int, eos: tuple[int, ...]) -> None:
        self.heads, self.tree_nodes, self.eos = heads, tree_nodes, eos

    def draft(self, hidden, root, root_logits, max_depth, mode, generator):
        probs = self.heads.probs(hidden)  # [K, V_d]
        choices = prune_choices(self.heads.choices, self.tree_nodes, max_depth, self.heads.num_heads)
        tree = tree_from_choices(choices, lambda prefix: probs[len(prefix)], self.heads.vocab, self.eos)
        return DraftTree(**{**tree.__dict__, "head_top": head_top(probs, self.heads.vocab)}), []


def typical_path(parents: list[int], tokens: list[int], probs: torch.Tensor, params: TreeParams) -> list[int]:
    """Cai et al. 2024, Sec. 2.3.1: the longest path whose every node has p(x) > min(eps, delta exp(-H(p)))."""
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [n]
    threshold = torch.minimum(torch.full_like(entropy, params.epsilon), params.delta * torch.exp(-entropy))
    ok = [True] + [float(probs[parents[i], tokens[i]]) > float(threshold[parents[i]]) for i in range(1, len(tokens))]
    depth = [0] * len(tokens)
    best = 0
    for i in range(1, len(tokens)):
        ok[i] = ok[i] and ok[parents[i]]
        depth[i] = depth[parents[i]] + 1
        if ok[i] and depth[i] > depth[best]:
            best = i
    path = [best]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def accept(tree: DraftTree, full: tuple[list[int], list[int]], processed: torch.Tensor, params: TreeParams,
           generator: torch.Generator) -> tuple[list[int], int, str]:  # fmt: skip
    """(path root first, next token, its source) for the round; `full` = (tokens, parents) with the root as 0."""
    tokens, parents = full
    if params.mode == "greedy":
        result = accept_tree(tokens, parents, processed, None, greedy=True)
        return result.path, result.next_token, result.source
    probs = processed.softmax(-1)  # [n + 1, V]
    if params.mode == "typical":
        path = typical_path(parents, tokens, probs, params)
        source = "recovered" if children_of(parents)[path[-1]] else "bonus"
        return path, choose_token(processed[path[-1]], params.sampling, generator), source
    if tree.q_rows is not None:  # a sampled chain with known q (Leviathan et al. 2023, Alg. 1)
        acc = accept_draft(probs, tree.q_rows, tokens[1:], generator)
        path = list(range(len(acc.accepted) + 1))
        return path, acc.tokens[-1], "recovered" if acc.recovered is not None else "bonus"
    result = accept_tree(tokens, parents, probs, generator, greedy=False)
    return result.path, result.next_token, result.source


@dataclass
class Emitter:
    """Output text and stop bookkeeping shared by every round."""

    loaded: LoadedModel
    max_new_tokens: int

    def __post_init__(self) -> None:
        self.start = time.perf_counter()
        self.generated: list[int] = []
        self.stop_reason: str | None = None
        self.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer)
        self.text_of = lru_cache(maxsize=8192)(self.loaded.token_text)

    def emit(self, step: int, tokens: list[int], sources: list[str], rows: torch.Tensor) -> Iterator[TokenEmitted]:
        """TokenEmitted per token (cut at EOS / budget); rows[i] = the processed logits token i was chosen from."""
        top_logits, top_ids = torch.topk(rows, TOP_ALTERNATIVES, dim=-1)
        top_probs = (top_logits - torch.logsumexp(rows, dim=-1, keepdim=True)).exp()
        for i, token in enumerate(tokens):
            if self.stop_reason:
                return
            self.generated.append(token)
            if token in self.loaded.eos_token_ids:
                self.stop_reason = "eos"
            elif len(self.generated) >= self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            text = self.detokenizer.push(token) + (self.detokenizer.flush() if self.stop_reason else "")
            ids = top_ids[i].tolist()
            texts, probs = [self.text_of(t) for t in ids], [round(p, 6) for p in top_probs[i].tolist()]
            yield TokenEmitted(step, token, text, sources[i], time.perf_counter() - self.start, ids, texts, probs)


def round_event(step: int, method: str, params: TreeParams, tree: DraftTree, root: int, path: list[int],
                outcome: tuple[int, str, int], probs: torch.Tensor, times: tuple, text) -> TreeRound:  # fmt: skip
    """The TreeRound of a verified tree (node indices relative to the tree: the root is not a node)."""
    next_token, source, emitted = outcome
    rows = torch.tensor([p + 1 for p in tree.parents], dtype=torch.long)
    p = probs[rows, torch.tensor(tree.tokens, dtype=torch.long)].tolist() if tree.size else []
    top_ids, top_probs = tree.head_top
    return TreeRound(
        step=step, method=method, mode=params.mode, root_token=root, root_text=text(root),
        tokens=list(tree.tokens), texts=[text(t) for t in tree.tokens], parents=list(tree.parents),
        depths=list(tree.depths), heads=list(tree.heads), ranks=list(tree.ranks),
        q=[round(x, 6) for x in tree.q], p=[round(x, 6) for x in p], accepted=[i - 1 for i in path[1:]],
        next_token=next_token, next_text=text(next_token), next_source=source, emitted=emitted,
        head_top_ids=top_ids, head_top_texts=[[text(t) for t in row] for row in top_ids], head_top_probs=top_probs,
        draft_s=round(times[0], 6), verify_s=round(times[1], 6),
    )  # fmt: skip


def tree_decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], params: TreeParams, drafter: TreeDrafter, generator: torch.Generator
) -> Iterator[Event]:
    """Draft a tree from the heads, verify it in one forward, keep the accepted path; until EOS or the budget."""
    out, config = Emitter(loaded, params.max_new_tokens), params.sampling
    state, first = runtime.prefill(loaded, prompt_ids, hidden_states=True)
    logits, hidden = first.logits[-1], first.hidden_states[-1][-1]
    root = choose_token(process_logits(logits, config, []), config, generator)
    yield from out.emit(0, [root], ["target"], process_logits(logits[None], config, []))
    step = 1
    try:
        while out.stop_reason is None:
            t0 = time.perf_counter()
            max_depth = params.max_new_tokens - len(out.generated) - 1
            with section("draft"):
                tree, extra = drafter.draft(hidden, root, logits, max_depth, params.mode, generator)  # 1.
            t1 = time.perf_counter()
            full = ([root] + tree.tokens, [-1] + [p + 1 for p in tree.parents])
            n_past = state.length
            v = runtime.verify_tree(state, build_tree_attention(full[1]), full[0], hidden_states=True)  # 2.
            t2 = time.perf_counter()
            processed = process_logits(v.logits, config, [])  # [n + 1, V]
            with section("accept"):
                path, next_token, source = accept(tree, full, processed, params, generator)  # 3.
            runtime.select(state, list(range(n_past)) + [n_past + i for i in path])  # 4.
            logits, hidden = v.logits[path[-1]], v.hidden_states[-1][path[-1]]
            tokens = [full[0][i] for i in path[1:]] + [next_token]
            sources = ["accepted"] * (len(path) - 1) + [source]
            before = len(out.generated)
            events = list(out.emit(step, tokens, sources, processed[torch.tensor(path)]))
            outcome = (next_token, source, len(out.generated) - before)
            probs = processed.softmax(-1)
            times = (t1 - t0, t2 - t1)  # drafting, the verify forward
            yield round_event(step, drafter.method, params, tree, root, path, outcome, probs, times, out.text_of)
            yield from extra
            yield from events  # 5.
            root = next_token
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards)
    finally:
        state.cache.reset()


def run(loaded: LoadedModel, prompt_ids: list[int], params: TreeParams, generator: torch.Generator) -> Iterator[Event]:
    if params.heads_path and not is_lab_stem(params.heads_path):  # FasterDecoding's layout (lab.heads.published)
        heads = published_build.cached("medusa", loaded, params.heads_path)
    else:
        heads = cached_heads(
            "medusa", loaded, params.heads_path, lambda t, c: MedusaHeads.from_tensors(loaded.lm_head.weight, t, c)
        )
    drafter = MedusaDrafter(heads, params.tree_nodes, loaded.eos_token_ids)
    return tree_decode_loop(loaded, prompt_ids, params, drafter, generator)


STRATEGY = Strategy(
    name="medusa",
    family="multi-token heads",
    summary="K extra heads guess tokens t+2..t+K+1; a candidate tree of their top-k is verified in one forward.",
    paper="Cai et al. 2024, Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
    Params=TreeParams,
    run=run,
)
