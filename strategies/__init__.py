"""Strategy registry: one module per method, looked up by the names the CLI, app, bench and traces share.

Every module of this package that defines `STRATEGY` is registered (found with pkgutil, so adding a strategy
is adding a module); `ORDER` fixes the listing order, unknown names come after it alphabetically.
"""

from __future__ import annotations

import importlib
import pkgutil

from lab.params import InputError
from strategies.base import FAMILIES, Strategy, collect

ORDER = ("greedy", "sample", "dola", "cfg", "mirostat", "speculative", "ssd", "medusa", "mtpc", "eagle", "tot", "rlm")


def _discover() -> dict[str, Strategy]:
    """Import every strategy module of this package and key its STRATEGY by name, in ORDER."""
    found: dict[str, Strategy] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        strategy = getattr(importlib.import_module(f"{__name__}.{info.name}"), "STRATEGY", None)
        if isinstance(strategy, Strategy):
            found[strategy.name] = strategy
    rank = {name: index for index, name in enumerate(ORDER)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(ORDER)), item[0])))


REGISTRY: dict[str, Strategy] = _discover()


def get_strategy(name: str) -> Strategy:
    """The registered strategy called `name`, or an InputError listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise InputError(f"Unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}.") from None


def by_family() -> dict[str, list[Strategy]]:
    """Registered strategies grouped by family, in the fixed family order."""
    return {family: [s for s in REGISTRY.values() if s.family == family] for family in FAMILIES}


__all__ = ["REGISTRY", "Strategy", "by_family", "collect", "get_strategy"]
