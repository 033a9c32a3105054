"""Batched distillation (one pass captures rows + EAGLE-3 features), Magpie prompt filters and the check that keeps
machine-written prompts away from the benchmark prompts (tiny random model; pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.engine import forward_path, native_forward, runtime
from lab.engine.models import wrap_model
from lab.engine.quant import quantize_model
from lab.params import InputError
from lab.training.distill.batched import Capture, decode_batch
from lab.training.distill.dataset import load_distill
from lab.training.distill.generate import DistillSettings, eagle3_layers, run_distill
from lab.training.distill.prompt_filter import PromptPool, near_benchmark, normalise, reject_reason
from lab.training.distill.prompts import distill_prompts
from tests.tiny import ByteTokenizer, tiny_llama

BENCH = [p.text for p in BUILTIN_PROMPTS]


def test_batched_rows_equal_a_fresh_forward_per_sequence(tiny) -> None:
    # prompts of different lengths (left padding); rows stop at their own EOS (id 0) or at the length limit
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    generator = torch.Generator().manual_seed(3)
    decoded = decode_batch(tiny, prompts, 12, 1.5, generator, Capture(top_k=4, layers=(1, 2)), stop_ids=(0, 40))
    for prompt, d in zip(prompts, decoded, strict=True):
        n = len(d.response)
        assert 1 <= n <= 12 and all(t not in (0, 40) for t in d.response[:-1])
        assert n == 12 or d.response[-1] in (0, 40)
        with torch.no_grad():
            out = tiny.model(input_ids=torch.tensor([prompt + d.response]), output_hidden_states=True)
        span = slice(len(prompt) - 1, len(prompt) + n - 1)
        assert d.tensors["hidden"].shape == (n, 64)
        assert torch.allclose(d.tensors["hidden"].float(), out.hidden_states[-1][0, span], atol=2e-2)
        for layer in (1, 2):
            assert torch.allclose(d.tensors[f"hidden.{layer}"].float(), out.hidden_states[layer][0, span], atol=2e-2)
        top = torch.softmax(out.logits[0, span], -1).topk(4)
        assert d.tensors["topk_ids"].tolist() == top.indices.tolist()
        assert torch.allclose(d.tensors["topk_probs"].float(), top.values, atol=2e-3)


def test_greedy_batch_equals_each_prompt_alone(tiny) -> None:
    prompts = [[5, 6, 7, 8, 9], [12, 13], [20, 21, 22]]
    together = decode_batch(tiny, prompts, 10)
    alone = [decode_batch(tiny, [p], 10)[0] for p in prompts]
    assert [d.response for d in together] == [d.response for d in alone]
    two_at_a_time = decode_batch(tiny, prompts, 10, width=2)  # float32: the padded batch, in chunks of two
    assert [d.response for d in two_at_a_time] == [d.response for d in alone]


def test_padded_rows_keep_their_own_temperature_when_others_finish(tiny) -> None:
    # row 0 is greedy and stops at its first token; the sampled row 1 goes on with its own temperature
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    first = decode_batch(tiny, prompts[:1], 1)[0].response[0]
    generator = torch.Generator().manual_seed(0)
    decoded = decode_batch(tiny, prompts, 8, [0.0, 1.5], generator, stop_ids=(first,), path="padded")
    assert decoded[0].response == [first]
    assert 1 <= len(decoded[1].response) <= 8


def _greedy_alone(loaded, prompt: list[int], limit: int, stop: set[int]) -> list[int]:
    """The lab's own greedy decoding of one prompt (prefill, then one decode step per token)."""
    state, out = runtime.prefill(loaded, prompt)
    tokens = [int(out.logits[-1].argmax())]
    while len(tokens) < limit and tokens[-1] not in stop:
        tokens.append(int(runtime.decode_step(state, tokens[-1]).logits[0].argmax()))
    return tokens


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_unpadded_batches_on_the_native_path_are_the_labs_own_greedy(precision, monkeypatch) -> None:
    """bf16 models on the CPU take the op: without capture, decode_batch steps the sequences together unpadded,
    and each greedy response is exactly the lab's greedy decoding of its prompt; repeated prompts (Magpie) share
    one prefill and still sample independently."""
    if not native_forward.build():
        pytest.skip("no C++ compiler: the op is not built (tests/test_native_forward.py says whether it must be)")
    model = tiny_llama(7, layers=2).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    assert forward_path.choose(loaded, wait=True).native
    steps: list[int] = []
    real = runtime.decode_steps
    monkeypatch.setattr(runtime, "decode_steps", lambda states, ids: steps.append(len(states)) or real(states, ids))
    prompts = [[5, 6, 7, 8, 9], [12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    stop = (0, 40)
    decoded = decode_batch(loaded, prompts, 14, stop_ids=stop)
    assert [d.response for d in decoded] == [_greedy_alone(loaded, p, 14, set(stop)) for p in prompts]
    assert steps and steps[0] == 3  # one forward per step for all running sequences
    steps.clear()
    narrow = decode_batch(loaded, prompts, 14, stop_ids=stop, width=2)  # the third starts when one ends
    assert [d.response for d in narrow] == [d.response for d in decoded] and max(steps) == 2
    mixed = decode_batch(loaded, prompts, 14, [0.0, 1.5, 0.0], torch.Generator().manual_seed(2), stop_ids=stop)
    assert [mixed[0].response, mixed[2].response] == [decoded[0].response, decoded[2].response]
    generator = torch.Generator().manual_seed(1)
    sampled = decode_batch(loaded, [[5, 6, 7]] * 4, 10, 1.5, generator, stop_ids=stop)
    assert len({tuple(d.response) for d in sampled}) > 1
    padded = decode_batch(loaded, prompts, 4, stop_ids=stop, path="padded")
    assert all(1 <= len(d.response) <= 4 for d in padded)
    with pytest.raises(ValueError, match="auto or padded"):
        decode_batch(loaded, prompts, 4, path="fast")
    with pytest.raises(ValueError, match="2 temperatures for 3 prompts"):
        decode_batch(loaded, prompts, 4, [0.0, 1.0])
    with pytest.raises(ValueError, match="width must be at least 1"):
        decode_batch(loaded, prompts, 4, width=0)


def test_the_folder_stores_eagle3_features_and_old_readers_still_work(tiny, tmp_path: Path) -> None:
    settings = DistillSettings("tiny", max_new_tokens=6, batch_size=2, limit=3, layers=(1, 2))
    run_distill(tiny, settings, tmp_path, lambda *_: None)
    data = load_distill(tmp_path, layers=(1, 2))
    assert set(data.features) == {1, 2} and data.features[1].shape == data.hidden.shape
    assert load_distill(tmp_path).features == {}  # not read unless asked for
    with pytest.raises(InputError, match="hidden.0"):
        load_distill(tmp_path, layers=(0,))
    assert eagle3_layers(30) == (2, 15, 27)


def test_held_out_split_is_by_prompt(tiny, tmp_path: Path) -> None:
    run_distill(tiny, DistillSettings("tiny", max_new_tokens=4, batch_size=4, limit=40, samples=1), tmp_path, print)
    data = load_distill(tmp_path)
    held = data.held_out(every=4)
    assert 0 < int(held.sum()) < data.rows
    for key in torch.unique(data.prompt).tolist():
        rows = data.prompt == key
        assert len(torch.unique(data.sequence[rows])) == 2  # the greedy and the sampled response
        assert bool(held[rows].all()) or not bool(held[rows].any())


def test_filters_drop_bad_candidates() -> None:
    assert reject_reason("What are three ways to keep a small garden healthy in summer?") is None
    assert reject_reason("Hi") == "length"
    assert reject_reason("Что такое фотосинтез и почему он важен для жизни?") == "language"
    assert reject_reason("the cat the cat the cat the cat the cat the cat") == "degenerate"
    assert reject_reason("Tell me<|im_end|> a story about the sea please") == "degenerate"


def test_the_pool_drops_duplicates_near_duplicates_and_benchmark_prompts() -> None:
    handwritten = [text for _, text in distill_prompts()]
    pool = PromptPool(BENCH, handwritten)
    candidates = [
        "How do volcanoes form and why do some of them erupt violently?",
        "how do volcanoes form, and why do some of them erupt violently",  # same after normalisation
        "How do volcanoes form and why do some of them erupt so violently today?",  # near duplicate
        "Why is the sky blue? Explain it simply.",  # a benchmark prompt
        "Please answer this: Why is the sky blue? Explain it simply, for a child.",  # one quoted inside
        "What is 15 percent of 240? Show the steps.",
        handwritten[0],  # already in the hand-written source
        "Write a short story about a dragon who is afraid of the dark.",
    ]
    kept = pool.select(candidates)
    assert kept == [candidates[0], candidates[-1]]
    assert pool.reasons == {"duplicate": 3, "near benchmark": 3}
    assert not any(near_benchmark(text, BENCH) for text in kept)
    assert normalise(" Hello,  World! ") == "hello world"


def test_magpie_settings_are_checked() -> None:
    with pytest.raises(InputError, match="magpie"):
        DistillSettings("tiny", prompts="magpie").check()
    with pytest.raises(InputError, match="magpie"):
        DistillSettings("tiny", magpie_chunks=3).check()
