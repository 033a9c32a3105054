"""`lab.engine.lean_forward` computes what `model(...)` computes, bit for bit: logits, hidden states and cache contents,
for prefill, one-token steps, causal chains and tree masks, at every precision (issue 17)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lab.engine import runtime
from lab.engine.invariance import rows_invariant
from lab.engine.lean_forward import SWITCH, lean_forward, supports
from lab.engine.models import load_model, wrap_model
from lab.engine.quant import Int4Linear, Int8Linear, concatenate, q4_from_weight, quantize_model
from lab.engine.tree_attention import build_tree_attention
from tests.tiny import ByteTokenizer, tiny_llama

TREE_PARENTS = [-1, 0, 0, 1, 2, 3]


def _forwards(prefix: int) -> list[tuple[list[int], dict]]:
    """Prefill `prefix` tokens, a one-token step, a causal chain of 3, then a tree verify with its 4D mask."""
    tree = build_tree_attention(TREE_PARENTS)
    n_past = prefix + 4
    tree_kwargs = {"attention_mask": tree.attention_mask(n_past), "position_ids": (tree.depths + n_past)[None]}
    prompt = [(7 * i + 3) % 200 + 1 for i in range(prefix)]
    return [(prompt, {}), ([11], {}), ([12, 13, 14], {}), ([5, 6, 7, 8, 9, 10], tree_kwargs)]


def assert_same_as_transformers(model: torch.nn.Module, forwards: list[tuple[list[int], dict]]) -> None:
    assert supports(model)
    reference, lean = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.inference_mode():
        for ids, kwargs in forwards:
            x = torch.tensor([ids])
            out = model(input_ids=x, cache=reference, use_cache=True, output_hidden_states=True, **kwargs)
            logits, hidden = lean_forward(model, x, lean, output_hidden_states=True, **kwargs)
            assert torch.equal(out.logits, logits), f"logits differ after {len(ids)} tokens"
            assert len(hidden) == len(out.hidden_states) == model.config.num_hidden_layers + 1
            assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, hidden, strict=True))
    for a, b in zip(reference.layers, lean.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    "dtype,precision,hidden",
    [
        (torch.float32, "bf16", 64),
        (torch.bfloat16, "bf16", 64),
        (torch.bfloat16, "int8", 64),
        (torch.bfloat16, "int4", 64),  # k / v of 32 outputs: q / k / v stay separate products
        (torch.bfloat16, "int4", 128),  # q 128, k 64, v 64: joined into one packed product
        (torch.bfloat16, "w4a8", 128),
    ],
)
def test_lean_forward_equals_transformers(dtype, precision, hidden) -> None:
    model = tiny_llama(3, layers=3, hidden=hidden).to(dtype)
    quantize_model(model, precision, dtype)
    loaded = wrap_model(model, ByteTokenizer())  # bf16: row-invariant attention and linears (lab.engine.invariance)
    with rows_invariant(loaded):  # as verification runs
        assert_same_as_transformers(model, _forwards(9))
    assert_same_as_transformers(model, _forwards(9))  # plain SDPA for the multi-row forwards


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_lean_forward_equals_transformers_on_the_embedded_model(precision) -> None:
    """The embedded model's own shapes (q / k / v and gate / up joined) at the default dtype."""
    loaded = load_model("smollm2-135m", device="cpu", dtype="bfloat16", precision=precision)
    with rows_invariant(loaded):
        assert_same_as_transformers(loaded.model, _forwards(40))


def test_joined_products_equal_separate_ones() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    weights = [torch.randn(n, 64) for n in (128, 64, 64)]
    for parts in (
        [Int4Linear(q4_from_weight(w), None, torch.bfloat16) for w in weights],
        [Int8Linear(w, None, torch.bfloat16) for w in weights],
    ):
        joined = concatenate(parts)
        assert torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=-1))
    # a packed part of 32 outputs ends in a partial block: joining it would shift the next part's rows
    assert concatenate([Int4Linear(q4_from_weight(torch.randn(n, 64)), None, torch.bfloat16) for n in (32, 32)]) is None
    assert concatenate([torch.nn.Linear(64, 8), torch.nn.Linear(64, 8)]) is None  # float32 keeps separate products
    assert concatenate([Int8Linear(weights[0], None, torch.bfloat16), torch.nn.Linear(64, 8)]) is None


def test_hooks_and_the_switch_send_forwards_through_transformers(monkeypatch) -> None:
    model = tiny_llama(1).eval()
    loaded = wrap_model(model, ByteTokenizer())
    assert loaded.lean
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    state, _ = runtime.prefill(loaded, [3, 4, 5])
    runtime.decode_step(state, 6)
    handle.remove()
    assert len(calls) == 2  # the hook saw both forwards
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None)
    assert not loaded.lean  # the bench's --profile timer
    handle.remove()
    monkeypatch.setenv(SWITCH, "0")
    assert not loaded.lean
