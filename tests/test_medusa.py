"""Medusa: candidate trees, tree verification exactness on tiny random Llamas, training plumbing, shipped heads."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from lab.engine import native_forward
from lab.engine.models import wrap_model
from lab.engine.quant import quantize_model
from lab.heads.medusa import MedusaHeads, residual_blocks, tune_choices
from lab.speculative.acceptance import typical_path
from lab.speculative.draft import Draft, DraftContext, Verified
from lab.speculative.params import tree_settings
from lab.speculative.proposers.medusa import MedusaProposer, prune_choices, tree_from_choices
from lab.speculative.tree import tree_loop
from lab.trace import TokenEmitted, TreeRound, summarize
from strategies import collect
from strategies.greedy import GreedyParams
from strategies.greedy import run as greedy_run
from strategies.medusa import TreeParams
from tests.tiny import ByteTokenizer, tiny_llama, tiny_loaded_model

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def random_tensors(loaded, heads: int = 4, scale: float = 0.05, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    hidden, vocab = int(loaded.config.hidden_size), loaded.vocab_size
    return {
        "blocks.weight": scale * torch.randn(heads, hidden, hidden),
        "blocks.bias": scale * torch.randn(heads, hidden),
        "vocab": torch.arange(0, vocab, 2),  # a draft vocabulary: every other token
    }


def random_heads(loaded, heads: int = 4, scale: float = 0.05, seed: int = 1) -> MedusaHeads:
    tensors = random_tensors(loaded, heads, scale, seed)
    return MedusaHeads.from_tensors(loaded.lm_head.weight, tensors, {"choices": [list(c) for c in CHOICES]})


def low_bit_target(precision: str, seed: int = 0):
    """A tiny bf16 Llama with its linears and LM head at `precision` (the LM head int8, or Q8_0 at w4a8)."""
    model = tiny_llama(seed).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    return wrap_model(model, ByteTokenizer(), spec=f"tiny-{precision}-{seed}")


@pytest.mark.parametrize("precision", ["int4", "w4a8"])
def test_served_heads_run_on_the_targets_low_bit_kernels_and_stay_lossless(precision: str) -> None:
    """On a low-bit target the K blocks are one low-bit linear and the logits the target's LM-head rows V_d (the
    same quantized values); the draft distribution stays close to the float heads', and greedy Medusa still
    equals greedy at that precision. A bf16 target keeps the float products."""
    if precision == "w4a8" and not native_forward.build():
        pytest.skip("w4a8 needs the op's integer products (a C++ compiler)")
    target = low_bit_target(precision)
    tensors, config = random_tensors(target, scale=0.2), {"choices": [list(c) for c in CHOICES]}
    served, reference = (
        MedusaHeads.served(target, tensors, config),
        MedusaHeads.from_tensors(target.lm_head.weight, tensors, config),
    )
    assert served.low_bit is not None and not any(type(m) is torch.nn.Linear for m in served.low_bit.blocks.modules())
    rows = served.low_bit.lm_rows
    assert torch.equal(rows.weight, target.lm_head.weight[tensors["vocab"]])
    h = torch.randn(64).to(torch.bfloat16)
    drafted, expected = served.probs(h), reference.probs(h)
    assert drafted.shape == expected.shape == (4, tensors["vocab"].numel())
    assert (drafted - expected).abs().max() < 0.05
    prompt = list(b"hello tree")
    tokens, _ = tree_tokens(target, prompt, TreeParams(max_new_tokens=30, tree_nodes=9), MedusaProposer(served, 9))
    assert tokens == greedy_tokens(target, prompt, 30)
    bf16 = wrap_model(tiny_llama(0).to(torch.bfloat16), ByteTokenizer())
    assert MedusaHeads.served(bf16, tensors, config).low_bit is None


def greedy_tokens(loaded, prompt: list[int], n: int) -> list[int]:
    events = collect(greedy_run(loaded, prompt, GreedyParams(max_new_tokens=n), torch.Generator()))
    return [e.token_id for e in events if hasattr(e, "token_id")]


def tree_tokens(loaded, prompt, params, proposer, seed: int = 0) -> tuple[list[int], list]:
    settings = tree_settings(params, "medusa")
    events = collect(tree_loop(loaded, prompt, proposer, torch.Generator().manual_seed(seed), settings))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)], events


def assert_round_order(events: list, details: tuple[type, ...] = ()) -> None:
    """The first token comes from prefill (step 0, source "target"); each later step streams the proposer's
    detail events, then its TreeRound, then its TokenEmitted (at least one), and RunFinished ends the run."""
    first, *middle, last = events
    assert isinstance(first, TokenEmitted) and (first.step, first.source) == (0, "target")
    assert type(last).__name__ == "RunFinished"
    steps: dict[int, list] = {}
    for event in middle:
        steps.setdefault(event.step, []).append(event)
    assert list(steps) == list(range(1, len(steps) + 1))  # steps in order, none interleaved
    for group in steps.values():
        kinds = ["detail" if isinstance(e, details) else type(e).__name__ for e in group]
        n_detail = kinds.count("detail")
        assert kinds[:n_detail] == ["detail"] * n_detail and kinds[n_detail] == "TreeRound", kinds
        assert len(kinds) > n_detail + 1 and set(kinds[n_detail + 1 :]) == {"TokenEmitted"}, kinds
        assert all(e.source != "target" for e in group if isinstance(e, TokenEmitted))


def test_tree_from_choices_builds_parents_first_and_drops_children_of_eos() -> None:
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])  # [depth, V_d]
    vocab = torch.tensor([10, 11, 12])
    tree = tree_from_choices(
        [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], lambda prefix: probs[len(prefix)], vocab, eos_ids=(12,)
    )
    # depth 0: rank 0 = 11, rank 1 = 12 (EOS: its child (1, 0) is dropped); depth 1: 10, 12; depth 2: 12
    assert tree.tokens == [11, 12, 10, 12, 12]
    assert tree.parents == [-1, -1, 0, 0, 2]
    assert tree.depths == [0, 0, 1, 1, 2] and tree.ranks == [0, 1, 0, 1, 0]
    assert tree.q is None  # deterministic (top-k) candidates: q one-hot for the acceptance rule
    assert tree.q_token == pytest.approx([0.6, 0.3, 0.5, 0.3, 0.6])


def test_prune_and_tune_choices_keep_valid_trees() -> None:
    accuracy = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    choices = tune_choices(accuracy, max_nodes=8)
    assert choices[:3] == [(0,), (0, 0), (1,)]  # 0.6, 0.24, 0.2
    for n in range(1, len(choices) + 1):
        present = set(choices[:n])
        assert all(len(p) == 1 or p[:-1] in present for p in choices[:n])
    assert prune_choices(choices, 8, max_depth=1, num_heads=4) == [(0,), (1,), (2,)]
    assert all(len(p) <= 2 for p in prune_choices(choices, 8, max_depth=5, num_heads=2))


def test_residual_blocks_start_as_identity() -> None:
    h = torch.randn(3, 8)
    out = residual_blocks(h, torch.zeros(2, 8, 8), torch.zeros(2, 8))
    assert torch.equal(out, h[:, None, :].expand(3, 2, 8))


def test_typical_acceptance_takes_the_longest_path_above_the_threshold() -> None:
    # root -> nodes 0 (token 1), 1 (token 2); node 0 -> node 2 (token 0); rows of probs: [root, node 0, ...]
    draft = Draft([1, 2, 0], [-1, -1, 0])
    probs = torch.tensor([[0.05, 0.5, 0.45], [0.9, 0.05, 0.05], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    params = TreeParams(mode="typical", epsilon=0.09, delta=0.3)
    assert typical_path(draft, probs, params.epsilon, params.delta) == [0, 2]
    probs[1] = torch.tensor([0.05, 0.9, 0.05])  # node 2 (token 0) falls below the threshold
    assert typical_path(draft, probs, params.epsilon, params.delta) == [0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_medusa_equals_greedy_with_random_heads(seed: int) -> None:
    loaded = tiny_loaded_model(seed)
    prompt = list(b"hello tree")
    proposer = MedusaProposer(random_heads(loaded, seed=seed), 9)
    tokens, events = tree_tokens(loaded, prompt, TreeParams(max_new_tokens=40, tree_nodes=9), proposer)
    assert tokens == greedy_tokens(loaded, prompt, 40)
    rounds = [e for e in events if isinstance(e, TreeRound)]
    assert rounds and sum(r.emitted for r in rounds) + 1 == len(tokens)
    assert_round_order(events)
    assert summarize(events).mean_accepted_length == pytest.approx(
        sum(r.emitted for r in rounds) / len(rounds), abs=1e-4
    )


class OracleProposer:
    """Drafts the true greedy continuation as the rank-0 chain (always right) or tokens that never match."""

    name = "oracle"
    feature_layers = ()
    forwards = 0

    def __init__(self, reference: list[int], prompt_len: int, right: bool, vocab: int) -> None:
        self.reference, self.prompt_len, self.right, self.vocab = reference, prompt_len, right, vocab
        self.position = 0

    def propose(self, context: DraftContext) -> Draft:
        start = self.position  # index of the root in the reference (every round accepts all or nothing)
        assert self.reference[start] == context.tokens[-1] and len(context.tokens) == self.prompt_len + start + 1
        chain = self.reference[start + 1 : start + 1 + min(3, context.gamma)]
        self.position += len(chain) + 1 if self.right else 1
        if not self.right:
            chain = [(t + 1) % self.vocab for t in chain]
        n = len(chain)
        return Draft(chain, list(range(-1, n - 1)), q_token=[1.0] * n, ranks=[0] * n)

    def accept(self, verified: Verified) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("right", [True, False])
def test_tree_loop_with_always_right_and_always_wrong_drafts(right: bool) -> None:
    loaded = tiny_loaded_model(3)
    prompt = list(b"abc")
    reference = greedy_tokens(loaded, prompt, 30)
    proposer = OracleProposer(reference, len(prompt), right, loaded.vocab_size)
    tokens, events = tree_tokens(loaded, prompt, TreeParams(max_new_tokens=30), proposer)
    assert tokens == reference
    stats = summarize(events)
    if right:
        assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length > 3.5
    else:
        assert stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 1.0


def test_sampling_mode_matches_the_target_distribution() -> None:
    """Lossless sample mode: the first two emitted tokens are distributed as p (chi-square, tiny vocabulary)."""
    loaded = tiny_loaded_model(4, vocab=8)
    prompt = [1, 2, 3]
    proposer = MedusaProposer(random_heads(loaded, scale=0.5, seed=4), 9)
    params = TreeParams(max_new_tokens=3, mode="sample", temperature=1.0, tree_nodes=9)
    draws = 1500
    counts = Counter()
    for seed in range(draws):
        tokens, _ = tree_tokens(loaded, prompt, params, proposer, seed)
        counts[tuple(tokens[:2])] += 1
    with torch.no_grad():
        first = loaded.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        second = torch.stack(
            [loaded.model(input_ids=torch.tensor([prompt + [a]])).logits[0, -1].float().softmax(-1) for a in range(8)]
        )
    # token 0 is EOS: a run that starts with it stops there, so (0,) is one bin
    expected = torch.cat([first[:1], (first[1:, None] * second[1:]).flatten()]) * draws  # [1 + 56]
    cells = [(0,)] + [(a, b) for a in range(1, 8) for b in range(8)]
    observed = torch.tensor([counts[c] for c in cells], dtype=torch.float32)
    assert sum(counts.values()) == observed.sum()
    keep = expected >= 5
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert observed[~keep].sum() <= expected[~keep].sum() * 3 + 15
    assert chi2 < dof + 4 * (2 * dof) ** 0.5  # about the 99.99th percentile


def test_train_medusa_on_tiny_distill_data(tmp_path: Path) -> None:
    from lab.heads.common import load_heads, model_shape, save_heads
    from lab.training.cli import TrainOptions
    from lab.training.distill.dataset import load_distill
    from lab.training.distill.generate import DistillSettings, run_distill
    from lab.training.medusa_train import train

    loaded = tiny_loaded_model(0)
    run_distill(
        loaded, DistillSettings("tiny", max_new_tokens=24, batch_size=4, limit=8), tmp_path / "d", lambda *a: None
    )
    data = load_distill(tmp_path / "d")
    log: list[str] = []
    options = TrainOptions(epochs=20, batch_size=16, draft_vocab=64, heads=3, lr=3e-3)
    tensors, config = train(loaded, data, options, log.append)
    assert tensors["blocks.weight"].shape == (3, 64, 64) and tensors["vocab"].numel() >= 64
    assert any("head 3: loss" in line for line in log)
    first = float(log[next(i for i, line in enumerate(log) if "held out @" in line)].split("loss ")[1].split()[0])
    last = float([line for line in log if "held out @" in line][-1].split("loss ")[1].split()[0])
    assert last < first  # training lowers the held-out loss of head 1
    assert config["choices"] and all(len(p) <= 3 for p in config["choices"])
    save_heads(tmp_path / "h" / "medusa", tensors, {**config, "kind": "medusa", "model_shape": model_shape(loaded)})
    loaded_tensors, loaded_config = load_heads("medusa", loaded, str(tmp_path / "h" / "medusa"))
    heads = MedusaHeads.from_tensors(loaded.lm_head.weight, loaded_tensors, loaded_config)
    assert heads.probs(torch.randn(64)).shape == (3, loaded_tensors["vocab"].numel())
