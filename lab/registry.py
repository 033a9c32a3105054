"""The strategy registry, below both `lab` and `strategies` (docs/architecture.md section 2): the `Strategy` contract
and the lookup by name that the CLI, validation, the bench and the evals share.

Strategies register themselves (`register`, called for every module of the plugin package that defines
`STRATEGY`); code under `lab/` never imports `strategies/`: the first lookup loads the plugin package by name
(`STRATEGY_PACKAGE`, importlib), the way plugin registries load entry points. `ORDER` fixes the listing order;
unknown names come after it alphabetically.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.params import InputError
from lab.trace import Event

FAMILIES = ("baseline", "logit-level", "system 2", "speculative", "multi-token heads")
ORDER = ("greedy", "sample", "dola", "cfg", "mirostat", "speculative", "ssd", "medusa", "mtpc", "eagle", "tot", "rlm")
STRATEGY_PACKAGE = "strategies"

RunFn = Callable[[LoadedModel, list[int], object, torch.Generator], Iterator[Event]]


@dataclass(frozen=True)
class Strategy:
    """A decoding method: `run(model, prompt_ids, params, generator)` yields trace events as it decodes."""

    name: str
    family: str
    summary: str
    paper: str
    Params: type
    run: RunFn
    # what the prompt must hold under the given params, for the empty-prompt message ("four numbers such as ...")
    prompt_hint: Callable[[object], str] | None = None
    # (button label, params -> prompt): a prompt the method can write from its own settings (RLM's task question)
    task_prompt: tuple[str, Callable[[object], str | None]] | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r} for strategy {self.name!r}")


def collect(events: Iterator[Event]) -> list[Event]:
    """The non-streaming result of a run: every event it yields."""
    return list(events)


_REGISTRY: dict[str, Strategy] = {}
_LOCK = threading.Lock()


def register(strategies: list[Strategy]) -> dict[str, Strategy]:
    """Add strategies (the plugin package calls this once) and keep the registry in ORDER."""
    with _LOCK:
        found = {**_REGISTRY, **{s.name: s for s in strategies}}
        rank = {name: index for index, name in enumerate(ORDER)}
        _REGISTRY.clear()
        _REGISTRY.update(sorted(found.items(), key=lambda item: (rank.get(item[0], len(ORDER)), item[0])))
        return _REGISTRY


def registry() -> dict[str, Strategy]:
    """Every registered strategy by name, loading the plugin package on first use."""
    if not _REGISTRY:
        importlib.import_module(STRATEGY_PACKAGE)
    return _REGISTRY


def get_strategy(name: str) -> Strategy:
    """The registered strategy called `name`, or an InputError listing the known names."""
    strategies = registry()
    try:
        return strategies[name]
    except KeyError:
        raise InputError(f"Unknown strategy {name!r}; choose one of {', '.join(strategies)}.") from None


def by_family() -> dict[str, list[Strategy]]:
    """Registered strategies grouped by family, in the fixed family order."""
    strategies = registry()
    return {family: [s for s in strategies.values() if s.family == family] for family in FAMILIES}
