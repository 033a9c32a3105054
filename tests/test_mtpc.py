"""MTPC: the circuit's conditionals, exact greedy tree decoding and lossless sampling on tiny random Llamas,
training plumbing, and greedy equality on the embedded model for Medusa and MTPC with the shipped heads."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch

from lab.engine import native_forward
from lab.heads.mtpc import Circuit, MTPCHeads, init_tensors
from lab.speculative.params import tree_settings
from lab.speculative.proposers.mtpc import MTPCProposer, sampled_chain
from lab.speculative.tree import tree_loop
from lab.trace import MixtureRound, TokenEmitted, TreeRound, summarize
from strategies import collect
from strategies.medusa import TreeParams
from tests.test_medusa import CHOICES, assert_round_order, greedy_tokens, low_bit_target
from tests.tiny import tiny_loaded_model


def circuit_tensors(loaded, heads: int = 3, components: int = 3, scale: float = 0.3, seed: int = 0) -> dict:
    hidden, vocab = int(loaded.config.hidden_size), loaded.vocab_size
    tensors = init_tensors(heads, components, 4, hidden, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name in ("blocks.weight", "adapters.up", "mix.weight"):
        tensors[name] = scale * torch.randn(tensors[name].shape, generator=generator)
    tensors["vocab"] = torch.arange(vocab)
    return tensors


def random_circuit(loaded, heads: int = 3, components: int = 3, scale: float = 0.3, seed: int = 0) -> MTPCHeads:
    tensors = circuit_tensors(loaded, heads, components, scale, seed)
    return MTPCHeads.from_tensors(loaded.lm_head.weight, tensors, {"choices": [list(c) for c in CHOICES]})


@pytest.mark.parametrize("precision", ["int4", "w4a8"])
def test_served_circuit_runs_on_the_targets_low_bit_kernels_and_stays_lossless(precision: str) -> None:
    """On a low-bit target the leaves are W_lm (u + B s) through the target's LM-head rows: close to the float
    circuit's W_lm u + (W_lm B) s, and greedy MTPC still equals greedy at that precision."""
    if precision == "w4a8" and not native_forward.build():
        pytest.skip("w4a8 needs the op's integer products (a C++ compiler)")
    target = low_bit_target(precision)
    tensors, config = circuit_tensors(target), {"choices": [list(c) for c in CHOICES]}
    served, reference = (
        MTPCHeads.served(target, tensors, config),
        MTPCHeads.from_tensors(target.lm_head.weight, tensors, config),
    )
    assert served.low_bit is not None
    h = torch.randn(64).to(torch.bfloat16)
    (log_pi, logp), (expected_pi, expected) = served.leaves(h), reference.leaves(h)
    assert torch.allclose(log_pi, expected_pi) and logp.shape == expected.shape
    assert (logp.exp() - expected.exp()).abs().max() < 0.05
    params = TreeParams(max_new_tokens=30, tree_nodes=9)
    prompt = list(b"joint drafts")
    tokens, _ = _run(target, prompt, params, mtpc_proposer(served, params, target))
    assert tokens == greedy_tokens(target, prompt, 30)


def test_circuit_conditionals_match_the_brute_force_joint() -> None:
    torch.manual_seed(0)
    r, k, v = 3, 3, 4  # positions 0..2 (0 = root)
    log_pi = torch.log_softmax(torch.randn(r), 0)
    logp = torch.log_softmax(torch.randn(k, r, v), -1)
    heads = type("H", (), {"remap": {i: i for i in range(v)}})()
    circuit = Circuit(heads, log_pi, logp, root=2)
    joint = torch.zeros(v, v, v)
    for x0, x1, x2 in itertools.product(range(v), repeat=3):
        joint[x0, x1, x2] = sum(
            log_pi[z].exp() * logp[0, z, x0].exp() * logp[1, z, x1].exp() * logp[2, z, x2].exp() for z in range(r)
        )
    given_root = joint[2] / joint[2].sum()  # [x1, x2]
    assert torch.allclose(circuit.conditional(()), given_root.sum(1), atol=1e-6)
    assert torch.allclose(circuit.conditional((1,)), given_root[1] / given_root[1].sum(), atol=1e-6)
    pairs, joint_probs, product = circuit.pairs(top=2)
    for (a, b), j, p in zip(pairs, joint_probs, product, strict=True):
        assert j == pytest.approx(float(given_root[a, b]), abs=1e-6)
        assert p == pytest.approx(float(given_root.sum(1)[a] * given_root.sum(0)[b]), abs=1e-6)


def test_one_component_is_independent() -> None:
    torch.manual_seed(1)
    logp = torch.log_softmax(torch.randn(3, 1, 5), -1)
    heads = type("H", (), {"remap": {i: i for i in range(5)}})()
    circuit = Circuit(heads, torch.zeros(1), logp, root=0)
    assert torch.allclose(circuit.conditional((0,)), circuit.conditional((4,)))
    assert torch.allclose(circuit.conditional((0,)), logp[2, 0].exp())


def mtpc_proposer(heads: MTPCHeads, params: TreeParams, loaded) -> MTPCProposer:
    """The proposer `strategies.mtpc.run` builds: sampled chains in sample mode, trees otherwise."""
    temperature = params.temperature if params.mode == "sample" else None
    return MTPCProposer(heads, params.tree_nodes, temperature, loaded.vocab_size)


def _run(loaded, prompt, params, proposer, seed=0):
    settings = tree_settings(params, "mtpc")
    events = collect(tree_loop(loaded, prompt, proposer, torch.Generator().manual_seed(seed), settings))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)], events


def test_sampled_chain_scatters_q_to_the_full_vocabulary() -> None:
    rows = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])  # [n, V_d]
    vocab = torch.tensor([4, 1, 6])  # draft index -> model token id
    draft = sampled_chain([2, 0], rows, vocab, vocab_size=8)
    assert draft.tokens == [6, 4] and draft.parents is None and draft.is_chain
    assert draft.q.shape == (2, 8) and torch.equal(draft.q[:, vocab], rows)
    assert float(draft.q.sum()) == pytest.approx(2.0) and float(draft.q[:, [0, 2, 3, 5, 7]].abs().sum()) == 0
    assert draft.q_token == pytest.approx([0.3, 0.6]) and draft.ranks == [1, 0]
    empty = sampled_chain([], rows[:0], vocab, vocab_size=8)
    assert empty.tokens == [] and empty.q.shape == (0, 8)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_mtpc_equals_greedy_with_a_random_circuit(seed: int) -> None:
    loaded = tiny_loaded_model(seed)
    prompt = list(b"joint drafts")
    params = TreeParams(max_new_tokens=40, tree_nodes=9)
    tokens, events = _run(loaded, prompt, params, mtpc_proposer(random_circuit(loaded, seed=seed), params, loaded))
    assert tokens == greedy_tokens(loaded, prompt, 40)
    assert_round_order(events, (MixtureRound,))
    rounds = [e for e in events if isinstance(e, TreeRound)]
    mixtures = [e for e in events if isinstance(e, MixtureRound)]
    # one MixtureRound per round, also a last round with no budget left (one token to go, an empty tree)
    assert [m.step for m in mixtures] == [r.step for r in rounds]
    assert all(r.tokens for r in rounds[:-1])
    assert sum(mixtures[0].posterior) == pytest.approx(1.0, abs=1e-4) and len(mixtures[0].prior) == 3
    assert summarize(events).mean_accepted_length >= 1.0


def test_sampling_mode_is_lossless() -> None:
    """A chain drawn from the circuit, accepted with q = its conditionals: tokens 1-2 are distributed as p."""
    loaded = tiny_loaded_model(5, vocab=8)
    prompt = [3, 1, 4]
    params = TreeParams(max_new_tokens=3, mode="sample", temperature=1.0)
    proposer = mtpc_proposer(random_circuit(loaded, scale=0.6, seed=5), params, loaded)
    draws, counts, accepted = 1500, Counter(), 0
    for seed in range(draws):
        tokens, events = _run(loaded, prompt, params, proposer, seed)
        counts[tuple(tokens[:2])] += 1
        accepted += sum(len(r.accepted) for r in events if isinstance(r, TreeRound))
    assert accepted > 100  # the rule was exercised on accepted draft tokens, not only on recoveries
    with torch.no_grad():
        first = loaded.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        second = torch.stack(
            [loaded.model(input_ids=torch.tensor([prompt + [a]])).logits[0, -1].float().softmax(-1) for a in range(8)]
        )
    expected = torch.cat([first[:1], (first[1:, None] * second[1:]).flatten()]) * draws  # token 0 is EOS
    cells = [(0,)] + [(a, b) for a in range(1, 8) for b in range(8)]
    observed = torch.tensor([counts[c] for c in cells], dtype=torch.float32)
    assert observed.sum() == draws
    keep = expected >= 5
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert observed[~keep].sum() <= expected[~keep].sum() * 3 + 15
    assert chi2 < dof + 4 * (2 * dof) ** 0.5


def test_train_mtpc_on_tiny_distill_data(tmp_path: Path) -> None:
    from lab.training.cli import TrainOptions
    from lab.training.distill.dataset import load_distill
    from lab.training.distill.generate import DistillSettings, run_distill
    from lab.training.mtpc_train import train

    loaded = tiny_loaded_model(0)
    settings = DistillSettings("tiny", max_new_tokens=24, batch_size=4, limit=8)
    run_distill(loaded, settings, tmp_path, lambda *a: None)
    log: list[str] = []
    options = TrainOptions(epochs=20, batch_size=16, draft_vocab=64, heads=3, components=2, lr=3e-3)
    tensors, config = train(loaded, load_distill(tmp_path), options, log.append)
    assert tensors["adapters.up"].shape == (4, 2, 64, 32) and tensors["mix.weight"].shape == (2, 64)
    held = [line for line in log if "conditional" in line]
    assert held and "head 3: loss" in held[-1]
    losses = [float(line.split("train loss ")[1].split()[0]) for line in log if "train loss" in line]
    assert losses[-1] < losses[0]
    heads = MTPCHeads.from_tensors(loaded.lm_head.weight, tensors, config)
    log_pi, logp = heads.leaves(torch.randn(64))
    assert logp.shape == (4, 2, tensors["vocab"].numel()) and float(log_pi.exp().sum()) == pytest.approx(1.0)


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["medusa", "mtpc"])
def test_greedy_heads_equal_greedy_on_the_embedded_model(embedded, name: str) -> None:
    from lab.app.builtin_prompts import BUILTIN_PROMPTS
    from strategies import medusa, mtpc

    module = {"medusa": medusa, "mtpc": mtpc}[name]
    for prompt in (BUILTIN_PROMPTS[0], BUILTIN_PROMPTS[12]):
        ids = embedded.encode(prompt.text)
        events = collect(module.run(embedded, ids, TreeParams(max_new_tokens=48), torch.Generator()))
        tokens = [e.token_id for e in events if isinstance(e, TokenEmitted)]
        assert tokens == greedy_tokens(embedded, ids, 48)
        assert summarize(events).mean_accepted_length > 1.2  # the trained heads do get tokens accepted


def test_views_draw_what_the_trace_recorded() -> None:
    from visualizers import heads as views

    loaded = tiny_loaded_model(1)
    params = TreeParams(max_new_tokens=24, tree_nodes=9)
    _, events = _run(loaded, list(b"views"), params, mtpc_proposer(random_circuit(loaded, seed=1), params, loaded))
    rounds = [e for e in events if isinstance(e, TreeRound)]
    tree = rounds[0]
    fig = views.tree_figure(events, tree.step, collapse=False)  # every node (collapse folds the pruned ones)
    by_name = {trace.name: trace for trace in fig.data if trace.name}
    assert len(by_name["accepted"].x) == len(tree.accepted)
    drawn = sum(len(by_name[k].x) for k in ("accepted", "rejected", "pruned") if k in by_name)
    assert drawn == len(tree.tokens) and tree.next_source in by_name
    mask = views.attention_mask(tree.parents)
    assert len(mask) == len(tree.tokens) + 1 and all(row[0] == 1 and row[i] == 1 for i, row in enumerate(mask))
    drafted = [r for r in rounds if r.tokens]
    assert all(r.head_top_probs for r in rounds)  # a last round with no budget left still carries the head tops
    latest = views.head_topk_figure(events, drafted[-1].step).data[0]
    assert latest.z[0][0] == drafted[-1].head_top_probs[0][0]
    assert list(latest.x)[1].startswith("head 2") and len(latest.y) == len(drafted[-1].head_top_probs[0])
    # with no step, every round figure shows the latest round that drafted (not a last round of the root alone)
    for figure in (views.tree_figure, views.head_topk_figure, views.mask_figure):
        assert f"round {drafted[-1].step}" in figure(events).layout.title.text
    pairs = views.pairs_figure(events).data
    mix = [e for e in events if isinstance(e, MixtureRound)][-1]
    assert list(pairs[0].y) == mix.joint and list(pairs[1].y) == mix.product
    assert list(views.mixture_figure(events).data[0].x) == [r.step for r in rounds]  # one MixtureRound per round
    hist = views.compare_accepted_lengths({"medusa": events, "mtpc": events}).data
    assert sum(hist[0].y) == pytest.approx(1.0) and "tau" in hist[0].name
    for figure in (views.tree_figure, views.pairs_figure, views.mixture_figure, views.accepted_length_figure):
        assert figure([]).layout.annotations  # empty state
    assert set(views.VIEWS) == {"medusa", "mtpc"}
