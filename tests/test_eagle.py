"""EAGLE / EAGLE-2: the draft head and its cache, the dynamic tree, training, the decode loop and losslessness.

Unit part on tiny random Llamas (tests/tiny.py): the head's tree step equals running each path as a chain;
expansion and reranking keep a valid tree; greedy EAGLE equals plain greedy for a random head and for a head
trained on the tiny model's own data (saved and loaded through `lab.heads.common`); sampling mode matches the
target's distribution (chi-square on a vocabulary of 8); budgets, events and views. The integration part
(marked `embedded`) checks greedy equality on the embedded SmolLM2 in fp32 with the shipped head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.engine.models import wrap_model
from lab.engine.quant import Int4Linear, Int8Linear, W4A8Linear, W8A8Linear, quantize_model
from lab.heads.common import load_heads, save_heads
from lab.heads.eagle import EagleCache, EagleHead, build_head, serving_head
from lab.heads.eagle3 import Eagle3Head, build_eagle3, head_config, vocab_maps
from lab.params import InputError, build_params
from lab.speculative.proposers.eagle import EagleProposer, TreeShape, grow_tree, rerank
from lab.speculative.tree import TreeSettings, tree_loop
from lab.trace import EagleDraft, RunFinished, TokenEmitted, Trace, TreeRound, from_json, summarize, to_json
from lab.training import eagle_train
from lab.training.cli import TrainOptions
from lab.training.distill.dataset import load_distill
from lab.training.distill.generate import DistillSettings, run_distill
from strategies import collect, get_strategy
from strategies.eagle import SHIPPED_HEADS, EagleParams, proposer_for
from tests.stats import assert_joint_matches
from tests.test_medusa import assert_round_order
from tests.tiny import ByteTokenizer, tiny_llama, tiny_loaded_model
from visualizers import inspect_step, strategy_figures

GREEDY = get_strategy("greedy")
EAGLE = get_strategy("eagle")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def greedy_tokens(loaded, prompt_ids: list[int], n: int) -> list[int]:
    params = build_params(GREEDY.Params, {"max_new_tokens": n})
    return tokens_of(collect(GREEDY.run(loaded, prompt_ids, params, gen())))


def eagle_loop(loaded, prompt_ids: list[int], params: EagleParams, head, generator: torch.Generator):
    """`strategies.eagle.run` with a given head: the EAGLE proposer in the tree loop."""
    shape = TreeShape(params.total_tokens, params.depth, params.branch)
    settings = TreeSettings(params.max_new_tokens, params.sampling, params.mode, method="eagle")
    return tree_loop(loaded, prompt_ids, EagleProposer(head, shape), generator, settings)


def run_eagle(loaded, head, prompt_ids: list[int], seed: int = 0, **values) -> list:
    return collect(eagle_loop(loaded, prompt_ids, build_params(EagleParams, values), head, gen(seed)))


def random_head(loaded, seed: int = 1):
    torch.manual_seed(seed)
    return build_head(loaded, torch.arange(loaded.vocab_size))


# --- the head and its cache -------------------------------------------------------------------------------


def test_tree_step_equals_running_each_path_as_a_chain(tiny) -> None:
    head = random_head(tiny)
    features = torch.randn(5, 64)  # committed real pairs (f_p, x_{p+1}), p = 3..7
    cache = EagleCache(head)
    f_hat = cache.extend(features, [5, 6, 7, 8, 9], 3)
    # a tree: nodes 0, 1 under the root; node 2 under node 1, node 3 under node 2
    out01 = cache.tree_step(torch.stack([f_hat, f_hat]), [11, 12], [8, 8], [0, 1], [set(), set()])
    out2 = cache.tree_step(out01[1:2], [13], [9], [2], [{1}])
    out3 = cache.tree_step(out2, [14], [10], [3], [{1, 2}])
    for path_features, path_tokens, expected in (
        ([f_hat], [11], out01[0]),
        ([f_hat, out01[1], out2[0]], [12, 13, 14], out3[0]),
    ):
        chain = EagleCache(head)
        chain.extend(features, [5, 6, 7, 8, 9], 3)
        last = chain.extend(torch.stack(path_features), path_tokens, 8)
        torch.testing.assert_close(last, expected, rtol=1e-5, atol=1e-5)
    cache.rollback()  # the tree entries go, the committed pairs stay
    assert cache.committed == 5 and cache.cache.get_seq_length() == 5
    fresh = EagleCache(head)
    fresh.extend(features, [5, 6, 7, 8, 9], 3)
    torch.testing.assert_close(cache.extend(out2, [20], 8), fresh.extend(out2, [20], 8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_runs_the_heads_layer_without_module_calls_with_the_same_bits(kind: str, dtype) -> None:
    """At inference with a cache the head's layer runs lab.engine.lean_forward's ops (joined q / k / v and gate /
    up, no module dispatch): the same outputs, bit for bit, as the module calls training runs."""
    model = tiny_llama(2, layers=8).to(dtype)
    target = wrap_model(model, ByteTokenizer())
    torch.manual_seed(3)
    if kind == "eagle1":
        head, width = build_head(target, torch.arange(256)), 64
    else:
        head = build_eagle3(head_config(model.config, 256), model.get_input_embeddings()).to(dtype).eval()
        width = head.fc.in_features
    features = torch.randn(1, 6, width).to(dtype)
    tokens, positions = torch.randint(0, 256, (1, 6)), torch.arange(3, 9)[None]
    outputs = []
    for training in (False, True):  # lean drafting, then the module path (training mode, dropout 0)
        head.train(training)
        cache = DynamicCache(config=head.config)
        with torch.no_grad():
            first = head(features[:, :4], tokens[:, :4], positions[:, :4], cache=cache)
            outputs.append(torch.cat([first, head(features[:, 4:], tokens[:, 4:], positions[:, 4:], cache=cache)], 1))
    assert torch.equal(outputs[0], outputs[1])


def test_grow_tree_expands_the_best_frontier_and_rerank_keeps_a_tree() -> None:
    vocab = torch.arange(6)
    logq = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0]), dim=-1)
    calls = []

    def expand(c, frontier):
        calls.append(list(frontier))
        return logq.expand(len(frontier), -1)

    c = grow_tree(logq, expand, vocab, branch=2, depth=3, eos=(1,))
    assert calls == [[0], [2]]  # token 1 is EOS: nodes holding it are never expanded
    assert c.depths == [0, 0, 1, 1, 2, 2] and c.expanded == [True, False, True, False, False, False]
    calls.clear()
    c = grow_tree(logq, expand, vocab, branch=2, depth=3, eos=())
    # depth 1 holds (0,0) (0,1) (1,0) (1,1): the best two cumulative scores are (0,0) and (0,1) (a tie with
    # (1,0), broken by creation order)
    assert calls == [[0, 1], [2, 3]]
    assert c.tokens == [0, 1] * 5 and c.parents == [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3]
    for node, parent in enumerate(c.parents):
        if parent >= 0:
            assert c.scores[node] == pytest.approx(c.scores[parent] + float(logq[c.tokens[node]]))
            assert c.scores[node] <= c.scores[parent]
    for total in range(1, len(c.tokens) + 1):
        kept = rerank(c, total)
        assert len(kept) == total and all(c.parents[i] in kept or c.parents[i] < 0 for i in kept)
        assert [kept.index(c.parents[i]) < kept.index(i) for i in kept if c.parents[i] >= 0] == [True] * sum(
            c.parents[i] >= 0 for i in kept
        )
        threshold = min(c.scores[i] for i in kept)
        assert all(c.scores[i] <= threshold for i in range(len(c.tokens)) if i not in kept)


@pytest.mark.parametrize("seed", range(6))
def test_expanding_only_what_can_be_kept_keeps_the_same_tree(seed: int) -> None:
    """grow_tree with `keep` (what the proposer passes) drafts fewer candidates, and the rerank keeps the same
    tokens in the same tree as after the full EAGLE-2 expansion, for every tree size."""
    generator = torch.Generator().manual_seed(seed)
    vocab = torch.arange(40)
    rows = torch.log_softmax(3 * torch.randn(64, 40, generator=generator), dim=-1)

    def grown(keep, total, depth):
        def expand(c, frontier):  # children's log q: a fixed row per (parent token, depth)
            return torch.stack([rows[(c.tokens[i] + 7 * c.depths[i]) % 64] for i in frontier])

        c = grow_tree(rows[63], expand, vocab, branch=6, depth=depth, eos=(5,), keep=keep)
        kept = rerank(c, total)
        return c, [(c.tokens[i], c.depths[i], c.tokens[c.parents[i]] if c.parents[i] >= 0 else -1) for i in kept]

    for depth in (1, 2, 3, 4):
        for total in (1, 2, 4, 8, 16, 40):
            full, expected = grown(None, total, depth)
            pruned, kept = grown(total, total, depth)
            assert kept == expected and len(pruned.tokens) <= len(full.tokens)


# --- training and the decode loop on a tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory) -> tuple[object, Path, dict]:
    """A tiny model, an EAGLE head trained on its own data, saved like the CLI does; (model, stem, config)."""
    loaded = tiny_loaded_model(seed=0)
    folder = tmp_path_factory.mktemp("eagle")
    settings = DistillSettings(model="tiny", max_new_tokens=24, batch_size=4, limit=12, top_k=8)
    run_distill(loaded, settings, folder / "data", lambda *_: None)
    data = load_distill(folder / "data")
    torch.manual_seed(0)
    log: list[str] = []
    options = TrainOptions(epochs=12, lr=3e-3, batch_size=64, draft_vocab=64)
    tensors, config = eagle_train.train(loaded, data, options, log.append)
    config = {**config, "kind": "eagle", "model_shape": load_distill(folder / "data").config["model_shape"]}
    save_heads(folder / "eagle", tensors, config)
    return loaded, folder / "eagle", {"log": log, **config}


def test_training_lowers_the_held_out_losses(tiny_trained) -> None:
    _, _, config = tiny_trained
    held = [line for line in config["log"] if line.startswith("held out")]
    first, last = eval(held[0].split(": ", 1)[1]), config["held_out"]  # noqa: S307 (our own log line)
    assert last["reg"] < first["reg"] and last["ce"] < first["ce"]
    assert config["draft_vocab"] == 64 + 1  # the 64 most frequent tokens plus EOS


def test_saved_head_loads_and_greedy_eagle_equals_greedy(tiny_trained) -> None:
    loaded, stem, _ = tiny_trained
    tensors, config = load_heads("eagle", loaded, str(stem))
    assert tensors["vocab"].numel() == config["draft_vocab"]
    prompt = loaded.encode("the quick brown fox")
    expected = greedy_tokens(loaded, prompt, 40)
    params = build_params(EAGLE.Params, {"max_new_tokens": 40, "heads_path": str(stem)})
    events = collect(EAGLE.run(loaded, prompt, params, gen()))
    assert tokens_of(events) == expected
    assert summarize(events).mean_accepted_length > 1.0  # the trained head's drafts are accepted sometimes


@pytest.mark.parametrize(
    "values",
    [{}, {"depth": 1}, {"total_tokens": 1}, {"branch": 1, "depth": 4}, {"branch": 3, "total_tokens": 60, "depth": 9}],
    ids=["default", "depth 1", "one node", "chain", "wide"],
)
@pytest.mark.parametrize("prompt", ["hello world", "a"])
def test_greedy_eagle_equals_greedy_with_a_random_head(tiny, values, prompt) -> None:
    ids = tiny.encode(prompt)
    events = run_eagle(tiny, random_head(tiny), ids, max_new_tokens=30, **values)
    assert tokens_of(events) == greedy_tokens(tiny, ids, 30)
    assert events[-1].target_forwards == sum(isinstance(e, TreeRound) for e in events) + 1
    assert_round_order(events, (EagleDraft,))


def test_the_serving_head_runs_low_bit_and_stays_lossless(tiny_trained) -> None:
    """On an int4 target the head's linears take int4 (fc and its layer) and its draft logits the target's int8 LM
    head rows (the same int8 values); its drafts stay close to the float head's, and greedy EAGLE still equals
    greedy at int4. A bf16 target keeps the float head."""
    _, stem, _ = tiny_trained
    model = tiny_llama(0).to(torch.bfloat16)
    quantize_model(model, "int4", torch.bfloat16)
    target = wrap_model(model, ByteTokenizer())
    tensors, _ = load_heads("eagle", target, str(stem))
    float_head = build_head(target, tensors["vocab"], tensors)
    head = serving_head(build_head(target, tensors["vocab"], tensors), target)
    assert isinstance(head.fc, Int4Linear) and isinstance(head.layer.mlp.down_proj, Int4Linear)
    assert not any(type(m) is torch.nn.Linear for m in head.modules())
    rows = head._target["lm_rows"]
    assert torch.equal(rows.qweight, target.lm_head.qweight[tensors["vocab"]])
    features = torch.randn(5, 64).to(torch.bfloat16)
    drafted, reference = head.logits(features).float(), float_head.logits(features).float()
    assert drafted.shape == reference.shape == (5, tensors["vocab"].numel())
    assert torch.allclose(drafted, reference, atol=0.1 * reference.abs().max().item())
    prompt = target.encode("the quick brown fox")
    events = run_eagle(target, head, prompt, max_new_tokens=30)
    assert tokens_of(events) == greedy_tokens(target, prompt, 30)
    bf16 = wrap_model(tiny_llama(0).to(torch.bfloat16), ByteTokenizer())
    kept = serving_head(build_head(bf16, tensors["vocab"], tensors), bf16)
    assert type(kept.fc) is torch.nn.Linear and "lm_rows" not in kept._target


@pytest.mark.parametrize(
    "precision,layer_linear,lm_linear", [("w4a8", W4A8Linear, W8A8Linear), ("int4", Int4Linear, Int8Linear)]
)
def test_an_eagle3_head_is_served_in_the_targets_formats_and_stays_lossless(precision, layer_linear, lm_linear) -> None:
    """An EAGLE-3 head on a low-bit target: fc and its layer take the target's precision, its own draft LM head the
    target's LM-head format (no float linear is left, so no draft step runs a float product); serving twice changes
    nothing, the draft logits stay close to the float head's, and greedy EAGLE still equals greedy at that precision."""
    model = tiny_llama(3, layers=8, hidden=64).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    target = wrap_model(model, ByteTokenizer())
    torch.manual_seed(0)
    draft_vocab = torch.sort(torch.randperm(256)[:48]).values
    config = head_config(model.config, 48)

    def fresh() -> Eagle3Head:
        head = build_eagle3(config, model.get_input_embeddings())
        d2t, t2d = vocab_maps(draft_vocab, 256)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        return head.to(torch.bfloat16).eval()

    torch.manual_seed(1)
    float_head = fresh()
    head = fresh()
    head.load_state_dict(float_head.state_dict())
    served = serving_head(head, target)
    assert served is head and isinstance(head.fc, layer_linear) and isinstance(head.lm_head, lm_linear)
    assert isinstance(head.midlayer.self_attn.q_proj, layer_linear) and isinstance(
        head.midlayer.mlp.down_proj, layer_linear
    )
    assert not any(type(m) is torch.nn.Linear for m in head.modules())
    lm_head = head.lm_head
    assert serving_head(head, target).lm_head is lm_head  # already served: left as it is
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    drafted, reference = head.logits(hidden).float(), float_head.logits(hidden).float()
    assert drafted.shape == reference.shape == (5, 48)
    assert torch.allclose(drafted, reference, atol=0.1 * reference.abs().max().item())
    prompt = target.encode("the quick brown fox")
    events = run_eagle(target, head, prompt, max_new_tokens=30, total_tokens=6, depth=3)
    assert tokens_of(events) == greedy_tokens(target, prompt, 30)
    assert any(isinstance(e, TreeRound) for e in events)


def test_budget_is_exact_and_events_are_consistent(tiny_trained) -> None:
    loaded, stem, _ = tiny_trained
    tensors, _ = load_heads("eagle", loaded, str(stem))
    head = build_head(loaded, tensors["vocab"], tensors)
    prompt = loaded.encode("the quick brown fox")
    for n in (1, 2, 3, 7):
        events = run_eagle(loaded, head, prompt, max_new_tokens=n)
        assert len(tokens_of(events)) == n and events[-1].stop_reason == "max_new_tokens"
    events = run_eagle(loaded, head, prompt, max_new_tokens=40, mode="sample", temperature=0.7)
    trees = [e for e in events if isinstance(e, TreeRound)]
    drafts = {e.step: e for e in events if isinstance(e, EagleDraft)}
    assert sum(t.emitted for t in trees) == len(tokens_of(events)) - 1  # + the token from the prefill forward
    # an EagleDraft per drafted round; only a last round with no budget left (one token to go) drafts nothing
    assert sorted(drafts) == [t.step for t in trees if t.tokens] and all(t.tokens for t in trees[:-1])
    for tree in trees:
        path = [-1] + tree.accepted
        assert all(tree.parents[node] == path[i] for i, node in enumerate(tree.accepted))
        if not tree.tokens:
            continue
        draft = drafts[tree.step]
        kept = sorted(k for k in draft.kept if k >= 0)
        assert kept == list(range(len(tree.tokens))) and len(kept) <= draft.total_tokens
        assert all(draft.scores[i] >= draft.threshold for i, k in enumerate(draft.kept) if k >= 0)
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.draft_forwards > 0
    trace = from_json(to_json(Trace("eagle", loaded.spec, "p", {}, events)))
    assert trace.events == events
    figures = strategy_figures("eagle", trace.events)
    assert len(figures) == 4 and all(len(f.data) > 0 for f in figures)
    latest = [d for d in drafts.values() if d.tokens][-1]  # the main view shows the latest drafted round
    assert len(figures[0].frames) == max(latest.depths) + 1 + 2  # growth per depth, rerank, verified
    assert len(inspect_step("eagle", trace.events, trees[0].step).data) > 0
    assert all(len(f.data) <= 1 for f in strategy_figures("eagle", []))  # empty states


# --- sampling losslessness (chi-square on a vocabulary of 8) ----------------------------------------------

N_DRAWS = 2000


def small_model(seed: int = 0):
    """Vocabulary 8, LM head scaled x10 so p is far from uniform; EOS never emitted."""
    model = tiny_llama(seed, vocab=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.eos_token_id = 999
    return wrap_model(model, ByteTokenizer(), spec=f"tiny-v8-{seed}")


def exact_pair(loaded, prompt: list[int], config) -> torch.Tensor:
    """p(x2, x3) [V, V]: the second and third generated tokens, x1 summed out, from full forwards."""
    from lab.engine.sampling import process_logits, target_distribution

    def p_next(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        return target_distribution(process_logits(logits, config, ids), config)

    v = loaded.vocab_size
    joint = torch.zeros(v, v)
    for x1, p1 in enumerate(p_next(prompt).tolist()):
        second = p_next(prompt + [x1])
        for x2 in range(v):
            joint[x2] += p1 * second[x2] * p_next(prompt + [x1, x2])
    return joint


def test_sampling_matches_the_target() -> None:
    """Two-level trees (depth 2, 3 children per node) under temperature and top-p; x2 and x3 come from tree
    acceptance (siblings tried in order, p(x) zeroed on rejection, the residual sampled at the end)."""
    target = small_model(0)
    head = random_head(target, seed=3)
    values = {"max_new_tokens": 4, "mode": "sample", "depth": 2, "branch": 3, "temperature": 0.8, "top_p": 0.9}
    params = build_params(EagleParams, values)
    generator, pairs = gen(11), []
    for _ in range(N_DRAWS):
        tokens = tokens_of(collect(eagle_loop(target, [1], params, head, generator)))
        pairs.append((tokens[1], tokens[2]))
    assert_joint_matches(pairs, exact_pair(target, [1], params.sampling))
    with pytest.raises(AssertionError):  # the check can fail: another temperature is rejected
        assert_joint_matches(pairs, exact_pair(target, [1], build_params(EagleParams, {"temperature": 1.6}).sampling))


# --- embedded model ---------------------------------------------------------------------------------------

EMBEDDED_PROMPTS = [p.text for p in BUILTIN_PROMPTS[::6]]  # 4 prompts
EMBEDDED_TOKENS = 64


@pytest.mark.embedded
@pytest.mark.parametrize("head", SHIPPED_HEADS)
def test_embedded_greedy_eagle_equals_greedy(embedded, head) -> None:
    params = build_params(EAGLE.Params, {"max_new_tokens": EMBEDDED_TOKENS, "head": head})
    assert type(proposer_for(embedded, params).head) is {"eagle3": Eagle3Head, "eagle1": EagleHead}[head]
    taus = []
    for text in EMBEDDED_PROMPTS:
        ids = embedded.encode(text)
        events = collect(EAGLE.run(embedded, ids, params, gen()))
        assert tokens_of(events) == greedy_tokens(embedded, ids, EMBEDDED_TOKENS), text
        taus.append(summarize(events).mean_accepted_length)
    assert sum(taus) / len(taus) > 1.6  # the shipped heads really draft (tau about 2.0-2.3 with the defaults)


def test_a_model_without_a_shipped_eagle3_head_is_told_what_to_do(tiny) -> None:
    assert build_params(EAGLE.Params, {}).head == "eagle3"  # the default
    with pytest.raises(InputError, match="head = eagle1"):
        proposer_for(tiny, build_params(EAGLE.Params, {}))


def test_tuning_replays_smaller_trees_from_one_big_run(tiny_trained) -> None:
    from lab.tools.eagle_tune import rounds_of, tau_for

    loaded, stem, _ = tiny_trained
    tensors, _ = load_heads("eagle", loaded, str(stem))
    head = build_head(loaded, tensors["vocab"], tensors)
    prompt = loaded.encode("the quick brown fox")
    big = run_eagle(loaded, head, prompt, max_new_tokens=40, total_tokens=40, depth=6, branch=4)
    rounds = rounds_of(big)
    assert tau_for(rounds, 40, 6) == pytest.approx(summarize(big).mean_accepted_length, abs=1e-3)
    assert tau_for(rounds, 40, 1) <= tau_for(rounds, 40, 3) <= tau_for(rounds, 40, 6)
    assert tau_for(rounds, 1, 6) <= tau_for(rounds, 8, 6) <= tau_for(rounds, 40, 6)
    # a single node per round: accepted iff the big run's first accepted node is the best-scored candidate
    small = run_eagle(loaded, head, prompt, max_new_tokens=40, total_tokens=1, depth=6, branch=4)
    assert summarize(small).mean_accepted_length <= 2.0 and tau_for(rounds, 1, 6) <= 2.0
