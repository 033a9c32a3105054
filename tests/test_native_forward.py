"""`lab.engine.native_forward` (the decoder layers as one C++ op) computes what the Python loop of
`lab.engine.lean_forward` computes: logits, hidden states and cache, bit for bit, for every forward it takes (one-token
steps, chains and tree verifies under `rows_invariant`), at every precision; forwards it does not take keep the Python
loop."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from lab.engine import forward_path, native_forward, runtime
from lab.engine.invariance import _hidden_keys, exact_attention, rows_invariant
from lab.engine.lean_forward import lean_forward
from lab.engine.models import load_model, wrap_model
from lab.engine.quant import Int8Linear, quantize_model
from lab.engine.tree_attention import build_tree_attention
from lab.heads.eagle import EagleCache, build_head, serving_head
from lab.heads.eagle3 import build_eagle3, head_config, vocab_maps
from tests.test_lean_forward import _forwards
from tests.tiny import ByteTokenizer, tiny_llama

BUILT = native_forward.build()
# in CI (CI=true) with a C++ toolchain the op must build: its tests then fail instead of skipping
REQUIRED = os.environ.get("CI", "").lower() in ("true", "1") and forward_path.toolchain_present()


@pytest.fixture(autouse=True)
def _the_op_is_built() -> None:
    if not BUILT:
        if REQUIRED:
            pytest.fail("CI=true and a C++ toolchain is present, but the native op did not build (see the warning)")
        pytest.skip("no C++ compiler: the Python loop runs")


def _count_calls(monkeypatch, dim: int) -> list[int]:
    """Records embeds.shape[dim] of each call of the op."""
    calls: list[int] = []
    real = torch.ops.decoding_lab.decoder_layers

    def counted(embeds, *args):
        calls.append(embeds.shape[dim])
        return real(embeds, *args)

    monkeypatch.setattr(torch.ops.decoding_lab, "decoder_layers", counted)
    return calls


@pytest.fixture
def op_calls(monkeypatch) -> list[int]:
    """Counts the op's calls (its token counts)."""
    return _count_calls(monkeypatch, 1)


@pytest.fixture
def op_sequences(monkeypatch) -> list[int]:
    """Counts the op's calls (the sequences each call ran)."""
    return _count_calls(monkeypatch, 0)


def _run(model, forwards, native: bool, monkeypatch) -> tuple[list, DynamicCache]:
    monkeypatch.setenv(native_forward.SWITCH, "1" if native else "0")
    cache, outputs = DynamicCache(config=model.config), []
    with torch.inference_mode():
        for ids, kwargs in forwards:
            outputs.append(lean_forward(model, torch.tensor([ids]), cache, output_hidden_states=True, **kwargs))
    return outputs, cache


def assert_native_equals_python(model, forwards, monkeypatch) -> None:
    native, native_cache = _run(model, forwards, True, monkeypatch)
    python, python_cache = _run(model, forwards, False, monkeypatch)
    for (logits_a, hidden_a), (logits_b, hidden_b) in zip(native, python, strict=True):
        assert torch.equal(logits_a, logits_b)
        assert all(torch.equal(a, b) for a, b in zip(hidden_a, hidden_b, strict=True))
    for a, b in zip(native_cache.layers, python_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    "dtype,precision,hidden",
    [
        (torch.bfloat16, "bf16", 64),  # the two-row float product
        (torch.float16, "bf16", 64),
        (torch.bfloat16, "int8", 64),
        (torch.bfloat16, "int4", 64),  # q / k / v as three products
        (torch.bfloat16, "int4", 128),  # q / k / v joined
        (torch.bfloat16, "w4a8", 64),
        (torch.bfloat16, "w4a8", 128),
    ],
)
def test_native_layers_equal_the_python_loop(dtype, precision, hidden, monkeypatch, op_calls) -> None:
    model = tiny_llama(5, layers=3, hidden=hidden).to(dtype)
    quantize_model(model, precision, dtype)
    loaded = wrap_model(model, ByteTokenizer())
    with rows_invariant(loaded):
        assert_native_equals_python(model, _forwards(9), monkeypatch)
    assert op_calls == [1, 3, 6]  # the step, the chain, the tree; prefill keeps SDPA
    op_calls.clear()
    assert_native_equals_python(model, _forwards(9), monkeypatch)
    assert op_calls == [1]  # outside rows_invariant a multi-token forward takes SDPA, not the op


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_native_layers_on_the_embedded_model(precision, monkeypatch, op_calls) -> None:
    loaded = load_model("smollm2-135m", device="cpu", dtype="bfloat16", precision=precision)
    steps = [([17 + i], {}) for i in range(4)]
    with rows_invariant(loaded):
        assert_native_equals_python(loaded.model, _forwards(40)[:3] + steps, monkeypatch)
    assert op_calls == [1, 3, 1, 1, 1, 1]


def test_float32_models_and_batches_keep_the_python_loop(monkeypatch, op_calls) -> None:
    model = tiny_llama(2)
    wrap_model(model, ByteTokenizer())
    _run(model, _forwards(5)[:2], True, monkeypatch)
    bf16 = tiny_llama(2).to(torch.bfloat16)
    wrap_model(bf16, ByteTokenizer())
    cache = DynamicCache(config=bf16.config)
    with torch.inference_mode():
        lean_forward(bf16, torch.tensor([[3, 4], [5, 6]]), cache)
        lean_forward(bf16, torch.tensor([[7], [8]]), cache)
    assert op_calls == []


def test_a_replaced_or_unknown_linear_is_followed(monkeypatch, op_calls) -> None:
    model = tiny_llama(3, layers=2, hidden=128).to(torch.bfloat16)
    quantize_model(model, "int8", torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    with rows_invariant(loaded):
        assert_native_equals_python(model, _forwards(6), monkeypatch)
        attn = model.model.layers[1].self_attn
        attn.o_proj = Int8Linear(torch.randn(128, 128), None, torch.bfloat16)  # a new plan is built
        assert_native_equals_python(model, _forwards(6), monkeypatch)
        calls = len(op_calls)

        class Adapter(torch.nn.Module):  # a module the op does not know: the Python loop runs it
            def __init__(self, inner):
                super().__init__()
                self.inner, self.in_features, self.out_features, self.bias = inner, 128, 128, None

            def forward(self, x):
                return self.inner(x) * 2

        attn.o_proj = Adapter(attn.o_proj)
        assert_native_equals_python(model, _forwards(6), monkeypatch)
        assert len(op_calls) == calls


def test_without_the_op_forwards_take_the_python_loop(monkeypatch, op_calls) -> None:
    monkeypatch.setattr(native_forward, "_loaded", False)  # as after a failed build
    model = tiny_llama(4).to(torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    with rows_invariant(loaded):
        _run(model, _forwards(5), True, monkeypatch)
    assert op_calls == []


@pytest.mark.parametrize("layout", ["contiguous", "cache view"])
@pytest.mark.parametrize("variant", ["best", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_loop_equals_exact_attention(dtype, variant, layout) -> None:
    """Scores are exact in float64, so the loop and exact_attention's batched products round to the same values
    (module docstrings); masked keys, grouped heads or not, one to 24 query rows per kv head (up to four: the values
    widened in registers; more: widened once), many keys. "best" is the AVX-512 loop for bf16 on a CPU that has it
    (lab/engine/native/attention_avx512.cpp), "portable" the loop every CPU runs; "cache view": keys and values as
    the op's caches hold them, the first positions of a longer buffer (heads further apart)."""
    torch.manual_seed(0)
    tree = build_tree_attention([-1, 0, 0, 1, 1, 2, 3, 3])
    code = {"best": -1, "portable": 0}[variant]
    # (query rows, cached keys, mask, query heads): 3 kv heads, so 1 to 24 rows per kv head, key counts with tails
    cases = [(1, 200, None, 9), (3, 50, "causal", 9), (8, 100, "tree", 9), (1, 5, None, 9), (2, 30, "causal", 9)]
    cases += [(1, 13, None, 6), (4, 61, "causal", 3), (1, 1000, None, 3), (8, 7, "tree", 3)]
    for rows, past, mask, heads in cases:
        keys = past + rows
        q = torch.randn(1, heads, rows, 64).to(dtype)
        room = 0 if layout == "contiguous" else 37
        k, v = (torch.randn(1, 3, keys + room, 64).to(dtype)[:, :, :keys] for _ in range(2))
        attention_mask = tree.attention_mask(past) if mask == "tree" else None
        hidden = _hidden_keys(attention_mask, rows, keys) if mask else None  # [rows, keys], True: not seen
        expected = exact_attention(q, k, v, attention_mask, 0.125)
        assert torch.equal(torch.ops.decoding_lab.exact_attention(q, k, v, hidden, 0.125, code), expected)


@pytest.mark.parametrize("features", [16, 64, 100, 576, 1536, 3000, 18432])  # tails and every cascade level
def test_the_norm_loop_equals_llama_rms_norm(features) -> None:
    """The op's RMSNorm reproduces ATen's float sum (lanes, accumulators, levels), so it returns transformers'
    bf16 bits; on a CPU whose vector width is unknown (lanes 0) the op runs the ATen ops themselves."""
    torch.manual_seed(features)
    norm = LlamaRMSNorm(features, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(features) * 0.5 + 1).to(torch.bfloat16)
    for scale in (0.01, 1.0, 30.0):
        x = (torch.randn(1, 23, features) * scale * torch.rand(1, 23, 1) * 3).to(torch.bfloat16)
        for lanes in {native_forward.lanes(), 0}:
            assert torch.equal(torch.ops.decoding_lab.rms_norm(x, norm.weight, 1e-5, lanes), norm(x))


def test_the_rotary_loop_equals_apply_rotary_pos_emb() -> None:
    """Head dims whose half is a multiple of 16 (the AVX-512 loop where the CPU has it) and not (the scalar loop);
    signed zeros and large values among the inputs."""
    torch.manual_seed(1)
    for tokens, dim in ((1, 64), (6, 64), (3, 32), (2, 16), (2, 24)):
        states = torch.randn(1, 12, tokens, dim) * torch.randint(0, 3, (1, 12, tokens, dim)) * 1e3 ** torch.rand(1)
        states = torch.where(torch.rand_like(states) < 0.1, -0.0, states).to(torch.bfloat16)
        cos, sin = torch.randn(1, tokens, dim).to(torch.bfloat16), torch.randn(1, tokens, dim).to(torch.bfloat16)
        expected = states * cos.unsqueeze(1) + rotate_half(states) * sin.unsqueeze(1)
        rotated = torch.ops.decoding_lab.rotary(states, cos, sin, native_forward.lanes())
        assert torch.equal(rotated.view(torch.int16), expected.view(torch.int16))  # the bits: signed zeros too


def test_the_norms_sum_is_atens_float_sum() -> None:
    """The op's emulation of ATen's cascade sum gives torch.sum's float, row by row (lengths below, at and far
    above the vector width; the width is the one lab.engine.native_forward found on this CPU)."""
    lanes = native_forward.lanes()
    if lanes == 0:  # no width found: the op runs ATen's own ops for the norms (tested above with lanes 0)
        pytest.skip("ATen's sum width is not one the op emulates on this CPU")
    generator = torch.Generator().manual_seed(3)
    for features in (3, 8, 15, 64, 576, 1000, 1536, 40000):
        for scale in (1e-3, 1.0, 1e3):
            x = (torch.randn(5, features, generator=generator) * scale).pow(2)
            assert torch.equal(torch.ops.decoding_lab.row_sums(x, lanes), x.sum(-1))


def _cache_script(loaded, native: bool, monkeypatch) -> tuple[list, list]:
    """Logits of a run that steps, crops back, verifies a chain and steps again on one cache, and of a deep copy of
    the cache stepped on its own; the final caches of both."""
    monkeypatch.setenv(native_forward.SWITCH, "1" if native else "0")
    logits = []
    state, out = runtime.prefill(loaded, [3, 9, 27, 81, 5])
    logits.append(out.logits)
    for token in (7, 8, 9, 10):
        logits.append(runtime.decode_step(state, token).logits)
    runtime.crop(state, state.length - 3)  # the next forwards write over cropped positions
    with rows_invariant(loaded):
        logits.append(runtime.verify(state, [21, 22]).logits)
    copied = runtime.DecodeState(loaded, copy.deepcopy(state.cache))
    for token in (31, 32):
        logits.append(runtime.decode_step(state, token).logits)
    for token in (41, 42, 43):  # the copy's own positions, where the original wrote 31, 32
        logits.append(runtime.decode_step(copied, token).logits)
    return logits, [state.cache, copied.cache]


@pytest.mark.parametrize("precision", ["bf16", "w4a8"])
def test_the_cache_grows_in_place(precision, monkeypatch, op_calls) -> None:
    """The op writes a forward's keys and values after the cached ones in the cache's own buffer when it has room
    (decoder_layers.cpp's extend_cache): the same logits and caches as the Python loop's concatenation, through
    crops (new positions over cropped ones) and a deep copy of the cache stepped on its own."""
    model = tiny_llama(5, layers=3, hidden=128).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    native, native_caches = _cache_script(loaded, True, monkeypatch)
    assert op_calls == [1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    python, python_caches = _cache_script(loaded, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(native, python, strict=True))
    for native_cache, python_cache in zip(native_caches, python_caches, strict=True):
        for a, b in zip(native_cache.layers, python_cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # one buffer per layer and tensor, extended in place: a step leaves its storage where it was
    state, _ = runtime.prefill(loaded, [3, 9, 27])
    monkeypatch.setenv(native_forward.SWITCH, "1")
    runtime.decode_step(state, 4)
    first = [layer.keys.data_ptr() for layer in state.cache.layers]
    assert not state.cache.layers[0].keys.is_contiguous()  # a view of the first positions of a longer buffer
    runtime.decode_step(state, 5)
    assert [layer.keys.data_ptr() for layer in state.cache.layers] == first


def _steps_alone_and_together(loaded, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Greedy continuations of `prompts`, each sequence stepping alone, and all in one batch of decode steps:
    (per sequence, per step logits) both ways."""
    alone = []
    for prompt in prompts:
        state, out = runtime.prefill(loaded, prompt)
        logits = [out.logits[-1]]
        for _ in range(steps):
            logits.append(runtime.decode_step(state, int(logits[-1].argmax())).logits[0])
        alone.append(logits)
    together = [[] for _ in prompts]
    states = []
    for row, prompt in enumerate(prompts):
        state, out = runtime.prefill(loaded, prompt)
        states.append(state)
        together[row].append(out.logits[-1])
    for _ in range(steps):
        logits = runtime.decode_steps(states, [int(rows[-1].argmax()) for rows in together])
        for row, rows in enumerate(together):
            rows.append(logits[row])
    return alone, together


@pytest.mark.parametrize("precision,hidden", [("bf16", 64), ("int8", 64), ("int4", 64), ("int4", 128), ("w4a8", 128)])
def test_a_batch_of_decode_steps_equals_each_sequence_alone(precision, hidden, op_sequences) -> None:
    """`runtime.decode_steps`: B sequences of different lengths, each at its own position, one op call per step;
    every row's logits are bit for bit its own decode step's (the products over B rows are row-invariant)."""
    model = tiny_llama(5, layers=3, hidden=hidden).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    prompts = [[3, 9, 27, 81], [5], [7, 7, 7, 7, 7, 7, 7, 7, 7], [11, 13]]
    alone, together = _steps_alone_and_together(loaded, prompts, steps=6)
    for a, b in zip(alone, together, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert op_sequences.count(4) == 6  # one call per batched step


def test_a_batch_of_decode_steps_on_the_embedded_model(op_sequences) -> None:
    loaded = load_model("smollm2-135m", device="cpu", dtype="bfloat16", precision="int4")
    prompts = [loaded.encode(text, chat=True) for text in ("Name a colour.", "What is 2 + 3? Answer briefly.")]
    alone, together = _steps_alone_and_together(loaded, prompts, steps=5)
    for a, b in zip(alone, together, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert op_sequences.count(2) == 5


def test_decode_steps_without_the_op_step_each_sequence(monkeypatch) -> None:
    """float32 (the op runs bf16 / fp16 only): the same logits, one forward per sequence."""
    loaded = wrap_model(tiny_llama(5, layers=2), ByteTokenizer())
    alone, together = _steps_alone_and_together(loaded, [[3, 4, 5], [6]], steps=3)
    for a, b in zip(alone, together, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="one token per sequence"):
        runtime.decode_steps([], [])


def _draft_heads(precision: str) -> dict:
    """The EAGLE-1 and EAGLE-3 heads (random weights) of a bf16 tiny target at `precision`, served as
    lab.heads.eagle.serving_head serves them (low-bit linears: the op's draft_layer takes them)."""
    model = tiny_llama(3, layers=8, hidden=64).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    target = wrap_model(model, ByteTokenizer())
    torch.manual_seed(0)
    draft_vocab = torch.sort(torch.randperm(256)[:48]).values
    eagle3 = build_eagle3(head_config(model.config, 48), model.get_input_embeddings())
    for name, value in zip(("d2t", "t2d"), vocab_maps(draft_vocab, 256), strict=True):
        getattr(eagle3, name).copy_(value)
    eagle1 = build_head(target, draft_vocab)
    with torch.no_grad():  # the layer's weights away from the identity init, so the test sees the attention
        for parameter in eagle1.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter.float()).to(parameter.dtype))
    heads = {"eagle1": eagle1, "eagle3": eagle3.to(torch.bfloat16).eval()}
    return {kind: serving_head(head, target) for kind, head in heads.items()}


def _drafting(head, width: int, native: bool, monkeypatch):
    """A head's drafting calls as lab.speculative.proposers.eagle makes them: the prompt's pairs, two committed
    pairs, a tree step of three nodes (two siblings and a child); returns their outputs and the cache."""
    monkeypatch.setenv(native_forward.SWITCH, "1" if native else "0")
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(9, width, generator=generator).to(torch.bfloat16)
    own = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    cache = EagleCache(head)
    outputs = [cache.extend(features[:6], [5, 9, 2, 7, 1, 3], 0)]
    outputs.append(cache.extend(features[6:8], [4, 8], 6))
    outputs.append(cache.tree_step(own, [11, 12, 13], [8, 8, 9], [0, 1, 2], [set(), set(), {0}]))
    return outputs, cache.cache.layers[0]


@pytest.mark.parametrize("precision", ["w4a8", "int4"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_draft_heads_layer_runs_as_one_call(kind, precision, monkeypatch) -> None:
    """A served draft head's layer (EAGLE-1's, EAGLE-3's `midlayer`) takes the op's draft_layer after the prompt:
    its keys and values are the Python layer's bit for bit (the same products and rotary embedding), its outputs
    the Python layer's up to the attention's rounding (the op's exact float64 attention where the Python layer
    runs SDPA); a float head, and every head with the switch off, keep the Python layer."""
    head = _draft_heads(precision)[kind]
    width = head.fc.in_features if kind == "eagle3" else 64
    calls: list[int] = []
    real = torch.ops.decoding_lab.draft_layer
    monkeypatch.setattr(torch.ops.decoding_lab, "draft_layer", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    native, native_kv = _drafting(head, width, True, monkeypatch)
    assert calls == [2, 3]  # the prompt's pairs fill the empty cache in Python (as a target's prefill)
    python, python_kv = _drafting(head, width, False, monkeypatch)
    assert calls == [2, 3]
    assert torch.equal(native_kv.keys, python_kv.keys) and torch.equal(native_kv.values, python_kv.values)
    for a, b in zip(native, python, strict=True):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=0.02 * b.float().abs().max().item())
    bf16 = wrap_model(tiny_llama(3, layers=8, hidden=64).to(torch.bfloat16), ByteTokenizer())
    _drafting(build_head(bf16, torch.arange(48)), 64, True, monkeypatch)  # float linears: the Python layer
    assert calls == [2, 3]
