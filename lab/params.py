"""Typed strategy parameters with defaults, ranges and help text (docs/architecture.md section 6).

A strategy's `Params` is a frozen dataclass whose fields are declared with `param(...)`. The CLI (`lab list
--json`, `--set key=value`) and the app build their controls from `param_specs`, and `build_params` validates
values once, server side, raising `InputError` with a message a user can act on.
`DecodeParams` holds the fields every strategy shares (max_new_tokens); the UI shows those once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

MAX_NEW_TOKENS_LIMIT = 1024


class InputError(ValueError):
    """Bad user input (prompt, parameter, strategy or model name); the message is shown to the user as is."""


POSITIVE = "> 0"  # `only_when=("temperature", POSITIVE)`: the field matters only while that parameter is above 0


def param(
    default: Any,
    *,
    help: str,
    low: float | None = None,
    high: float | None = None,
    choices: tuple | None = None,
    only_when: tuple[str, Any] | None = None,
) -> Any:
    """Declare a parameter field: default, inclusive range or choices, a help text (the formula it controls) and,
    when the field has an effect only under another parameter's values, `only_when=(name, value)`, value being
    one choice, a tuple of choices, or POSITIVE. The app hides the control otherwise (`lab.app.controls`)."""
    if only_when is not None:
        name, values = only_when
        only_when = (name, values if values == POSITIVE or isinstance(values, tuple) else (values,))
    metadata = {"low": low, "high": high, "choices": choices, "help": help, "only_when": only_when}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str  # int | float | bool | str
    default: Any
    low: float | None
    high: float | None
    choices: tuple | None
    help: str
    common: bool  # shared by every strategy (declared on DecodeParams)
    only_when: tuple[str, Any] | None = None  # (parameter, its choices or POSITIVE) under which this one matters

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        del data["only_when"]  # a UI rule (lab.app.controls), not part of `lab list --json`'s parameter record
        data["choices"] = list(self.choices) if self.choices else None
        return data


@dataclass(frozen=True)
class DecodeParams:
    """Fields every strategy has."""

    max_new_tokens: int = param(
        128, low=1, high=MAX_NEW_TOKENS_LIMIT, help="Stop after this many new tokens (or at end-of-sequence)."
    )


COMMON_FIELDS = {f.name for f in dataclasses.fields(DecodeParams)}


def param_specs(params_cls: type) -> list[ParamSpec]:
    """The declared parameters of a Params dataclass, in declaration order."""
    hints = get_type_hints(params_cls)
    specs = []
    for spec in dataclasses.fields(params_cls):
        meta = spec.metadata
        specs.append(
            ParamSpec(
                name=spec.name,
                type=hints[spec.name].__name__,
                default=spec.default,
                low=meta.get("low"),
                high=meta.get("high"),
                choices=meta.get("choices"),
                help=meta.get("help", ""),
                common=spec.name in COMMON_FIELDS,
                only_when=meta.get("only_when"),
            )
        )
    return specs


def _coerce(spec: ParamSpec, value: Any) -> Any:
    """Turn a CLI string or JSON value into the declared type, or raise InputError."""
    if spec.type in ("int", "float") and isinstance(value, bool):
        raise InputError(f"Parameter {spec.name!r} must be a {spec.type}, got {value!r}.")
    try:
        if spec.type == "bool":
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if spec.type == "int":
            number = float(value)
            if not number.is_integer():
                raise ValueError(value)
            return int(number)
        if spec.type == "float":
            number = float(value)
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError(value)
            return number
        return str(value)
    except (TypeError, ValueError):
        raise InputError(f"Parameter {spec.name!r} must be a {spec.type}, got {value!r}.") from None


def build_params(params_cls: type, values: dict[str, Any]) -> Any:
    """Validate `values` against the Params dataclass (unknown keys, types, ranges, choices) and build it."""
    specs = {spec.name: spec for spec in param_specs(params_cls)}
    unknown = sorted(set(values) - set(specs))
    if unknown:
        raise InputError(f"Unknown parameter(s) {', '.join(unknown)}; known: {', '.join(specs)}.")
    built = {}
    for name, raw in values.items():
        spec = specs[name]
        value = _coerce(spec, raw)
        if spec.low is not None and value < spec.low or spec.high is not None and value > spec.high:
            raise InputError(f"Parameter {name!r} = {value} is out of range [{spec.low}, {spec.high}].")
        if spec.choices and value not in spec.choices:
            raise InputError(f"Parameter {name!r} = {value!r} is not one of {', '.join(map(str, spec.choices))}.")
        built[name] = value
    return params_cls(**built)
