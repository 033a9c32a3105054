"""Which parameters have an effect, given the others: the app hides controls that do nothing for the current
settings (e.g. speculative's draft_layers unless drafter = self-draft).

Each parameter declares the rule on its field: `param(..., only_when=("drafter", "self-draft"))` (a choice, a
tuple of choices, or `lab.params.POSITIVE` for "while that parameter is above 0"). A parameter without one is
always shown. Covered: `dependencies` and `visibility`. Not covered: rules that need more than one other
parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab.params import POSITIVE, param_specs


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


def dependencies(params_cls: type) -> dict[str, Dependency]:
    """The dependency of every parameter that has one, by parameter name."""
    found = {}
    for spec in param_specs(params_cls):
        if spec.only_when is not None:
            controller, values = spec.only_when
            positive = values == POSITIVE
            found[spec.name] = Dependency(spec.name, controller, () if positive else values, positive)
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
