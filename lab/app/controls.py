"""Which parameters have an effect, given the others: the app hides controls that do nothing for the current
settings (e.g. speculative's draft_layers unless drafter = self-draft).

The rule is read from each parameter's help text, so strategies that land later follow it without changes here:
- "NAME=VALUE: ..." (NAME another parameter): has an effect only when NAME == VALUE;
- "A: ..." or "A / B: ..." where A, B are choices of another parameter: only when that parameter is one of them
  (e.g. Medusa's "typical / sample: ..." under mode, Mirostat's "v1: ..." under version);
- "<Choice> ... only: ..." where <choice> is a choice of another parameter: only under that choice
  (DoLa's "Soft contrast only: ..." under mode = soft);
- "Sampling only: ...": only when the strategy's temperature > 0.
A parameter matching no rule is always shown. Covered: `dependencies` and `visibility`. Not covered: rules
that need more than one other parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lab.params import ParamSpec, param_specs

_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*)=([\w.-]+):")
_CHOICES = re.compile(r"^\s*([\w.-]+(?:\s*/\s*[\w.-]+)*):")
_ONLY = re.compile(r"^\s*(\w+)[^:]*\bonly:", re.IGNORECASE)


@dataclass(frozen=True)
class Dependency:
    """`field` has an effect only when `controller`'s value is in `values` (or > 0 when `positive`)."""

    field: str
    controller: str
    values: tuple[Any, ...] = ()
    positive: bool = False

    def active(self, value: Any) -> bool:
        if self.positive:
            return isinstance(value, (int, float)) and value > 0
        return value in self.values


def _choice_owner(specs: list[ParamSpec], field: str, words: list[str]) -> ParamSpec | None:
    """The other parameter whose choices include every word (case-insensitive), if any."""
    for spec in specs:
        if spec.name == field or not spec.choices:
            continue
        choices = {str(c).lower() for c in spec.choices}
        if all(word.lower() in choices for word in words):
            return spec
    return None


def _dependency(spec: ParamSpec, specs: list[ParamSpec]) -> Dependency | None:
    names = {s.name for s in specs}
    match = _ASSIGN.match(spec.help)
    if match and match.group(1) in names and match.group(1) != spec.name:
        return Dependency(spec.name, match.group(1), (match.group(2),))
    match = _CHOICES.match(spec.help)
    if match:
        words = [w.strip() for w in match.group(1).split("/")]
        owner = _choice_owner(specs, spec.name, words)
        if owner is not None:
            values = tuple(c for c in owner.choices if str(c).lower() in {w.lower() for w in words})
            return Dependency(spec.name, owner.name, values)
    match = _ONLY.match(spec.help)
    if match:
        word = match.group(1)
        owner = _choice_owner(specs, spec.name, [word])
        if owner is not None:
            return Dependency(spec.name, owner.name, tuple(c for c in owner.choices if str(c).lower() == word.lower()))
        if word.lower() == "sampling" and "temperature" in names and spec.name != "temperature":
            return Dependency(spec.name, "temperature", positive=True)
    return None


def dependencies(params_cls: type) -> dict[str, Dependency]:
    """The dependency of every parameter that has one, by parameter name."""
    specs = param_specs(params_cls)
    found = {}
    for spec in specs:
        dependency = _dependency(spec, specs)
        if dependency is not None:
            found[spec.name] = dependency
    return found


def visibility(params_cls: type, values: dict[str, Any]) -> dict[str, bool]:
    """Per parameter: whether it has an effect under `values` (missing values read as the defaults)."""
    specs = param_specs(params_cls)
    current = {spec.name: values.get(spec.name, spec.default) for spec in specs}
    rules = dependencies(params_cls)
    return {
        spec.name: spec.name not in rules or rules[spec.name].active(current[rules[spec.name].controller])
        for spec in specs
    }
