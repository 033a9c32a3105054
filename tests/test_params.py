"""Typed strategy parameters: declared specs (name, type, default, range, help) and validated building."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from lab.params import MAX_NEW_TOKENS_LIMIT, DecodeParams, InputError, build_params, param, param_specs
from strategies.greedy import GreedyParams
from strategies.sample import SampleParams


@dataclass(frozen=True)
class DemoParams(DecodeParams):
    """A Params class with the field types the baseline strategies do not use (bool, str with choices)."""

    verbose: bool = param(False, help="Show more.")
    mode: str = param("fast", choices=("fast", "exact"), help="Which path to take.")
    scale: float = param(1.0, low=0.0, high=10.0, help="A scale.")


def specs_by_name(cls: type) -> dict:
    return {spec.name: spec for spec in param_specs(cls)}


def test_sample_param_specs() -> None:
    specs = param_specs(SampleParams)
    assert [s.name for s in specs] == ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"]
    table = {s.name: (s.type, s.default, s.low, s.high) for s in specs}
    assert table == {
        "max_new_tokens": ("int", 128, 1, MAX_NEW_TOKENS_LIMIT),
        "temperature": ("float", 0.8, 0.05, 2.0),
        "top_k": ("int", 50, 0, 1000),
        "top_p": ("float", 0.95, 0.05, 1.0),
        "min_p": ("float", 0.0, 0.0, 0.5),
        "repetition_penalty": ("float", 1.0, 1.0, 2.0),
    }
    assert [s.common for s in specs] == [True, False, False, False, False, False]


def test_greedy_param_specs() -> None:
    specs = param_specs(GreedyParams)
    assert [(s.name, s.type, s.default, s.common) for s in specs] == [
        ("max_new_tokens", "int", 128, True),
        ("repetition_penalty", "float", 1.0, False),
    ]


@pytest.mark.parametrize("cls", [SampleParams, GreedyParams, DemoParams])
def test_every_spec_is_documented_and_its_default_is_valid(cls: type) -> None:
    for spec in param_specs(cls):
        assert spec.help.strip(), spec.name
        assert spec.choices is None or spec.default in spec.choices
        if spec.low is not None:
            assert spec.default >= spec.low, spec.name
        if spec.high is not None:
            assert spec.default <= spec.high, spec.name
        assert build_params(cls, {spec.name: spec.default}) == cls()


def test_spec_as_dict_is_plain_json_data() -> None:
    mode = specs_by_name(DemoParams)["mode"].as_dict()
    assert mode == {
        "name": "mode",
        "type": "str",
        "default": "fast",
        "low": None,
        "high": None,
        "choices": ["fast", "exact"],
        "help": "Which path to take.",
        "common": False,
    }
    assert specs_by_name(SampleParams)["top_k"].as_dict()["choices"] is None


def test_build_params_defaults() -> None:
    assert build_params(SampleParams, {}) == SampleParams()
    assert build_params(GreedyParams, {}).max_new_tokens == 128


def test_build_params_coerces_strings() -> None:
    params = build_params(SampleParams, {"temperature": "0.5", "top_k": "3", "max_new_tokens": "16", "top_p": "1"})
    assert params.temperature == 0.5 and isinstance(params.temperature, float)
    assert params.top_k == 3 and isinstance(params.top_k, int)
    assert params.max_new_tokens == 16 and isinstance(params.max_new_tokens, int)
    assert params.top_p == 1.0 and isinstance(params.top_p, float)
    assert build_params(SampleParams, {"top_k": "7.0"}).top_k == 7
    assert build_params(SampleParams, {"top_k": 7.0}).top_k == 7
    assert build_params(SampleParams, {"min_p": 0}).min_p == 0.0


@pytest.mark.parametrize(
    "raw, expected", [("true", True), ("True", True), ("1", True), ("yes", True), ("false", False), ("0", False)]
)
def test_build_params_coerces_bool_strings(raw: str, expected: bool) -> None:
    assert build_params(DemoParams, {"verbose": raw}).verbose is expected


def test_build_params_accepts_bools_and_choices() -> None:
    params = build_params(DemoParams, {"verbose": True, "mode": "exact", "scale": "2.5"})
    assert params == DemoParams(max_new_tokens=128, verbose=True, mode="exact", scale=2.5)


def test_unknown_keys_are_rejected_by_name() -> None:
    with pytest.raises(InputError, match="tempurature"):
        build_params(SampleParams, {"tempurature": 0.5})
    with pytest.raises(InputError, match="top_k"):
        build_params(GreedyParams, {"top_k": 5})  # a sample parameter is not a greedy one


@pytest.mark.parametrize(
    "cls, values, name",
    [
        (SampleParams, {"temperature": "3.0"}, "temperature"),
        (SampleParams, {"temperature": 0.0}, "temperature"),
        (SampleParams, {"top_k": -1}, "top_k"),
        (SampleParams, {"top_p": 1.01}, "top_p"),
        (SampleParams, {"max_new_tokens": 0}, "max_new_tokens"),
        (SampleParams, {"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1}, "max_new_tokens"),
        (GreedyParams, {"repetition_penalty": 0.5}, "repetition_penalty"),
        (DemoParams, {"scale": -0.1}, "scale"),
    ],
)
def test_out_of_range_values_are_rejected(cls: type, values: dict, name: str) -> None:
    with pytest.raises(InputError, match=f"{name}.*range"):
        build_params(cls, values)


def test_range_bounds_are_inclusive() -> None:
    assert build_params(SampleParams, {"max_new_tokens": 1}).max_new_tokens == 1
    assert build_params(SampleParams, {"max_new_tokens": MAX_NEW_TOKENS_LIMIT}).max_new_tokens == MAX_NEW_TOKENS_LIMIT
    assert build_params(SampleParams, {"temperature": 2.0}).temperature == 2.0


@pytest.mark.parametrize(
    "cls, values, name",
    [
        (SampleParams, {"top_k": "2.5"}, "top_k"),
        (SampleParams, {"max_new_tokens": 2.5}, "max_new_tokens"),
        (SampleParams, {"top_k": "three"}, "top_k"),
        (SampleParams, {"top_k": ""}, "top_k"),
        (SampleParams, {"temperature": "warm"}, "temperature"),
        (SampleParams, {"temperature": None}, "temperature"),
        (SampleParams, {"temperature": [0.5]}, "temperature"),
        (SampleParams, {"max_new_tokens": {"n": 3}}, "max_new_tokens"),
        (SampleParams, {"temperature": "nan"}, "temperature"),
        (SampleParams, {"temperature": math.nan}, "temperature"),
        (SampleParams, {"temperature": "inf"}, "temperature"),
        (SampleParams, {"top_p": -math.inf}, "top_p"),
        (SampleParams, {"temperature": "1e999"}, "temperature"),
        (SampleParams, {"top_k": "nan"}, "top_k"),
        (SampleParams, {"top_k": math.inf}, "top_k"),
        (DemoParams, {"verbose": "maybe"}, "verbose"),
        (DemoParams, {"mode": "slow"}, "mode"),
    ],
)
def test_wrong_types_and_non_finite_values_are_rejected(cls: type, values: dict, name: str) -> None:
    with pytest.raises(InputError, match=name):
        build_params(cls, values)


@pytest.mark.parametrize(
    "values, name",
    [({"top_k": True}, "top_k"), ({"max_new_tokens": False}, "max_new_tokens"), ({"temperature": True}, "temperature")],
)
def test_booleans_are_not_numbers(values: dict, name: str) -> None:
    """JSON true for a number (e.g. from the API) is a wrong type, not 1; the trace loader rejects it too."""
    with pytest.raises(InputError, match=name):
        build_params(SampleParams, values)


def test_input_error_is_a_value_error() -> None:
    assert issubclass(InputError, ValueError)
