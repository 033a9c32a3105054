"""Losslessness of whole tree rounds of depth 2 (docs/architecture.md section 11), with a negative control per rule.

On a tiny random Llama with a vocabulary of 6 (LM head x10 so p is far from uniform; EOS never emitted), the first
three generated tokens of many independent runs of `lab.speculative.tree.tree_loop` are compared by chi-square
(`tests.stats.assert_joint_matches` over the V^3 cells (x1, x2, x3)) with their exact joint
p(x1) p(x2 | x1) p(x3 | x1, x2) under the run's processors, computed from full forwards without a cache. x1 comes
from the prefill forward; x2 and x3 come from the first tree round, whose draft has depth 2 (max_new_tokens = 4
leaves it a budget of 2), or from a second round after an early rejection. Each test also checks that the first
round accepted one and two draft nodes often, so the rule was exercised below the root and not only on recoveries.
- Medusa (random heads, the tuned `CHOICES` tree cut to depth 2: 3 + 3 nodes) and EAGLE-2 (a random head growing
  a depth-2 tree with 3 children per node, 8 kept): deterministic candidates, the sibling-by-sibling rule;
- MTPC in sample mode: a chain of 2 drawn from a random circuit with its q rows, Leviathan et al.'s Alg. 1.
Negative controls: the same runs with a deliberately wrong rule patched into the tree loop must fail the same
check (so the check has the power to see such a bug):
- Medusa: the sibling rule without the renormalisation after a rejection;
- EAGLE: the sibling rule drawing the final token from p with the rejected siblings left in;
- MTPC: Alg. 1 drawing the recovered token from p instead of norm(max(0, p - q)).
"""

from __future__ import annotations

import pytest
import torch

from lab.engine.models import LoadedModel, wrap_model
from lab.engine.sampling import SamplingConfig, process_logits, target_distribution
from lab.heads.eagle import build_head
from lab.speculative import tree
from lab.speculative.acceptance import Acceptance
from lab.speculative.draft import Draft, Proposer
from lab.speculative.params import tree_settings
from lab.speculative.proposers.eagle import EagleProposer, TreeShape
from lab.speculative.proposers.medusa import MedusaProposer
from lab.speculative.proposers.mtpc import MTPCProposer
from lab.speculative.tree import TreeSettings, tree_loop
from lab.trace import TokenEmitted, TreeRound
from strategies.medusa import TreeParams
from tests.stats import assert_joint_matches
from tests.test_medusa import random_heads
from tests.test_mtpc import random_circuit
from tests.tiny import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

V, PROMPT, N_DRAWS = 6, [1, 2], 1000
MIN_DEEP = N_DRAWS // 10  # first rounds that accepted 1 node, and 2 nodes, at least this often


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    model = tiny_llama(0, vocab=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.eos_token_id = 999
    return wrap_model(model, ByteTokenizer(), spec=f"tiny-v{V}")


def exact_joint(loaded: LoadedModel, config: SamplingConfig) -> torch.Tensor:
    """p(x1) p(x2 | x1) p(x3 | x1, x2) after PROMPT, from full forwards: [V, V, V]."""

    def p_next(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        return target_distribution(process_logits(logits, config, ids), config)  # [V]

    p1 = p_next(PROMPT)
    joint = torch.zeros(V, V, V)
    for a in range(V):
        p2 = p_next(PROMPT + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * p_next(PROMPT + [a, b])
    return joint


def draw(loaded: LoadedModel, proposer: Proposer, settings: TreeSettings) -> tuple[list[tuple[int, ...]], list[int]]:
    """N_DRAWS runs: the first three tokens (x1, x2, x3) of each, and how many runs' first tree round
    accepted 0, 1 and 2 draft nodes. Each run is closed after its third token."""
    generator, samples, depths = torch.Generator().manual_seed(0), [], [0, 0, 0]
    for _ in range(N_DRAWS):
        tokens, run = [], tree_loop(loaded, PROMPT, proposer, generator, settings)
        for event in run:
            if isinstance(event, TreeRound) and event.step == 1:
                depths[len(event.accepted)] += 1
            if isinstance(event, TokenEmitted):
                tokens.append(event.token_id)
                if len(tokens) == 3:
                    break
        run.close()
        samples.append(tuple(tokens))
    return samples, depths


def check_lossless_and_control(
    monkeypatch, loaded: LoadedModel, proposer: Proposer, settings: TreeSettings, wrong_rule
) -> None:
    """The real rule passes the chi-square check with deep acceptances; `wrong_rule` in its place fails it."""
    assert settings.rule == "sample" and settings.max_new_tokens == 4
    joint = exact_joint(loaded, settings.config)
    samples, depths = draw(loaded, proposer, settings)
    assert min(depths[1:]) >= MIN_DEEP, depths
    assert_joint_matches(samples, joint)
    monkeypatch.setattr(tree, "accept", wrong_rule)
    wrong, _ = draw(loaded, proposer, settings)
    with pytest.raises(AssertionError, match="chi2"):
        assert_joint_matches(wrong, joint)


# --- deliberately wrong rules (the loop calls accept(draft, processed, rule, config, generator, typical)) -----


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator))


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _wrong_sibling_rule(draft: Draft, processed: torch.Tensor, generator: torch.Generator, bug: str) -> Acceptance:
    """The sibling rule with one bug: "no renormalisation" (later siblings are accepted with p(x) of the
    unrenormalised rest), or "rejected kept" (the final draw comes from p with the rejected siblings in it)."""
    p = processed.softmax(-1)
    path, node = [], -1
    while True:
        p_node, chosen = p[node + 1].clone(), None
        for child in draft.children(node):
            x = draft.tokens[child]
            if _uniform(generator) < float(p_node[x]):
                chosen = child
                break
            p_node[x] = 0.0
            if bug != "no renormalisation":
                p_node = p_node / p_node.sum()
        if chosen is None:
            token = _sample(p[node + 1] if bug == "rejected kept" else p_node, generator)
            accepted = [draft.tokens[i] for i in path]
            if draft.children(node):
                return Acceptance(accepted, [], [], token, None, path)
            return Acceptance(accepted, [], [], None, token, path)
        path.append(chosen)
        node = chosen


def sibling_rule_without_renormalisation(draft, processed, rule, config, generator, typical=None) -> Acceptance:
    return _wrong_sibling_rule(draft, processed, generator, "no renormalisation")


def sibling_rule_keeping_rejected(draft, processed, rule, config, generator, typical=None) -> Acceptance:
    return _wrong_sibling_rule(draft, processed, generator, "rejected kept")


def chain_rule_recovering_from_p(draft, processed, rule, config, generator, typical=None) -> Acceptance:
    """Alg. 1 with the classic bug: after a rejection the recovered token is drawn from p, not the residual."""
    p, q, n = processed.softmax(-1), draft.q.to(processed), draft.size
    for i, x in enumerate(draft.tokens):
        if _uniform(generator) >= min(1.0, float(p[i, x]) / float(q[i, x])):
            return Acceptance(draft.tokens[:i], [], [], _sample(p[i], generator), None, list(range(i)))
    return Acceptance(list(draft.tokens), [], [], None, _sample(p[n], generator), list(range(n)))


# --- the three methods --------------------------------------------------------------------------------------


def test_medusa_sampled_tree_of_depth_2_is_lossless(monkeypatch, target) -> None:
    params = TreeParams(max_new_tokens=4, mode="sample", temperature=1.0, tree_nodes=9)
    proposer = MedusaProposer(random_heads(target, scale=0.3, seed=5), params.tree_nodes)
    settings = tree_settings(params, "medusa")
    check_lossless_and_control(monkeypatch, target, proposer, settings, sibling_rule_without_renormalisation)


def test_mtpc_sampled_chain_with_q_is_lossless(monkeypatch, target) -> None:
    params = TreeParams(max_new_tokens=4, mode="sample", temperature=1.0)
    proposer = MTPCProposer(random_circuit(target, scale=0.1, seed=1), params.tree_nodes, 1.0, V)
    settings = tree_settings(params, "mtpc")
    check_lossless_and_control(monkeypatch, target, proposer, settings, chain_rule_recovering_from_p)


def test_eagle_sampled_tree_of_depth_2_is_lossless(monkeypatch, target) -> None:
    """Under temperature and top-p (tokens of p = 0 must never be accepted)."""
    torch.manual_seed(3)
    proposer = EagleProposer(build_head(target, torch.arange(V)), TreeShape(total_tokens=8, depth=2, branch=3))
    settings = TreeSettings(4, SamplingConfig(temperature=0.8, top_p=0.9), "sample", method="eagle")
    check_lossless_and_control(monkeypatch, target, proposer, settings, sibling_rule_keeping_rejected)
