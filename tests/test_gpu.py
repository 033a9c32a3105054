"""Exactness and device checks on CUDA (`make gpu-check`; skipped without a GPU).

On the GPU the lab must decode exactly as on the CPU: in fp32, greedy equals `model.generate` and greedy
speculative decoding (prompt lookup, self-draft, a draft model) equals greedy, token for token; with the automatic
dtype the model runs in bf16 on CUDA; a seeded sampler repeats itself with a CUDA generator. The device comes from
DECODING_LAB_TEST_DEVICE (default cuda), so `DECODING_LAB_TEST_DEVICE=cpu pytest -m gpu` runs the same checks on the
CPU (that is how the test code itself is checked on machines without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.app.runner import make_generator
from lab.engine.models import load_model, resolve_device, resolve_dtype
from lab.params import build_params
from lab.trace import RunFinished, TokenEmitted
from strategies import collect, get_strategy

DEVICE = os.environ.get("DECODING_LAB_TEST_DEVICE", "cuda")
PROMPTS = [p.text for p in BUILTIN_PROMPTS[::6]]  # 4 prompts from different categories
TOKENS = 32
DRAFTERS = [
    {"drafter": "prompt-lookup"},
    {"drafter": "self-draft", "draft_layers": 8, "gamma": 3},
    {"drafter": "model", "draft_model": "smollm2-135m", "gamma": 4},
]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.embedded,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())"
    ),
]


def run(loaded, name: str, prompt_ids: list[int], seed: int = 0, **values) -> list:
    strategy = get_strategy(name)
    params = build_params(strategy.Params, {"max_new_tokens": TOKENS, **values})
    return collect(strategy.run(loaded, prompt_ids, params, make_generator(seed, loaded.device)))


def token_ids(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


@pytest.fixture(scope="module")
def fp32():
    return load_model("smollm2-135m", device=DEVICE, dtype="float32")


@pytest.fixture(scope="module")
def greedy_ids(fp32) -> dict[str, list[int]]:
    return {text: token_ids(run(fp32, "greedy", fp32.encode(text))) for text in PROMPTS}


def test_model_lives_on_the_device(fp32):
    assert fp32.device.type == DEVICE
    assert {p.device.type for p in fp32.model.parameters()} == {DEVICE}


@pytest.mark.skipif(DEVICE != "cuda", reason="device auto-detection and bf16 are CUDA facts")
def test_auto_picks_cuda_and_bf16():
    device = resolve_device("auto")
    assert device.type == "cuda" and resolve_dtype("auto", device) == torch.bfloat16


def test_greedy_equals_generate(fp32, greedy_ids):
    for text, expected in greedy_ids.items():
        prompt_ids = fp32.encode(text)
        with torch.inference_mode():
            output = fp32.model.generate(
                torch.tensor([prompt_ids], device=fp32.device), do_sample=False, max_new_tokens=TOKENS
            )
        assert expected == output[0, len(prompt_ids) :].tolist(), text


@pytest.mark.parametrize("values", DRAFTERS, ids=[d["drafter"] for d in DRAFTERS])
def test_greedy_speculative_equals_greedy(fp32, greedy_ids, values):
    for text, expected in greedy_ids.items():
        events = run(fp32, "speculative", fp32.encode(text), **values)
        assert token_ids(events) == expected, text
        assert isinstance(events[-1], RunFinished)


def test_auto_dtype_run_streams_tokens():
    loaded = load_model("smollm2-135m", device=DEVICE, dtype="auto")
    assert loaded.dtype == resolve_dtype("auto", torch.device(DEVICE))
    events = run(loaded, "greedy", loaded.encode(PROMPTS[0]))
    assert len(token_ids(events)) == TOKENS or events[-1].stop_reason == "eos"


def test_seeded_sampling_repeats_on_the_device(fp32):
    prompt_ids = fp32.encode(PROMPTS[1])
    first = token_ids(run(fp32, "sample", prompt_ids, seed=7, temperature=0.9))
    again = token_ids(run(fp32, "sample", prompt_ids, seed=7, temperature=0.9))
    assert first == again and first
