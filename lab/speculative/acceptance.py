"""Acceptance rules of draft-then-verify decoding, in the papers' vocabulary: accepted draft tokens, then either a
recovered token (after a rejection) or a bonus token (after the whole chain or at a leaf).

p is the target's processed distribution: row 0 follows the root (the last committed token), row 1 + i follows
draft node i (chain or tree, `lab.speculative.draft.Draft`). q is the drafter's.
- `accept_chain` (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the recovered token from norm(max(0, p_i - q_i)); after
  a fully accepted chain draw the bonus from p_gamma. A deterministic drafter has q = one-hot at x_i.
- `accept_tree_sampled` (SpecInfer, Miao et al. 2024, Alg. 2 with one-hot drafts; EAGLE-2's evaluate_posterior):
  at a node with distribution p try its children in order, accepting child x with probability p(x); on rejection
  set p(x) = 0 and renormalise; when every child is rejected, draw from what is left. On a chain this is
  exactly `accept_chain` with q one-hot.
- `accept_greedy` (exact greedy): follow the child whose token is argmax p; emit that argmax.
- `accept_typical` (Medusa's typical acceptance, Cai et al. 2024, Sec. 2.3.1): LOSSY. Node x is accepted when
  p(x) > min(epsilon, delta exp(-H(p))) under its parent's distribution; the longest accepted path wins; the next
  token is drawn from p after it. Faster, but the output is not distributed as the target's.
Every tensor made here lives on p's device, every draw comes from the given generator, which must live there too.
Not covered: stochastic (sampled) trees with q per node (a sampled draft must be a chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lab.engine.sampling import SamplingConfig, choose_token, top_tokens
from lab.speculative.draft import Draft

RULES = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class Acceptance:
    """The outcome of one verified draft. `path`: accepted node indices (a chain's are 0..k-1)."""

    accepted: list[int]  # accepted draft tokens, in order
    uniforms: list[float]  # u drawn for each examined draft token (sampling rules)
    ratios: list[float]  # acceptance probability of each examined draft token
    recovered: int | None  # drawn after a rejection (or the argmax where a greedy walk stopped early)
    bonus: int | None  # drawn after the last draft token of a fully accepted chain / at a leaf
    path: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)  # node indices tried and rejected, in order
    residual: torch.Tensor | None = field(default=None, repr=False)  # [V] what `recovered` was drawn from
    lossy: bool = False  # typical acceptance: not distributed as the target

    @property
    def tokens(self) -> list[int]:
        """Everything this round emits: the accepted draft tokens plus the recovered or bonus token."""
        extra = self.recovered if self.recovered is not None else self.bonus
        return self.accepted + ([] if extra is None else [extra])

    @property
    def next_token(self) -> int | None:
        return self.recovered if self.recovered is not None else self.bonus

    @property
    def source(self) -> str:
        return "recovered" if self.recovered is not None else "bonus"

    def ended_by(self, eos_ids: tuple[int, ...]) -> Acceptance:
        """An accepted EOS ends the text: nothing is drawn after it."""
        if self.accepted and self.accepted[-1] in eos_ids and self.next_token is not None:
            return replace(self, recovered=None, bonus=None, residual=None)
        return self


def _check_generator(generator: torch.Generator, like: torch.Tensor) -> None:
    if generator.device.type != like.device.type:
        raise ValueError(f"the generator is on {generator.device} but the distributions are on {like.device}")


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_chain(
    p: torch.Tensor,  # [gamma + 1, V]
    q: torch.Tensor | None,  # [gamma, V] or None = one-hot at the draft tokens
    tokens: list[int],
    generator: torch.Generator,
) -> Acceptance:
    """Leviathan et al. 2023, Alg. 1 (module docstring). A draft token with q(x) = 0 cannot have been drawn
    from q: it is refused with a ValueError rather than accepted."""
    gamma = len(tokens)
    if p.shape[0] != gamma + 1:
        raise ValueError(f"p needs gamma + 1 = {gamma + 1} rows, got {p.shape[0]}")
    _check_generator(generator, p)
    q = q.to(p) if q is not None else None
    uniforms, ratios = [], []
    for i, token in enumerate(tokens):
        p_i = p[i]
        q_i = q[i] if q is not None else torch.zeros_like(p_i).index_fill(0, p_i.new_tensor([token]).long(), 1.0)
        q_x = float(q_i[token])
        if not q_x > 0:
            raise ValueError(f"draft token {token} at position {i} has q(x) = {q_x}: it cannot come from q")
        ratio = min(1.0, float(p_i[token]) / q_x)
        u = _uniform(generator)
        uniforms.append(u)
        ratios.append(ratio)
        if u >= ratio:  # reject: the recovered token comes from the residual
            residual = (p_i - q_i).clamp_min(0)
            total = float(residual.sum())
            residual = residual / total if total > 0 else p_i  # p == q: the residual is empty, p is exact
            recovered = _draw(residual, generator)
            return Acceptance(list(tokens[:i]), uniforms, ratios, recovered, None, list(range(i)), [i], residual)
    return Acceptance(list(tokens), uniforms, ratios, None, _draw(p[gamma], generator), list(range(gamma)))


def accept_tree_sampled(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """SpecInfer / EAGLE-2 sibling-by-sibling rule over a tree of deterministic candidates (module docstring)."""
    _check_generator(generator, p)
    path, rejected, uniforms, ratios, node = [], [], [], [], -1
    while True:
        p_node = p[node + 1].float()
        chosen = None
        for child in draft.children(node):
            x = draft.tokens[child]
            ratio, u = float(p_node[x]), _uniform(generator)
            uniforms.append(u)
            ratios.append(ratio)
            if u < ratio:
                chosen = child
                break
            rejected.append(child)
            p_node = p_node.index_fill(0, p_node.new_tensor([x]).long(), 0.0)
            total = float(p_node.sum())
            if total <= 1e-12:  # float rounding only: p was one-hot on x, so x is the draw
                chosen = rejected.pop()
                break
            p_node = p_node / total
        if chosen is None:
            token = _draw(p_node, generator)
            accepted = [draft.tokens[i] for i in path]
            if draft.children(node):
                return Acceptance(accepted, uniforms, ratios, token, None, path, rejected, p_node)
            return Acceptance(accepted, uniforms, ratios, None, token, path, rejected)
        path.append(chosen)
        node = chosen


def accept_greedy(draft: Draft, processed: torch.Tensor) -> Acceptance:
    """Exact greedy: follow the child equal to the target's argmax until none matches; emit that argmax."""
    argmax = top_tokens(processed, 1).ids[:, 0].tolist()  # [n + 1] argmaxes: one host sync for the whole walk
    path, node = [], -1
    while True:
        best = argmax[node + 1]
        children = draft.children(node)
        chosen = next((c for c in children if draft.tokens[c] == best), None)
        if chosen is None:
            accepted = [draft.tokens[i] for i in path]
            ratios = [1.0] * len(path) + ([0.0] if children else [])
            if children:
                return Acceptance(accepted, [], ratios, best, None, path, [c for c in children])
            return Acceptance(accepted, [], ratios, None, best, path)
        path.append(chosen)
        node = chosen


def typical_path(draft: Draft, probs: torch.Tensor, epsilon: float, delta: float) -> list[int]:
    """Cai et al. 2024, Sec. 2.3.1: the longest path whose every node has p(x) > min(eps, delta exp(-H(p)))."""
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [n + 1]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy)).tolist()
    parents, ok, depth, best = draft.tree_parents, [], [], -1
    rows = torch.tensor(parents, dtype=torch.long, device=probs.device) + 1
    p_token = probs[rows, torch.tensor(draft.tokens, dtype=torch.long, device=probs.device)]
    for i, value in enumerate(p_token.tolist() if draft.size else []):
        parent = parents[i]
        ok.append(value > threshold[parent + 1] and (parent < 0 or ok[parent]))
        depth.append(0 if parent < 0 else depth[parent] + 1)
        if ok[i] and (best < 0 or depth[i] > depth[best]):
            best = i
    path = []
    while best >= 0:
        path.append(best)
        best = parents[best]
    return path[::-1]


def accept_typical(
    draft: Draft, processed: torch.Tensor, config: SamplingConfig, epsilon: float, delta: float, generator
) -> Acceptance:
    """Medusa's typical acceptance (lossy): the longest typical path, then a draw from p after it."""
    path = typical_path(draft, processed.softmax(-1), epsilon, delta)
    last = path[-1] if path else -1
    token = choose_token(processed[last + 1], config, generator)
    accepted = [draft.tokens[i] for i in path]
    if draft.children(last):
        return Acceptance(accepted, [], [], token, None, path, lossy=True)
    return Acceptance(accepted, [], [], None, token, path, lossy=True)


def accept(
    draft: Draft,
    processed: torch.Tensor,  # [n + 1, V] processed target logits
    rule: str,
    config: SamplingConfig,
    generator: torch.Generator,
    typical: tuple[float, float] = (0.09, 0.3),
) -> Acceptance:
    """Dispatch to the rule: greedy, sample (chain with q: Alg. 1; otherwise the sibling rule) or typical."""
    if rule == "greedy":
        return accept_greedy(draft, processed)
    if rule == "typical":
        return accept_typical(draft, processed, config, *typical, generator)
    if rule != "sample":
        raise ValueError(f"unknown acceptance rule {rule!r}; one of {RULES}")
    p = processed.softmax(-1)
    if draft.q is not None:
        if not draft.is_chain:
            raise ValueError("a sampled draft with q per node must be a chain (stochastic trees are not covered)")
        return accept_chain(p, draft.q, draft.tokens, generator)
    if draft.is_chain:
        return accept_chain(p, None, draft.tokens, generator)
    return accept_tree_sampled(draft, p, generator)
