"""Forward passes and KV-cache handling on a tiny random Llama: every cached path equals a no-cache forward."""

from __future__ import annotations

import pytest
import torch

from lab.engine import runtime
from lab.engine.tree_attention import build_tree_attention
from tests.tiny import tiny_loaded_model

PROMPT = [5, 17, 42, 99, 3, 250, 64, 12]
CONTINUATION = [7, 200, 31, 8, 66]
ATOL = 1e-5


def full_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Reference: one forward over the whole sequence without any cache, float32 [T, V]."""
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_prefill_and_decode_steps_match_full_forward(tiny) -> None:
    reference = full_logits(tiny, PROMPT + CONTINUATION)  # [T, V]
    state, out = runtime.prefill(tiny, PROMPT)
    assert out.logits.shape == (1, tiny.vocab_size)
    assert out.logits.dtype == torch.float32
    close(out.logits[-1], reference[len(PROMPT) - 1])
    for k, token in enumerate(CONTINUATION[:-1]):
        out = runtime.decode_step(state, token)
        assert out.logits.shape == (1, tiny.vocab_size)
        close(out.logits[0], reference[len(PROMPT) + k])
    assert state.length == len(PROMPT) + len(CONTINUATION) - 1
    assert state.tokens == PROMPT + CONTINUATION[:-1]


def test_prefill_with_hidden_states_returns_every_position(tiny) -> None:
    state, out = runtime.prefill(tiny, PROMPT, hidden_states=True)
    assert out.logits.shape == (len(PROMPT), tiny.vocab_size)
    close(out.logits, full_logits(tiny, PROMPT))


def test_verify_chain_rows_equal_step_by_step_decode(tiny) -> None:
    state, first = runtime.prefill(tiny, PROMPT)
    chain = runtime.verify(state, CONTINUATION).logits  # [gamma, V]
    assert chain.shape == (len(CONTINUATION), tiny.vocab_size)

    stepwise, _ = runtime.prefill(tiny, PROMPT)
    for i, token in enumerate(CONTINUATION):
        close(chain[i], runtime.decode_step(stepwise, token).logits[0])
    assert state.length == stepwise.length == len(PROMPT) + len(CONTINUATION)


def test_crop_then_redecode_equals_never_having_decoded(tiny) -> None:
    state, _ = runtime.prefill(tiny, PROMPT)
    runtime.verify(state, CONTINUATION)  # a rejected draft chain
    keep = len(PROMPT) + 2
    runtime.crop(state, keep)
    assert state.forwards == 2  # a rollback runs no model
    assert state.length == keep
    assert state.tokens == PROMPT + CONTINUATION[:2]
    after_crop = runtime.decode_step(state, 123).logits[0]

    fresh, _ = runtime.prefill(tiny, PROMPT)
    runtime.verify(fresh, CONTINUATION[:2])
    expected = runtime.decode_step(fresh, 123).logits[0]
    close(after_crop, expected)
    close(after_crop, full_logits(tiny, PROMPT + CONTINUATION[:2] + [123])[-1])


def test_crop_to_prompt_length_after_decode_steps(tiny) -> None:
    state, _ = runtime.prefill(tiny, PROMPT)
    for token in CONTINUATION:
        runtime.decode_step(state, token)
    runtime.crop(state, len(PROMPT))
    assert state.tokens == PROMPT
    close(runtime.decode_step(state, 9).logits[0], full_logits(tiny, PROMPT + [9])[-1])


def test_select_keeps_prefix_and_accepted_tree_path(tiny) -> None:
    parents = [-1, -1, 0, 0, 1, 2, 3]
    tokens = [10, 11, 20, 21, 22, 30, 31]
    tree = build_tree_attention(parents)
    state, _ = runtime.prefill(tiny, PROMPT)
    n_past = state.length
    runtime.verify_tree(state, tree, tokens)
    path = tree.path_to(5)  # nodes 0 -> 2 -> 5
    assert path == [0, 2, 5]
    runtime.select(state, list(range(n_past)) + [n_past + i for i in path])
    accepted = [tokens[i] for i in path]
    assert state.length == n_past + len(path)
    assert state.tokens == PROMPT + accepted
    after_select = runtime.decode_step(state, 77).logits[0]

    fresh, _ = runtime.prefill(tiny, PROMPT)
    runtime.verify(fresh, accepted)
    close(after_select, runtime.decode_step(fresh, 77).logits[0])
    close(after_select, full_logits(tiny, PROMPT + accepted + [77])[-1])


@pytest.mark.parametrize("path", [[0, 1], [1, 3], []])  # in place (a crop), moved, none
def test_select_moves_only_what_is_out_of_place(tiny, path) -> None:
    parents = [-1, 0, -1, 2]
    tokens = [10, 11, 20, 21]
    state, _ = runtime.prefill(tiny, PROMPT)
    n_past = state.length
    runtime.verify_tree(state, build_tree_attention(parents), tokens)
    expected = [torch.cat([layer.keys[..., :n_past, :], layer.keys[..., [n_past + i for i in path], :]], -2)
                for layer in state.cache.layers]  # fmt: skip
    runtime.select(state, list(range(n_past)) + [n_past + i for i in path])
    assert state.tokens == PROMPT + [tokens[i] for i in path]
    for layer, keys in zip(state.cache.layers, expected, strict=True):
        assert torch.equal(layer.keys, keys)


def test_select_rejects_positions_out_of_order_or_range(tiny) -> None:
    state, _ = runtime.prefill(tiny, PROMPT)
    for positions in ([1, 0], [0, len(PROMPT)]):
        with pytest.raises(ValueError, match="ascend"):
            runtime.select(state, positions)
    assert state.length == len(PROMPT)


def test_hidden_states_shapes_and_embeddings(tiny) -> None:
    state, out = runtime.prefill(tiny, PROMPT, hidden_states=True)
    hidden = out.hidden_states
    assert hidden is not None
    assert len(hidden) == tiny.num_layers + 1
    for h in hidden:
        assert h.shape == (len(PROMPT), tiny.config.hidden_size)
    with torch.inference_mode():
        close(hidden[0], tiny.embeddings(torch.tensor(PROMPT)))
    step = runtime.decode_step(state, 9, hidden_states=True)
    assert len(step.hidden_states) == tiny.num_layers + 1
    assert all(h.shape == (1, tiny.config.hidden_size) for h in step.hidden_states)
    assert runtime.decode_step(state, 10).hidden_states is None


def test_early_exit_on_last_hidden_state_equals_final_logits(tiny) -> None:
    """As in HF, hidden_states[-1] is already through the final norm: lm_head alone gives the logits."""
    _, out = runtime.prefill(tiny, PROMPT, hidden_states=True)
    exit_logits = runtime.early_exit_logits(tiny, out.hidden_states[-1])
    assert exit_logits.dtype == torch.float32
    close(exit_logits, out.logits)


def test_early_exit_last_layer_with_non_unit_norm_weights() -> None:
    """Same contract on a model whose final RMSNorm weight is not all ones (as in any trained model):
    normalizing hidden_states[-1] again would change the logits."""
    loaded = tiny_loaded_model(seed=1)
    with torch.no_grad():
        loaded.final_norm.weight.copy_(torch.linspace(0.5, 2.0, loaded.config.hidden_size))
    _, out = runtime.prefill(loaded, PROMPT, hidden_states=True)
    close(runtime.early_exit_logits(loaded, out.hidden_states[-1]), out.logits)
    double_norm = runtime.early_exit_logits(loaded, out.hidden_states[-1], apply_norm=True)
    assert not torch.allclose(double_norm, out.logits, atol=1e-3)


def test_early_exit_intermediate_layer_is_logit_lens(tiny) -> None:
    _, out = runtime.prefill(tiny, PROMPT, hidden_states=True)
    h1 = out.hidden_states[1]
    with torch.inference_mode():
        expected = tiny.lm_head(tiny.final_norm(h1)).float()
        raw = tiny.lm_head(h1).float()
    close(runtime.early_exit_logits(tiny, h1, apply_norm=True), expected)
    close(runtime.early_exit_logits(tiny, h1), raw)


def test_forwards_are_counted(tiny) -> None:
    state, _ = runtime.prefill(tiny, PROMPT)
    assert state.forwards == 1
    runtime.decode_step(state, 1)
    assert state.forwards == 2
    runtime.verify(state, [2, 3, 4])
    assert state.forwards == 3
    runtime.verify_tree(state, build_tree_attention([-1, 0, 0]), [5, 6, 7])
    assert state.forwards == 4
    runtime.select(state, list(range(len(PROMPT))))
    assert state.forwards == 4  # a rollback runs no model


def test_prefill_rejects_empty_prompt(tiny) -> None:
    with pytest.raises(ValueError):
        runtime.prefill(tiny, [])
