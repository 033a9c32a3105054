"""Weight-only low-bit linears (lab.engine.quant): GGUF Q4_1 parsing, kernel exactness against the dequantized matrix,
model surgery (tied embeddings keep working), precision resolution, and losslessness at every precision: greedy
of each lossless method equals greedy at that precision on tiny random Llamas. The embedded part checks that
int4 holds exactly the GGUF file's weights and that greedy decoding works at int8 and int4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.engine.models import LoadedModel, wrap_model
from lab.engine.quant import (
    GROUP,
    Int4Linear,
    Int8Linear,
    W4A8Linear,
    W8A8Linear,
    permute_rows_like_hf,
    precision_of,
    q4_from_gguf_blocks,
    q4_from_weight,
    quantize_activations,
    quantized_copy,
    resolve_precision,
)
from lab.heads.common import model_shape, save_heads
from lab.heads.eagle import build_head, head_tensors
from lab.heads.mtpc import init_tensors
from lab.params import InputError, build_params
from lab.tools.bench import build_requests
from lab.tools.bench_reference import LlamaCppRow
from lab.tools.cli import main
from lab.trace import TokenEmitted, Trace, from_json, to_json
from strategies import collect, get_strategy
from tests.tiny import ByteTokenizer, tiny_llama, tiny_loaded_model

pytestmark = pytest.mark.usefixtures("one_thread")
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def tokens(loaded: LoadedModel, name: str, prompt: list[int], **values) -> list[int]:
    strategy = get_strategy(name)
    params = build_params(strategy.Params, {"max_new_tokens": 30, **values})
    events = collect(strategy.run(loaded, prompt, params, torch.Generator().manual_seed(0)))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def test_q4_1_blocks_parse_as_ggml_lays_them_out() -> None:
    """block_q4_1 = fp16 d, fp16 m, 16 bytes: element j is the low nibble of byte j, element j + 16 its high one."""
    rng = np.random.default_rng(0)
    n, k = 3, 64
    q = rng.integers(0, 16, size=(n, k // GROUP, GROUP))
    d = rng.random((n, k // GROUP)).astype(np.float16)
    m = (-rng.random((n, k // GROUP))).astype(np.float16)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], axis=-1).reshape(n, -1)
    groups = q4_from_gguf_blocks(raw, n, k)
    expected = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
    assert torch.equal(groups.dequantize(), torch.from_numpy(expected.reshape(n, k).astype(np.float32)))


def test_q4_quantization_is_within_half_a_step_and_the_permutation_is_a_row_shuffle() -> None:
    weight = torch.randn(32, 96)
    groups = q4_from_weight(weight)
    error = (groups.dequantize() - weight).abs().reshape(32, 3, GROUP)
    assert int(groups.q.min()) == 0 and int(groups.q.max()) == 15
    assert bool((error <= groups.d[..., None] / 2 + 1e-6).all())
    permuted = permute_rows_like_hf(groups, heads=2)
    rows = permuted.dequantize()
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, groups.dequantize().tolist()))
    assert torch.equal(rows[1], groups.dequantize()[2])  # [head, 8, 2] read as [head, 2, 8]: row 1 <- row 2


def _low_bit(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Module:
    if kind == "int8":
        return Int8Linear(weight, bias, dtype)
    return {"int4": Int4Linear, "w4a8": W4A8Linear}[kind](q4_from_weight(weight), bias, dtype)


@pytest.mark.parametrize("kind", ["int8", "int4", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_bit_linears_compute_x_times_their_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    module = _low_bit(kind, weight, bias, dtype)
    x = torch.randn(2, 5, 64).to(dtype)  # [B, T, K]
    inputs = x.float()
    if kind == "w4a8":  # its activations are rounded to 8-bit blocks too: x_hat = d q
        q, d, _ = quantize_activations(x.reshape(10, 64))
        inputs = (q * d[..., None]).reshape(2, 5, 64)
    expected = F.linear(inputs, module.weight.float(), bias.to(dtype).float())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    out = module(x)
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    assert torch.allclose(out.float(), expected, atol=tolerance, rtol=0.02)
    assert (module.weight.float() - weight).abs().max() < (0.05 if kind == "int8" else 0.5)


@pytest.mark.parametrize("kind", ["int8", "int4", "w4a8"])
def test_low_bit_rows_do_not_depend_on_how_many_rows_there_are(kind: str) -> None:
    """lab.engine.invariance's contract for linears in bf16: a verify row equals the one-row decode product bit for
    bit."""
    torch.manual_seed(1)
    weight = torch.randn(1536, 576) * 0.02
    dtype = torch.bfloat16
    module = _low_bit(kind, weight, None, dtype)
    x = torch.randn(17, 576).to(dtype)
    with torch.inference_mode():
        singles = torch.cat([module(x[i : i + 1]) for i in range(17)])
        for rows in (2, 5, 8, 17):
            assert torch.equal(module(x[:rows]), singles[:rows]), rows


def test_quantized_copy_replaces_the_linears_and_keeps_a_tied_embedding() -> None:
    model = tiny_llama(seed=3)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    loaded = wrap_model(model, ByteTokenizer(), "tiny-tied")
    embedding = model.model.embed_tokens.weight.detach().clone()
    for precision, layer_kind, head_kind in (
        ("int8", Int8Linear, Int8Linear),
        ("int4", Int4Linear, Int8Linear),
        ("w4a8", W4A8Linear, W8A8Linear),
    ):
        quantized = quantized_copy(loaded, precision)
        q = quantized.model
        assert precision_of(q) == precision == quantized.precision and quantized.vocab_size == loaded.vocab_size
        assert isinstance(q.model.layers[0].mlp.down_proj, layer_kind) and type(q.lm_head) is head_kind
        assert torch.equal(q.model.embed_tokens.weight, embedding)  # the lookup keeps the float rows
        prompt = [5, 9, 77, 3]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            full, low = model(ids).logits, q(ids).logits  # [1, T, V]
        assert 0 < (full - low).abs().max() < 0.5  # quantized (not identical), and close
        assert len(tokens(quantized, "greedy", prompt, max_new_tokens=8)) == 8
    assert precision_of(model) == "bf16"  # the original is untouched


def test_resolve_precision_chooses_auto_on_cpu_and_refuses_low_bit_on_gpus() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("int8", cpu, torch.float32) == "int8"
    assert resolve_precision("auto", cpu, torch.bfloat16) in ("bf16", "int4", "w4a8")
    assert resolve_precision("auto", torch.device("cuda"), torch.bfloat16) == "bf16"
    with pytest.raises(ValueError, match="CPU kernels"):
        resolve_precision("int4", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="Unknown precision"):
        resolve_precision("int3", cpu, torch.float32)


def _random_heads(loaded: LoadedModel, directory) -> dict[str, str]:
    """Random Medusa, MTPC and EAGLE heads for `loaded`, saved where the strategies load them from."""
    hidden, vocab = int(loaded.config.hidden_size), loaded.vocab_size
    shape, generator = model_shape(loaded), torch.Generator().manual_seed(1)
    medusa = {"blocks.weight": 0.05 * torch.randn(4, hidden, hidden, generator=generator)}
    medusa |= {"blocks.bias": torch.zeros(4, hidden), "vocab": torch.arange(vocab)}
    mtpc = init_tensors(3, 3, 4, hidden, seed=0)
    for name in ("blocks.weight", "adapters.up", "mix.weight"):
        mtpc[name] = 0.3 * torch.randn(mtpc[name].shape, generator=generator)
    mtpc["vocab"] = torch.arange(vocab)
    torch.manual_seed(1)
    eagle = head_tensors(build_head(loaded, torch.arange(vocab)))
    paths = {}
    for kind, tensors in (("medusa", medusa), ("mtpc", mtpc), ("eagle", eagle)):
        stem = directory / f"{loaded.precision}-{kind}"
        save_heads(stem, tensors, {"kind": kind, "model_shape": shape, "choices": CHOICES})
        paths[kind] = str(stem)
    return paths


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "w4a8"])
def test_every_lossless_method_equals_greedy_at_each_precision(precision: str, tmp_path) -> None:
    loaded = quantized_copy(tiny_loaded_model(seed=0), precision)
    assert loaded.precision == precision
    prompt = list(b"The lab decodes the lab decodes the")
    expected = tokens(loaded, "greedy", prompt)
    heads = _random_heads(loaded, tmp_path)
    runs = {
        "speculative lookup": ("speculative", {"drafter": "prompt-lookup"}),
        "speculative self-draft": ("speculative", {"drafter": "self-draft", "draft_layers": 1, "gamma": 3}),
        "ssd self-draft": ("ssd", {"drafter": "self-draft", "draft_layers": 1}),
        "medusa": ("medusa", {"mode": "greedy", "heads_path": heads["medusa"], "tree_nodes": 9}),
        "mtpc": ("mtpc", {"mode": "greedy", "heads_path": heads["mtpc"], "tree_nodes": 9}),
        "eagle": ("eagle", {"heads_path": heads["eagle"]}),
    }
    for label, (name, values) in runs.items():
        assert tokens(loaded, name, prompt, **values) == expected, label
    assert len(set(expected)) > 1


@pytest.mark.embedded
def test_embedded_int4_holds_the_gguf_weights_and_decodes(embedded) -> None:
    from lab.engine.models import load_model

    int4 = load_model("smollm2-135m", device="cpu", dtype="float32", precision="int4")
    assert int4.precision == "int4" and isinstance(int4.lm_head, Int8Linear)
    for index in (0, 17, 29):
        reference, layer = embedded.model.model.layers[index], int4.model.model.layers[index]
        for parent in ("self_attn", "mlp"):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                module = getattr(getattr(layer, parent), name, None)
                if module is None:
                    continue
                assert isinstance(module, Int4Linear)
                expected = getattr(getattr(reference, parent), name).weight
                assert torch.equal(module.weight, expected), (index, name)  # the file's blocks, exactly
    prompt = int4.encode("Name three primary colours.")
    greedy = tokens(int4, "greedy", prompt, max_new_tokens=24)
    assert len(set(greedy)) > 1 and tokens(int4, "speculative", prompt, max_new_tokens=24) == greedy
    for name in ("eagle", "medusa"):  # the shipped heads read the int4 target's hidden states
        assert tokens(int4, name, prompt, max_new_tokens=24) == greedy, name


@pytest.mark.embedded
def test_embedded_w4a8_head_holds_the_files_q8_0_blocks(embedded) -> None:
    """At w4a8 the LM head is the GGUF's own Q8_0 token embedding (tied): d q equals the float model's head exactly."""
    from lab.engine.models import load_model

    w4a8 = load_model("smollm2-135m", device="cpu", dtype="float32", precision="w4a8")
    assert type(w4a8.lm_head) is W8A8Linear and w4a8.vocab_size == embedded.vocab_size
    assert torch.equal(w4a8.lm_head.weight, embedded.lm_head.weight)


def test_bench_rows_carry_their_precision_and_bad_names_are_refused() -> None:
    rows = ["greedy", "greedy@int4", "speculative@int8"]
    options = ("smollm2-135m", "cpu", "float32")
    requests = build_requests(rows, ["hi"], 4, 0, *options, {"speculative": {"gamma": "3"}}, precision="bf16")
    assert [r[0].precision for r in requests.values()] == ["bf16", "int4", "int8"]
    assert requests["speculative@int8"][0].params.gamma == 3 and requests["greedy@int4"][0].strategy.name == "greedy"
    with pytest.raises(InputError, match="Unknown precision"):
        build_requests(["greedy@int3"], ["hi"], 4, 0, *options)
    assert main(["run", "--strategy", "greedy", "--prompt", "hi", "--precision", "int3"]) == 2


def test_traces_record_dtype_and_precision_and_old_traces_still_load() -> None:
    trace = Trace("greedy", "smollm2-135m", "hi", {"max_new_tokens": 1}, [])
    trace.dtype, trace.precision = "bfloat16", "int4"
    loaded = from_json(to_json(trace))
    assert (loaded.dtype, loaded.precision) == ("bfloat16", "int4")
    trace.dtype = trace.precision = ""
    assert "precision" not in to_json(trace) and from_json(to_json(trace)).precision == ""


def test_llama_cpp_row_says_how_to_get_it_or_needs_a_gguf() -> None:
    import importlib.util

    tiny = tiny_loaded_model(seed=0)
    expected = "make bench-deps" if importlib.util.find_spec("llama_cpp") is None else "needs a GGUF"
    with pytest.raises(InputError, match=expected):
        LlamaCppRow(tiny, 64)


@pytest.mark.embedded
def test_embedded_llama_cpp_row_decodes_the_same_gguf(embedded) -> None:
    pytest.importorskip("llama_cpp", reason="optional: make bench-deps")
    row = LlamaCppRow(embedded, 256)
    prompt = embedded.encode("Name three primary colours.")
    first, again = row.time(prompt, 16), row.time(prompt, 16)
    assert first.new_tokens == 16 or first.stop_reason == "eos"
    assert first.token_ids == again.token_ids  # greedy, and the cache reset between runs
    assert first.token_ids[0] == tokens(embedded, "greedy", prompt, max_new_tokens=1)[0]
