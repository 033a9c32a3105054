"""Request validation in one place: every bad input is an InputError whose message names what was wrong."""

from __future__ import annotations

import pytest

from lab.app.validation import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    check_prompt_fits,
    validate_model_spec,
    validate_prompt,
    validate_request,
    validate_seed,
)
from lab.params import InputError
from strategies.greedy import GreedyParams
from strategies.sample import SampleParams


def test_valid_request() -> None:
    request = validate_request(
        "sample", "Tell me a story.", {"temperature": "0.5"}, seed="42", model=" smollm2-135m ", device="cpu"
    )
    assert request.strategy.name == "sample"
    assert request.params == SampleParams(temperature=0.5)
    assert request.prompt == "Tell me a story."
    assert request.seed == 42
    assert request.model == "smollm2-135m"
    assert (request.device, request.dtype, request.chat) == ("cpu", "auto", True)


def test_defaults() -> None:
    request = validate_request("greedy", "Hi")
    assert request.params == GreedyParams()
    assert (request.seed, request.model, request.device, request.dtype) == (0, "smollm2-135m", "auto", "auto")


@pytest.mark.parametrize("prompt", ["", " ", "\n\t  \n", "\u3000"])
def test_empty_or_whitespace_prompt(prompt: str) -> None:
    with pytest.raises(InputError, match="prompt is empty"):
        validate_request("greedy", prompt)


@pytest.mark.parametrize(
    "strategy, params, needs",
    [
        ("greedy", {}, "something for the model to continue"),
        ("tot", {}, "whole numbers, the Game of 24 hand (such as 4 9 10 13)"),
        ("tot", {"task": "creative"}, "the sentences (or the topic) to write about"),
        ("rlm", {}, "a question about the generated document"),
        ("rlm", {"task": "pasted"}, "a question about the text pasted in context_text"),
    ],
)
def test_an_empty_prompt_is_told_what_the_method_needs(strategy: str, params: dict, needs: str) -> None:
    with pytest.raises(InputError, match="prompt is empty") as refused:
        validate_request(strategy, "  ", params)
    assert needs in str(refused.value)


@pytest.mark.parametrize("prompt", [None, 5, ["hi"], b"hi"])
def test_non_text_prompt(prompt: object) -> None:
    with pytest.raises(InputError, match="prompt"):
        validate_request("greedy", prompt)


def test_prompt_length_limit() -> None:
    assert validate_prompt("a" * MAX_PROMPT_CHARS) == "a" * MAX_PROMPT_CHARS
    with pytest.raises(InputError, match=f"{MAX_PROMPT_CHARS + 1} characters.*{MAX_PROMPT_CHARS}"):
        validate_request("greedy", "a" * (MAX_PROMPT_CHARS + 1))
    with pytest.raises(InputError, match="limit"):
        validate_request("greedy", " " * (MAX_PROMPT_CHARS + 1))  # too long is reported before empty


@pytest.mark.parametrize("name", ["nope", "", "Greedy", "greedy ", "../greedy", "__init__"])
def test_unknown_strategy(name: str) -> None:
    with pytest.raises(InputError, match="Unknown strategy") as info:
        validate_request(name, "Hi")
    assert repr(name) in str(info.value)
    assert "greedy" in str(info.value) and "sample" in str(info.value)  # the known names are listed


def test_bad_params_name_the_parameter() -> None:
    with pytest.raises(InputError, match="top_k"):
        validate_request("sample", "Hi", {"top_k": "many"})
    with pytest.raises(InputError, match="bogus"):
        validate_request("greedy", "Hi", {"bogus": 1})


@pytest.mark.parametrize("seed", [-1, "-5", MAX_SEED + 1, "abc", "", None, "1e3", "2.5", [1]])
def test_bad_seed(seed: object) -> None:
    with pytest.raises(InputError, match="seed"):
        validate_request("greedy", "Hi", seed=seed)


@pytest.mark.parametrize("seed, expected", [(0, 0), ("7", 7), (" 12 ", 12), (MAX_SEED, MAX_SEED)])
def test_good_seed(seed: object, expected: int) -> None:
    assert validate_seed(seed) == expected


@pytest.mark.parametrize("model", ["", "   ", None, 3])
def test_missing_model(model: object) -> None:
    with pytest.raises(InputError, match="[Nn]o model"):
        validate_request("greedy", "Hi", model=model)


@pytest.mark.parametrize(
    "model",
    [
        "a b",
        "model; rm -rf /",
        "$(whoami)",
        "<script>alert(1)</script>",
        "org/model?rev=1",
        "name\x00",
        "a\nb",
        "x" * 301,
    ],
)
def test_weird_model_names(model: str) -> None:
    with pytest.raises(InputError, match="not a model name") as info:
        validate_request("greedy", "Hi", model=model)
    assert repr(model.strip()[:80]) in str(info.value)


@pytest.mark.parametrize(
    "model", ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "./models/tiny", "~/m/x_1.0", "C:\\models\\m"]
)
def test_good_model_names(model: str) -> None:
    assert validate_model_spec(model) == model


@pytest.mark.parametrize("device", ["gpu", "CUDA", "", "cuda:0; rm", "tpu"])
def test_bad_device(device: str) -> None:
    with pytest.raises(InputError, match="device") as info:
        validate_request("greedy", "Hi", device=device)
    assert repr(device) in str(info.value)


@pytest.mark.parametrize("dtype", ["float64", "fp32", "", "int8", "BF16"])
def test_bad_dtype(dtype: str) -> None:
    with pytest.raises(InputError, match="dtype") as info:
        validate_request("greedy", "Hi", dtype=dtype)
    assert repr(dtype) in str(info.value)


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("auto", "bfloat16"), ("cuda", "float16")])
def test_good_device_and_dtype(device: str, dtype: str) -> None:
    request = validate_request("greedy", "Hi", device=device, dtype=dtype)
    assert (request.device, request.dtype) == (device, dtype)


def test_check_prompt_fits(tiny) -> None:
    context = tiny.config.max_position_embeddings  # 512
    check_prompt_fits(tiny, [1] * 100, 64)
    check_prompt_fits(tiny, [1] * (context - 64), 64)
    with pytest.raises(InputError, match="context of 512"):
        check_prompt_fits(tiny, [1] * (context - 63), 64)
